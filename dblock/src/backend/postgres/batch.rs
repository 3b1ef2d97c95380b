//! Coalesced statements on PostgreSQL (`backend/coalesce/`): the acquires or the releases of
//! many callers, on distinct keys, as one statement over arrays (`unnest`), one round trip,
//! one commit. Each row is decided as its one-row statement decides it, and answered on its
//! own.
//!
//! Atomicity, for both statements:
//! - `locked` row-locks every existing row of the batch's keys in key order (a `LockRows` node
//!   above the sort) before anything is written: every batch of every process takes its locks
//!   in that order, so two batches cannot deadlock, and a one-row statement holds one row lock
//!   at most, so it cannot close a cycle either.
//! - The UPDATE reads the rows `locked` returned, by key: `= ANY(ARRAY(SELECT lock_key FROM
//!   locked))` is an init plan, run to its end (every row lock taken, in key order) before the
//!   UPDATE reads its first row, and then an index condition. (`IN (SELECT lock_key FROM
//!   locked)` was planned, in the cached plan that guesses ten entries per array, as a nested
//!   loop scanning the CTE again for each row: quadratic, 2,016 comparisons and about 1 ms of a
//!   64-row batch's 2 ms.)
//! - The UPDATE then writes each row under the lock this statement holds. Under READ COMMITTED
//!   it re-checks its WHERE against the row's latest committed version when a concurrent
//!   writer committed after the statement's snapshot: every condition reads only that row's own
//!   columns and the row's values in `r`, so the re-check sees everything the decision depends
//!   on. The SET's CASE arms read the old row, as in the one-row statements.
//! - New keys are inserted in key order with `ON CONFLICT DO NOTHING`: a racing inserter makes
//!   that row busy, never an error that would fail the whole batch. A key is new when `locked`
//!   has no row for it (a hash anti-join, not an index probe a row: 0.077 against 0.024 ms of a
//!   64-row batch's 0.6 ms): the same answer as the table read through the statement's
//!   snapshot, except for a row deleted after the snapshot (`locked` skips it), whose key is
//!   then tried as new, and the unique index still decides.
//! - The answer is one row per requested key (a `LEFT JOIN` of the request to what was
//!   written and to the row as `locked` read it, its latest committed version), so every
//!   caller learns its own outcome. Each answer row carries its request row's place in the
//!   arrays (`WITH ORDINALITY`), by which it is matched to its caller ([`answered`]): no key
//!   is decoded or looked up to do so.
//! - Every read of the table is by key (`locked`'s `= ANY($1)`, the UPDATE's list): the plan
//!   PostgreSQL caches for a prepared statement cannot know how many rows an array holds, and
//!   without an index condition it hash-joined the request against a scan of the whole table
//!   (measured: 2.4 ms instead of 1.1 ms for 12 rows of a 2,000-key table, and growing with
//!   the table).

use sqlx::postgres::{PgConnection, PgRow};
use sqlx::Row;

use super::sql::{SAME, TAKE};
use super::{ran_out, stmt, Arg, Pg, Stmt};
use crate::backend::coalesce::ReleaseRow;
use crate::backend::{Acquire, Attempt, Outcome, Released};

/// The coalesced statements of one table.
#[derive(Debug)]
pub(crate) struct Sql {
    acquire: Stmt,
    release: Stmt,
}

/// Acquires: `$1` keys, `$2` owners, `$3` ttls (µs), `$4` holders, `$5` attempt ids, `$6`
/// tenures the process tracks (-1: none; tokens are positive), `$7` holds it tracks, `$8`
/// min_hold (µs), `$9` once (0/1). Per row as the one-key statement (`ACQUIRE` in `mod.rs`):
/// update if free, ours or ours again (re-entry, a resend), else insert if no row, else busy.
const ACQUIRE: &str = r#"WITH r AS (
    SELECT k, owner, ttl, holder, attempt, tenure, held, min_hold, once_n <> 0 AS once, n
    FROM unnest($1::text[], $2::text[], $3::float8[], $4::text[], $5::int8[], $6::int8[],
                $7::int8[], $8::float8[], $9::int8[]) WITH ORDINALITY
         AS q(k, owner, ttl, holder, attempt, tenure, held, min_hold, once_n, n)
), locked AS MATERIALIZED (
    SELECT b.lock_key, b.hold_count, b.fencing_token, b.expires_at, b.last_outcome, b.owner,
           b.success_token, b.finished_at
    FROM {table} AS b WHERE b.lock_key = ANY($1)
    ORDER BY b.lock_key
    FOR UPDATE
), upd AS (
    UPDATE {table} AS l SET
        {take}
    FROM r
    WHERE l.lock_key = r.k AND l.lock_key = ANY(ARRAY(SELECT lock_key FROM locked))
      AND (l.expires_at <= statement_timestamp() OR l.owner = r.owner)
      AND NOT (r.once AND l.last_outcome IS NOT DISTINCT FROM 1 AND NOT {ran_out_l})
    RETURNING l.lock_key, l.hold_count, l.fencing_token, l.expires_at
), ins AS (
    INSERT INTO {table} (lock_key, owner, hold_count, fencing_token, expires_at, acquired_at,
                         holder, attempt_id, available_at, once_key)
    SELECT r.k, r.owner, 1, (extract(epoch FROM statement_timestamp()) * 1000000)::int8,
           statement_timestamp() + greatest(r.ttl, r.min_hold) * interval '1 microsecond',
           statement_timestamp(), r.holder, r.attempt,
           CASE WHEN r.min_hold > 0 THEN statement_timestamp() + r.min_hold * interval '1 microsecond' END,
           r.once
    FROM r
    WHERE NOT EXISTS (SELECT 1 FROM locked AS e WHERE e.lock_key = r.k)
    ORDER BY r.k COLLATE "C"
    ON CONFLICT (lock_key) DO NOTHING
    RETURNING lock_key, hold_count, fencing_token, expires_at
), got AS (
    SELECT lock_key, hold_count, fencing_token, expires_at FROM upd
    UNION ALL
    SELECT lock_key, hold_count, fencing_token, expires_at FROM ins
)
SELECT g.lock_key IS NOT NULL AS acquired,
       coalesce(g.hold_count, b.hold_count),
       coalesce(g.fencing_token, b.fencing_token),
       (extract(epoch FROM coalesce(g.expires_at, b.expires_at)) * 1000000)::int8,
       greatest(0, ceil(extract(epoch FROM b.expires_at - statement_timestamp()) * 1000))::int8,
       g.lock_key IS NULL AND r.once AND b.last_outcome IS NOT DISTINCT FROM 1
           AND NOT {ran_out_b} AS done,
       (extract(epoch FROM b.finished_at) * 1000000)::int8,
       b.lock_key IS NOT NULL AS seen,
       r.n
FROM r
LEFT JOIN got AS g ON g.lock_key = r.k
LEFT JOIN locked AS b ON b.lock_key = r.k"#;

/// Releases: `$1` keys, `$2` owners, `$3` tenures, `$4` release ids, `$5` holds left, `$6`
/// outcomes (-1: none), `$7` the NOTIFY channel, `$8` lazily durable. Per row as the one-key
/// release (`mod.rs`): owner-, tenure- and lease-checked, the count set absolutely, the release
/// id recorded; a full release of a contended key NOTIFYs at commit.
const RELEASE: &str = "WITH q AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[], $5::int8[], $6::int8[])
        WITH ORDINALITY AS q(k, owner, token, release_id, remaining, outcome, n)
), locked AS MATERIALIZED (
    SELECT b.lock_key FROM {table} AS b WHERE b.lock_key = ANY($1)
    ORDER BY b.lock_key
    FOR UPDATE
), r AS (
    UPDATE {table} AS l SET
        hold_count   = q.remaining,
        owner        = CASE WHEN q.remaining > 0 THEN l.owner END,
        expires_at   = CASE WHEN q.remaining > 0 THEN l.expires_at
                            WHEN q.outcome = -1 THEN statement_timestamp()
                            ELSE greatest(statement_timestamp(), l.available_at) END,
        last_outcome = CASE WHEN q.remaining > 0 THEN l.last_outcome
                            WHEN l.success_token = l.fencing_token THEN 1
                            ELSE coalesce(nullif(q.outcome, -1)::int2, l.last_outcome) END,
        finished_at  = CASE WHEN q.remaining > 0 OR q.outcome = -1 THEN l.finished_at
                            ELSE statement_timestamp() END,
        attempt_id   = q.release_id,
        release_id   = q.release_id,
        release_token = l.fencing_token
    FROM q
    WHERE l.lock_key = q.k AND l.lock_key = ANY(ARRAY(SELECT lock_key FROM locked))
      AND l.owner = q.owner AND l.fencing_token = q.token
      AND l.attempt_id IS DISTINCT FROM q.release_id
      AND l.expires_at > statement_timestamp()
    RETURNING l.lock_key, l.hold_count, l.contended
), n AS (
    SELECT lock_key, hold_count,
           CASE WHEN hold_count = 0 AND contended THEN pg_notify($7, lock_key)::text END AS notified
    FROM r
)
SELECT n.hold_count, n.notified,
       -- Lazily durable releases (only ever batched with each other): the transaction commits
       -- without waiting for its WAL flush, as the one-key release does.
       CASE WHEN $8 THEN set_config('synchronous_commit', 'off', true) END,
       q.n
FROM q LEFT JOIN n ON n.lock_key = q.k";

impl Sql {
    pub(crate) fn new(table: &str) -> Sql {
        let take = TAKE
            .replace("{same}", SAME)
            .replace("{owner}", "r.owner")
            .replace("{attempt}", "r.attempt")
            .replace("{tenure}", "r.tenure")
            .replace("{held}", "r.held")
            .replace("{holder}", "r.holder")
            .replace("{ttl}", "r.ttl")
            .replace("{min_hold}", "r.min_hold")
            .replace("{once}", "r.once")
            .replace("{ran_out}", &ran_out("l."));
        Sql {
            acquire: stmt(
                &ACQUIRE
                    .replace("{take}", &take)
                    .replace("{ran_out_l}", &ran_out("l."))
                    .replace("{ran_out_b}", &ran_out("b.")),
                table,
            ),
            release: stmt(RELEASE, table),
        }
    }
}

async fn acquire(
    pg: &Pg,
    conn: &mut PgConnection,
    rows: &[Acquire<'_>],
) -> sqlx::Result<Vec<Attempt>> {
    let keys: Vec<&str> = rows.iter().map(|a| a.key).collect();
    let owners: Vec<&str> = rows.iter().map(|a| a.owner).collect();
    let ttls: Vec<f64> = rows.iter().map(|a| a.ttl_us as f64).collect();
    let holders: Vec<&str> = rows.iter().map(|a| a.holder).collect();
    let attempts: Vec<i64> = rows.iter().map(|a| a.attempt).collect();
    let tenures: Vec<i64> = rows.iter().map(|a| a.tenure.unwrap_or(-1)).collect();
    let held: Vec<i64> = rows.iter().map(|a| i64::from(a.held)).collect();
    let min_holds: Vec<f64> = rows.iter().map(|a| a.min_hold_us as f64).collect();
    let once: Vec<i64> = rows.iter().map(|a| i64::from(a.once)).collect();
    let answer = pg
        .send::<Vec<PgRow>>(
            conn,
            &pg.batch_sql.acquire,
            &[
                Arg::TextArray(&keys),
                Arg::TextArray(&owners),
                Arg::Float8Array(&ttls),
                Arg::TextArray(&holders),
                Arg::Int8Array(&attempts),
                Arg::Int8Array(&tenures),
                Arg::Int8Array(&held),
                Arg::Float8Array(&min_holds),
                Arg::Int8Array(&once),
            ],
        )
        .await?;
    let by_row = answered(&answer, rows.len(), 8)?;
    rows.iter()
        .zip(by_row)
        .map(|(a, row)| {
            let Some(row) = row else {
                return Err(sqlx::Error::Protocol(format!(
                    "the coalesced acquire did not answer for key `{}`",
                    a.key
                )));
            };
            // Column 7: the key's row was there before the statement; a busy key inserted
            // by someone else during it has no holder's time left to read.
            Ok(match crate::backend::attempt_row(row)? {
                Attempt::Busy { .. } if !row.try_get::<bool, _>(7)? => {
                    Attempt::Busy { retry_after: None }
                }
                attempt => attempt,
            })
        })
        .collect()
}

async fn release(
    pg: &Pg,
    conn: &mut PgConnection,
    rows: &[ReleaseRow],
) -> sqlx::Result<Vec<Released>> {
    let keys: Vec<&str> = rows.iter().map(|r| r.key()).collect();
    let owners: Vec<&str> = rows.iter().map(|r| r.owner()).collect();
    let tokens: Vec<i64> = rows.iter().map(|r| r.fencing_token as i64).collect();
    let ids: Vec<i64> = rows.iter().map(|r| r.release_id).collect();
    let remaining: Vec<i64> = rows.iter().map(|r| i64::from(r.remaining)).collect();
    let outcomes: Vec<i64> = rows
        .iter()
        .map(|r| r.outcome.map_or(-1, |o| i64::from(Outcome::code(o))))
        .collect();
    let answer = pg
        .send::<Vec<PgRow>>(
            conn,
            &pg.batch_sql.release,
            &[
                Arg::TextArray(&keys),
                Arg::TextArray(&owners),
                Arg::Int8Array(&tokens),
                Arg::Int8Array(&ids),
                Arg::Int8Array(&remaining),
                Arg::Int8Array(&outcomes),
                Arg::Text(&pg.channel),
                Arg::Bool(pg.settings.lazy_release),
            ],
        )
        .await?;
    let by_row = answered(&answer, rows.len(), 3)?;
    rows.iter()
        .zip(by_row)
        .map(
            |(r, row)| match row.map(|row| row.try_get::<Option<i32>, _>(0)) {
                None => Err(sqlx::Error::Protocol(format!(
                    "the coalesced release did not answer for key `{}`",
                    r.key()
                ))),
                Some(Err(e)) => Err(e),
                Some(Ok(None)) => Ok(Released::NotHeld),
                Some(Ok(Some(0))) => Ok(Released::Free),
                Some(Ok(Some(n))) => Ok(Released::StillHeld(n.max(0) as u32)),
            },
        )
        .collect()
}

/// The answer's rows by the request's row they answer: column `at` holds the request row's
/// place in the arrays (`WITH ORDINALITY`, from 1). `None` where no row answered; a place
/// outside the request is a protocol error.
fn answered(
    answer: &[sqlx::postgres::PgRow],
    n: usize,
    at: usize,
) -> sqlx::Result<Vec<Option<&sqlx::postgres::PgRow>>> {
    let mut by_row = vec![None; n];
    for row in answer {
        let place: i64 = row.try_get(at)?;
        let slot = usize::try_from(place - 1)
            .ok()
            .and_then(|i| by_row.get_mut(i))
            .ok_or_else(|| {
                sqlx::Error::Protocol(format!(
                    "a coalesced statement of {n} rows answered for row {place}"
                ))
            })?;
        *slot = Some(row);
    }
    Ok(by_row)
}

crate::backend::runs! {
    super::OnPostgres, postgres, Pg, PgConnection;
    crate::backend::coalesce::AcquireBatch<'_> => acquire,
    crate::backend::coalesce::ReleaseBatch<'_> => release,
}

#[cfg(test)]
mod print_tests {
    #[test]
    #[ignore = "prints the statements"]
    fn print() {
        let s = super::Sql::new("\"dblock_bench\"");
        println!(
            "{}\n----\n{}",
            s.acquire.sql.as_str(),
            s.release.sql.as_str()
        );
    }
}
