//! Coalesced statements on SQLite (`backend/coalesce/`): the acquires or the releases of many
//! callers, on distinct keys, as one statement over a `VALUES` list. The time of a SQLite lock
//! call is mostly the driver's per statement (a hop to the connection's worker thread and
//! back, binding, stepping) and, for an acquire, a WAL flush at commit: one statement for the
//! batch pays each once.
//!
//! Atomicity: SQLite runs every write statement under the database's single write lock, so a
//! statement's rows are decided and written without any other writer in between, and the
//! statement commits whole or not at all. Each row is decided as its one-row statement decides
//! it (`sql.rs`): the acquire is the same `INSERT ... ON CONFLICT DO UPDATE ... WHERE`, with
//! the row's own values read from `excluded` and, for what the process holds of the key (no
//! column carries it), from the request list by key, which is unique in a batch; the release
//! is the same owner-, tenure- and lease-checked `UPDATE`.
//!
//! The list has [`listed`] entries, the batch padded with NULL keys that match nothing: seven
//! statement texts per kind, each prepared once per connection.

use super::OnSqlite;
use sqlx::query::Query;
use sqlx::sqlite::{Sqlite, SqliteArguments, SqliteConnection, SqliteRow};
use sqlx::{AssertSqlSafe, Row, SqlSafeStr, SqlStr};

use super::{ran_out, sql, Lite, SAME, TAKE_OVER};
use crate::backend::batch::{listed, pad};
use crate::backend::coalesce::{ReleaseRow, MAX_ROWS as MAX};
use crate::backend::{
    per_key_decoded, Acquire, Attempt, Binds, Extended, Outcome, Released, RenewItem,
};

/// The coalesced statements of one table, by list size: `[i]` takes `2 << i` rows.
#[derive(Debug)]
pub(crate) struct Sql {
    acquire: Vec<SqlStr>,
    release: Vec<SqlStr>,
}

/// Acquires: nine values per row, [`Acquire::args`] (key, owner, ttl µs, holder, attempt id,
/// tenure the process tracks, holds it tracks, min_hold µs, once), as the one-row statement's
/// `$1`-`$9`, its times rounded up to milliseconds as there.
const ACQUIRE: &str = "WITH req(k, own, ttl, hold, att, tenure, held, min_hold, once) AS (
    VALUES {rows}
)
INSERT INTO {table} AS l
    (lock_key, owner, hold_count, fencing_token, expires_at, acquired_at, holder, attempt_id,
     available_at, once_key)
SELECT k, own, 1, {now} * 1000, {now} + max((ttl + 999) / 1000, (min_hold + 999) / 1000), {now},
       hold, att, CASE WHEN min_hold > 0 THEN {now} + (min_hold + 999) / 1000 END, once
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
    expires_at   = CASE WHEN r.remaining > 0 THEN l.expires_at WHEN r.outcome IS NULL THEN {now}
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

async fn acquire(
    lite: &Lite,
    conn: &mut SqliteConnection,
    all: &[Acquire<'_>],
) -> sqlx::Result<Vec<Attempt>> {
    if all.len() > MAX {
        return one_by_one(lite, conn, all).await;
    }
    let q = bind_acquires(
        sqlx::query(lite.batch_sql.acquire[size_index(all.len())].clone()),
        all,
    )?;
    let granted = q.fetch_all(&mut *conn).await?;
    attempts(lite, conn, all, &granted).await
}

/// The acquire statement's values for `all`, padded to its list.
fn bind_acquires<'q>(
    q: Query<'q, Sqlite, SqliteArguments>,
    all: &[Acquire<'_>],
) -> sqlx::Result<Query<'q, Sqlite, SqliteArguments>> {
    let q = all
        .iter()
        .flat_map(Acquire::args)
        .try_fold(q, Sqlite::bind_value)?;
    Ok(pad(q, all.len(), 9))
}

/// Each acquire's attempt, from the rows its statement returned (the grants, by key).
async fn attempts(
    lite: &Lite,
    conn: &mut SqliteConnection,
    all: &[Acquire<'_>],
    granted: &[SqliteRow],
) -> sqlx::Result<Vec<Attempt>> {
    let grants = granted
        .iter()
        .map(|row| crate::backend::keyed_grant(row, 1));
    let mut out = per_key_decoded(all, grants)?;
    for (a, attempt) in all.iter().zip(&mut out) {
        if a.once && matches!(attempt, Attempt::Busy { .. }) {
            // Busy: was it done? Read as the one-row acquire reads it.
            *attempt = lite.done(conn, a.key).await?;
        }
    }
    Ok(out)
}

async fn release(
    lite: &Lite,
    conn: &mut SqliteConnection,
    all: &[ReleaseRow],
) -> sqlx::Result<Vec<Released>> {
    if all.len() > MAX {
        let statements: Vec<_> = all.iter().map(ReleaseRow::statement).collect();
        return one_by_one(lite, conn, &statements).await;
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
    all: &[ReleaseRow],
) -> Query<'q, Sqlite, SqliteArguments> {
    for r in all {
        q = q
            .bind(r.key())
            .bind(r.owner())
            .bind(r.fencing_token as i64)
            .bind(r.release_id)
            .bind(i64::from(r.remaining))
            .bind(r.outcome.map(Outcome::code));
    }
    pad(q, all.len(), 6)
}

/// Each release's answer, from the rows its statement returned (`lock_key, hold_count` of
/// the rows it released).
fn released(all: &[ReleaseRow], left: &[SqliteRow]) -> sqlx::Result<Vec<Released>> {
    let mut by_key = std::collections::HashMap::with_capacity(left.len());
    for row in left {
        by_key.insert(row.try_get::<String, _>(0)?, row.try_get::<i64, _>(1)?);
    }
    Ok(all
        .iter()
        .map(|r| match by_key.get(r.key()) {
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
///
/// This is sqlx's transaction (begin, statements, commit: three hops), for a batch with
/// extensions; releases and acquires alone go as one command, begin and commit included
/// ([`write_whole`]).
pub(crate) async fn write(
    lite: &Lite,
    conn: &mut SqliteConnection,
    acquires: &[Acquire<'_>],
    releases: &[ReleaseRow],
    extends: &[RenewItem<'_>],
) -> sqlx::Result<(Vec<Attempt>, Vec<Released>, Extended)> {
    let mut tx = sqlx::Connection::begin_with(conn, "BEGIN IMMEDIATE").await?;
    let extended = if extends.is_empty() {
        Vec::new()
    } else {
        crate::backend::ExtendMany(extends)
            .sqlite(lite, &mut tx)
            .await?
    };
    let (attempts, released) = match (acquires.is_empty(), releases.is_empty()) {
        (true, true) => (Vec::new(), Vec::new()),
        (true, false) => (Vec::new(), release(lite, &mut tx, releases).await?),
        (false, true) => (acquire(lite, &mut tx, acquires).await?, Vec::new()),
        (false, false) => {
            let rows = both(lite, acquires, releases, "", "")?
                .fetch_all(&mut *tx)
                .await?;
            answers(lite, &mut tx, acquires, releases, rows).await?
        }
    };
    tx.commit().await?;
    Ok((attempts, released, extended))
}

/// Whether [`write_whole`] takes these rows: at most a list's worth of each kind.
pub(crate) fn one_command(acquires: &[Acquire<'_>], releases: &[ReleaseRow]) -> bool {
    acquires.len() <= MAX && releases.len() <= MAX
}

/// Releases and acquires in one transaction, sent as one command: `BEGIN IMMEDIATE`, the
/// release statement, the acquire statement, `COMMIT`. One hop to the connection's thread
/// instead of three (the begin, the statements, the commit as sqlx's transaction sends them),
/// in a transaction that otherwise takes 0.4 ms, most of it the WAL flush.
///
/// The command must run to its end (`backend::run_to_end`, which `Backend::write_batch` sends
/// it through): a command dropped half-way (at a deadline, say) would stop after the statement
/// it was on, before the `COMMIT`, and leave the transaction open on a pooled connection, where
/// the next statement of any caller would run inside it and every other connection would wait
/// for the write lock it holds. Its wait is bounded all the same: by the busy timeout for the
/// write lock, and the statements are the batch's own rows. The batch's callers do not wait
/// for it past their own deadlines ([`coalesce`](crate::backend::coalesce): "outcome unknown",
/// settled by attempt or release id, as for any batch), and the process's turn at the database
/// ([`Dialect::one_at_a_time`](crate::backend::Dialect::one_at_a_time)) is given up at the batch's
/// deadline, as when a statement was cut there. A command that fails half-way (the write lock not
/// had within the busy timeout, a disk error) is rolled back before the connection goes back to
/// the pool; one whose state cannot be put right is closed.
pub(crate) async fn write_whole(
    lite: &Lite,
    conn: &mut sqlx::pool::PoolConnection<Sqlite>,
    acquires: &[Acquire<'_>],
    releases: &[ReleaseRow],
) -> sqlx::Result<(Vec<Attempt>, Vec<Released>)> {
    // Nothing is sent when the values do not bind.
    let q = both(lite, acquires, releases, "BEGIN IMMEDIATE;\n", ";\nCOMMIT")?;
    let rows = match q.fetch_all(&mut **conn).await {
        Ok(rows) => rows,
        Err(e) => {
            end_transaction(conn).await;
            return Err(e);
        }
    };
    // A `once` row found busy reads whether its key is done, after the commit, as the one-row
    // acquire does after its statement.
    answers(lite, conn, acquires, releases, rows).await
}

/// After a command of [`write_whole`] failed: rolls back the transaction it may have left
/// open. There is none if `BEGIN` itself failed, or if SQLite rolled it back on its own (as it
/// does on a full disk or an I/O error); a rollback that fails otherwise leaves the connection
/// in a state nobody knows, and it is closed instead of pooled again.
async fn end_transaction(conn: &mut sqlx::pool::PoolConnection<Sqlite>) {
    match sqlx::Executor::execute(&mut **conn, "ROLLBACK").await {
        Ok(_) => {}
        Err(sqlx::Error::Database(e)) if e.message().contains("no transaction is active") => {}
        Err(e) => {
            tracing::warn!(error = %e, "rolling back a failed coalesced transaction failed; its connection is closed");
            conn.close_on_drop();
        }
    }
}

/// The release statement and the acquire statement as one command, between `before` and
/// `after`, with the rows' values bound. The releases' rows come back with two columns, the
/// acquires' with four.
fn both(
    lite: &Lite,
    acquires: &[Acquire<'_>],
    releases: &[ReleaseRow],
    before: &str,
    after: &str,
) -> sqlx::Result<Query<'static, Sqlite, SqliteArguments>> {
    let text = format!(
        "{before}{};\n{}{after}",
        lite.batch_sql.release[size_index(releases.len())].as_str(),
        lite.batch_sql.acquire[size_index(acquires.len())].as_str()
    );
    let q = bind_releases(sqlx::query(AssertSqlSafe(text).into_sql_str()), releases);
    bind_acquires(q, acquires)
}

/// Each row's answer from the rows [`both`] returned.
async fn answers(
    lite: &Lite,
    conn: &mut SqliteConnection,
    acquires: &[Acquire<'_>],
    releases: &[ReleaseRow],
    rows: Vec<SqliteRow>,
) -> sqlx::Result<(Vec<Attempt>, Vec<Released>)> {
    let (left, granted): (Vec<SqliteRow>, Vec<SqliteRow>) =
        rows.into_iter().partition(|r| r.len() == 2);
    Ok((
        attempts(lite, conn, acquires, &granted).await?,
        released(releases, &left)?,
    ))
}

// Coalesced acquires and releases of distinct keys: one statement each (above).
crate::backend::runs! {
    OnSqlite, sqlite, Lite, SqliteConnection;
    crate::backend::coalesce::AcquireBatch<'_> => acquire,
    crate::backend::coalesce::ReleaseBatch<'_> => release,
}

/// More rows than one statement lists: the one-row statements in one transaction, under the
/// write lock from its start, their answers in order.
async fn one_by_one<S: OnSqlite>(
    lite: &Lite,
    conn: &mut SqliteConnection,
    statements: &[S],
) -> sqlx::Result<Vec<S::Output>> {
    super::in_one_transaction(lite, conn, Some("BEGIN IMMEDIATE"), statements).await
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;
    use std::time::Duration;

    use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
    use tokio::time::Instant;

    use super::{size_index, Lite};
    use crate::backend::coalesce::ReleaseRow;
    use crate::backend::{Acquire, Attempt, Backend, Released};

    /// A lock table in a file, the locker's connections to it, another connection that never
    /// waits for the write lock, and key `a` held by owner `o` (tenure 7).
    struct Db {
        lite: Lite,
        other: SqlitePool,
        _dir: tempfile::TempDir,
    }

    async fn db() -> Db {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("l.db").display());
        crate::Locker::connect(&url)
            .await
            .unwrap()
            .migrate()
            .await
            .unwrap();
        let opts = crate::ConnectOptions::default();
        let lite = crate::backend::sqlite::connect(&url, "dblock_locks", &opts)
            .await
            .unwrap();
        let other = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(
                SqliteConnectOptions::from_str(&url)
                    .unwrap()
                    .busy_timeout(Duration::ZERO),
            )
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO dblock_locks (lock_key, owner, hold_count, fencing_token, expires_at,
             acquired_at) VALUES ('a', 'o', 1, 7, 32503680000000, 0)",
        )
        .execute(&other)
        .await
        .unwrap();
        Db {
            lite,
            other,
            _dir: dir,
        }
    }

    /// The full release of `a`'s hold.
    fn release_a() -> ReleaseRow {
        let hold = crate::backend::HoldRef {
            key: "a",
            owner: "o",
            fencing_token: 7,
        };
        ReleaseRow::new(&hold, 0, None, 11)
    }

    /// Owner `p`'s first acquire of `key`.
    fn acquire(key: &str) -> Acquire<'_> {
        crate::backend::statement_tests::one(key, "p", 12)
    }

    /// A one-command transaction whose acquire statement fails after its release statement
    /// ran is rolled back before its connection goes back to the pool: the release is undone
    /// with it, another connection gets the write lock at once (an open transaction would hold
    /// it), and the pool's connections go on committing. Fails without the rollback.
    #[tokio::test]
    async fn a_command_failing_half_way_leaves_no_transaction_open() {
        let Db { lite, other, _dir } = db().await;
        let backend = Backend::Sqlite(lite);
        let deadline = || Instant::now() + Duration::from_secs(5);
        // A key over the table's 255 bytes fails its CHECK: the acquire statement fails, after
        // the release statement before it updated `a`.
        let long = "k".repeat(300);
        let failed = backend
            .write_batch(&[acquire(&long)], &[release_a()], &[], deadline())
            .await
            .unwrap_err();
        assert!(failed.error.to_string().contains("CHECK"), "{failed:?}");
        sqlx::query("UPDATE dblock_locks SET holder = 'x' WHERE lock_key = 'a'")
            .execute(&other)
            .await
            .expect("the write lock is free: no transaction was left open");
        let held: (Option<String>, i64) =
            sqlx::query_as("SELECT owner, hold_count FROM dblock_locks WHERE lock_key = 'a'")
                .fetch_one(&other)
                .await
                .unwrap();
        assert_eq!(held, (Some("o".into()), 1), "the release was rolled back");
        let (attempts, released, _) = backend
            .write_batch(&[acquire("b")], &[release_a()], &[], deadline())
            .await
            .unwrap();
        assert!(
            matches!(attempts[..], [Attempt::Acquired(_)]),
            "{attempts:?}"
        );
        assert!(matches!(released[..], [Released::Free]), "{released:?}");
        let count: i64 = sqlx::query_scalar(
            "SELECT sum(hold_count) FROM dblock_locks WHERE lock_key IN ('a', 'b')",
        )
        .fetch_one(&other)
        .await
        .unwrap();
        assert_eq!(count, 1, "committed: `a` released, `b` held");
    }

    /// A one-command transaction still waiting for the write lock (another connection holds
    /// it) at its deadline gives the process's turn up then, as a statement cut at its
    /// deadline did, and goes on to its end: a read behind it does not wait for it. (The
    /// other connection commits within the busy timeout, 500 ms; past it the command fails
    /// `SQLITE_BUSY`, a `Locked` failure that is sent again.)
    #[tokio::test]
    async fn a_command_past_its_deadline_gives_up_the_turn_and_goes_on() {
        let Db { lite, other, _dir } = db().await;
        let mut blocker = other.acquire().await.unwrap();
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut *blocker)
            .await
            .unwrap();
        let backend = Backend::Sqlite(lite);
        let (acquires, releases) = ([acquire("b")], [release_a()]);
        let started = Instant::now();
        let batch = backend.write_batch(
            &acquires,
            &releases,
            &[],
            started + Duration::from_millis(200),
        );
        let read = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let info = backend
                .run(
                    &crate::backend::Inspect("a"),
                    started + Duration::from_secs(5),
                )
                .await;
            (info, started.elapsed())
        };
        let unblock = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            sqlx::query("COMMIT").execute(&mut *blocker).await.unwrap();
        };
        let (batch, (info, read_after), ()) = tokio::join!(batch, read, unblock);
        assert!(
            info.unwrap().unwrap().held,
            "read before the batch committed"
        );
        assert!(
            read_after < Duration::from_millis(1000),
            "the read waited {read_after:?} for the turn"
        );
        let (attempts, released, _) = batch.expect("the command went on to its end");
        assert!(
            matches!(attempts[..], [Attempt::Acquired(_)]),
            "{attempts:?}"
        );
        assert!(matches!(released[..], [Released::Free]), "{released:?}");
    }

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
