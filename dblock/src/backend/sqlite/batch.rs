//! Coalesced statements on SQLite (`backend/coalesce.rs`): the acquires or the releases of many
//! callers, on distinct keys, as one statement over a `VALUES` list. The time of a SQLite lock
//! call is mostly the driver's per statement (a hop to the connection's worker thread and
//! back, binding, stepping) and, for an acquire, a WAL flush at commit: one statement for the
//! batch pays each once.
//!
//! Atomicity: SQLite runs every write statement under the database's single write lock, so a
//! statement's rows are decided and written without any other writer in between, and the
//! statement commits whole or not at all. Each row is decided as its one-row statement decides
//! it (`sqlite.rs`): the acquire is the same `INSERT ... ON CONFLICT DO UPDATE ... WHERE`, with
//! the row's own values read from `excluded` and, for what the process holds of the key (no
//! column carries it), from the request list by key, which is unique in a batch; the release
//! is the same owner-, tenure- and lease-checked `UPDATE`.
//!
//! The list has [`listed`] entries, the batch padded with NULL keys that match nothing: seven
//! statement texts per kind, each prepared once per connection.

use sqlx::query::Query;
use sqlx::sqlite::{Sqlite, SqliteArguments, SqliteConnection, SqliteRow};
use sqlx::{AssertSqlSafe, Row, SqlSafeStr, SqlStr};

use super::{bind_acquire, keyed_grant, ran_out, sql, Lite, SAME, TAKE_OVER};
use crate::backend::coalesce::{listed, pad, ReleaseRow, MAX_ROWS as MAX};
use crate::backend::{per_key, Acquire, Attempt, Extended, Outcome, Released, RenewItem};

/// The coalesced statements of one table, by list size: `[i]` takes `2 << i` rows.
#[derive(Debug)]
pub(crate) struct Sql {
    acquire: Vec<SqlStr>,
    release: Vec<SqlStr>,
}

/// Acquires: nine values per row (key, owner, ttl ms, holder, attempt id, tenure the process
/// tracks, holds it tracks, min_hold ms, once), as the one-row statement's `$1`-`$9`.
const ACQUIRE: &str = "WITH req(k, own, ttl, hold, att, tenure, held, min_hold, once) AS (
    VALUES {rows}
)
INSERT INTO {table} AS l
    (lock_key, owner, hold_count, fencing_token, expires_at, acquired_at, holder, attempt_id,
     available_at, once_key)
SELECT k, own, 1, {now} * 1000, {now} + max(ttl, min_hold), {now}, hold, att,
       CASE WHEN min_hold > 0 THEN {now} + min_hold END, once
FROM req WHERE k IS NOT NULL
{take_over}
RETURNING lock_key, hold_count, fencing_token, expires_at * 1000";

/// Releases: six values per row (key, owner, tenure, release id, holds left, outcome or NULL),
/// as the one-row statement's `$1`-`$6`.
const RELEASE: &str = "WITH req(k, own, token, rid, remaining, outcome) AS (
    VALUES {rows}
)
UPDATE {table} AS l SET
    hold_count   = r.remaining,
    owner        = CASE WHEN r.remaining > 0 THEN l.owner END,
    expires_at   = CASE WHEN r.remaining > 0 THEN l.expires_at
                        ELSE max({now}, coalesce(l.available_at, 0)) END,
    last_outcome = CASE WHEN r.remaining > 0 THEN l.last_outcome
                        WHEN l.success_token IS l.fencing_token THEN 1
                        ELSE coalesce(r.outcome, l.last_outcome) END,
    finished_at  = CASE WHEN r.remaining > 0 OR r.outcome IS NULL THEN l.finished_at
                        ELSE {now} END,
    attempt_id   = r.rid,
    release_id   = r.rid,
    release_token = l.fencing_token
FROM req AS r
WHERE l.lock_key = r.k AND l.owner = r.own AND l.fencing_token = r.token
  AND l.attempt_id IS NOT r.rid AND l.expires_at > {now}
RETURNING lock_key, hold_count";

/// `n` rows of `width` `?` placeholders.
fn rows(n: usize, width: usize) -> String {
    let row = format!("({})", vec!["?"; width].join(", "));
    vec![row; n].join(",\n    ")
}

/// The index of the statement whose list takes `n` rows.
fn size_index(n: usize) -> usize {
    listed(n).trailing_zeros() as usize - 1
}

impl Sql {
    pub(crate) fn new(table: &str) -> Sql {
        let of_key =
            |column: &str| format!("(SELECT {column} FROM req WHERE req.k = excluded.lock_key)");
        let take_over = TAKE_OVER
            .replace("{same}", SAME)
            .replace("{ran_out_l}", &ran_out("l."))
            .replace("{tenure}", &of_key("tenure"))
            .replace("{held}", &of_key("held"))
            .replace("{once}", "excluded.once_key");
        let sizes = (0..=size_index(MAX)).map(|i| 2usize << i);
        Sql {
            acquire: sizes
                .clone()
                .map(|n| {
                    sql(
                        &ACQUIRE
                            .replace("{take_over}", &take_over)
                            .replace("{rows}", &rows(n, 9)),
                        table,
                    )
                })
                .collect(),
            release: sizes
                .map(|n| sql(&RELEASE.replace("{rows}", &rows(n, 6)), table))
                .collect(),
        }
    }
}

pub(crate) async fn acquire(
    lite: &Lite,
    conn: &mut SqliteConnection,
    all: &[Acquire<'_>],
) -> Result<Vec<Attempt>, sqlx::Error> {
    if all.len() > MAX {
        return crate::backend::acquire_in_transaction(lite, conn, all).await;
    }
    let q = bind_acquires(
        sqlx::query(lite.batch_sql.acquire[size_index(all.len())].clone()),
        all,
    );
    let granted = q.fetch_all(&mut *conn).await?;
    attempts(lite, conn, all, &granted).await
}

/// The acquire statement's values for `all`, padded to its list.
fn bind_acquires<'q>(
    q: Query<'q, Sqlite, SqliteArguments>,
    all: &[Acquire<'q>],
) -> Query<'q, Sqlite, SqliteArguments> {
    let n = all.len();
    pad(all.iter().fold(q, bind_acquire), n, 9)
}

/// Each acquire's attempt, from the rows its statement returned (the grants, by key).
async fn attempts(
    lite: &Lite,
    conn: &mut SqliteConnection,
    all: &[Acquire<'_>],
    granted: &[SqliteRow],
) -> Result<Vec<Attempt>, sqlx::Error> {
    let grants = granted
        .iter()
        .map(keyed_grant)
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = per_key(all, grants);
    for (a, attempt) in all.iter().zip(&mut out) {
        if a.once && matches!(attempt, Attempt::Busy { .. }) {
            // Busy: was it done? Read as the one-row acquire reads it.
            *attempt = lite.done(conn, a.key).await?;
        }
    }
    Ok(out)
}

pub(crate) async fn release(
    lite: &Lite,
    conn: &mut SqliteConnection,
    all: &[ReleaseRow],
) -> Result<Vec<Released>, sqlx::Error> {
    if all.len() > MAX {
        return crate::backend::release_in_transaction(lite, conn, all).await;
    }
    let q = bind_releases(
        sqlx::query(lite.batch_sql.release[size_index(all.len())].clone()),
        all,
    );
    let left = q.fetch_all(&mut *conn).await?;
    released(all, &left)
}

/// The release statement's values for `all`, padded to its list.
fn bind_releases<'q>(
    mut q: Query<'q, Sqlite, SqliteArguments>,
    all: &'q [ReleaseRow],
) -> Query<'q, Sqlite, SqliteArguments> {
    for r in all {
        q = q
            .bind(r.key.as_str())
            .bind(r.owner.as_str())
            .bind(r.fencing_token as i64)
            .bind(r.release_id)
            .bind(i64::from(r.remaining))
            .bind(r.outcome.map(Outcome::code));
    }
    pad(q, all.len(), 6)
}

/// Each release's answer, from the rows its statement returned (`lock_key, hold_count` of
/// the rows it released).
fn released(all: &[ReleaseRow], left: &[SqliteRow]) -> Result<Vec<Released>, sqlx::Error> {
    let mut by_key = std::collections::HashMap::with_capacity(left.len());
    for row in left {
        by_key.insert(row.try_get::<String, _>(0)?, row.try_get::<i64, _>(1)?);
    }
    Ok(all
        .iter()
        .map(|r| match by_key.get(r.key.as_str()) {
            None => Released::NotHeld,
            Some(0) => Released::Free,
            Some(n) => Released::StillHeld((*n).max(0) as u32),
        })
        .collect())
}

/// Rows of every kind in one transaction: one commit, one WAL flush, where a statement per
/// kind would pay one each (`BEGIN IMMEDIATE`: the write lock from the start, so no statement
/// of it waits on another writer half-way). The releases and the acquires are their own
/// statements as above, sent together as one command (one hop to the connection's thread);
/// a failure rolls back all of them, and every row's caller settles its own row by its
/// attempt or release id, as for a batch of one kind. Releases, lazily durable on their own,
/// are durable here: they share the acquires' flush.
pub(crate) async fn write(
    lite: &Lite,
    conn: &mut SqliteConnection,
    acquires: &[Acquire<'_>],
    releases: &[ReleaseRow],
    extends: &[RenewItem<'_>],
) -> Result<(Vec<Attempt>, Vec<Released>, Extended), sqlx::Error> {
    let mut tx = sqlx::Connection::begin_with(conn, "BEGIN IMMEDIATE").await?;
    let extended = if extends.is_empty() {
        Vec::new()
    } else {
        crate::backend::Dialect::extend_many(lite, &mut tx, extends).await?
    };
    let (attempts, released) = match (acquires.is_empty(), releases.is_empty()) {
        (true, true) => (Vec::new(), Vec::new()),
        (true, false) => (Vec::new(), release(lite, &mut tx, releases).await?),
        (false, true) => (acquire(lite, &mut tx, acquires).await?, Vec::new()),
        (false, false) => {
            // Two statements, one command: the releases' rows come back with two columns,
            // the acquires' with four.
            let text = format!(
                "{};\n{}",
                lite.batch_sql.release[size_index(releases.len())].as_str(),
                lite.batch_sql.acquire[size_index(acquires.len())].as_str()
            );
            let q = bind_releases(sqlx::query(AssertSqlSafe(text).into_sql_str()), releases);
            let rows = bind_acquires(q, acquires).fetch_all(&mut *tx).await?;
            let (left, granted): (Vec<SqliteRow>, Vec<SqliteRow>) =
                rows.into_iter().partition(|r| r.len() == 2);
            (
                attempts(lite, &mut tx, acquires, &granted).await?,
                released(releases, &left)?,
            )
        }
    };
    tx.commit().await?;
    Ok((attempts, released, extended))
}

#[cfg(test)]
mod tests {
    use super::size_index;

    #[test]
    fn every_batch_size_has_the_smallest_list_that_takes_it() {
        assert_eq!(size_index(1), 0);
        assert_eq!(size_index(2), 0);
        assert_eq!(size_index(3), 1);
        assert_eq!(size_index(4), 1);
        assert_eq!(size_index(5), 2);
        assert_eq!(size_index(33), 5);
        assert_eq!(size_index(64), 5);
        for n in 1..=64 {
            let cap = 2usize << size_index(n);
            assert!(
                cap >= n && cap < 2 * n.max(2),
                "{n} rows in a list of {cap}"
            );
        }
    }
}
