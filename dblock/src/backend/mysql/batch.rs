//! Coalesced statements on MySQL/MariaDB (`backend/coalesce/`).
//!
//! **Acquires** (MariaDB): the rows of many callers, on distinct keys, as one `INSERT ... SELECT
//! ... ON DUPLICATE KEY UPDATE ... RETURNING`: one round trip, one commit, one answer row per
//! key.
//!
//! Atomic per row as the one-key statement (`UPSERT` in `sql.rs`): InnoDB takes each row's
//! exclusive lock for its duplicate check and keeps it through that row's UPDATE and to the
//! commit, so every row's "may I take it" decision and its write see one row version. The rows
//! come from a derived table of the callers' values, ordered by key (bytes): every batch of
//! every process takes its row locks in that order, so two batches cannot deadlock. Each row's
//! own values (owner, lease, attempt id, the process's tenure and holds, once) are read from its
//! derived row, in the INSERT part and in the `ON DUPLICATE KEY UPDATE` alike.
//!
//! MySQL 8 has no `RETURNING`: there a batch of acquires is the one-key statements in one
//! transaction (`in_one_transaction`), one commit for all of them.
//!
//! **Releases** (MySQL and MariaDB): four round trips whatever the batch's size, where the
//! one-row statements in a transaction take two plus one per row. No `UPDATE ... RETURNING`
//! (MariaDB 10.11) and no per-row count from a multi-table `UPDATE`, so the rows are read
//! first, in one transaction:
//! 1. `SELECT ... FOR UPDATE` of the batch's keys takes their exclusive row locks in key
//!    (byte) order, the order of every batch of every process, and reads each row's latest
//!    committed version: whether it is the caller's live tenure (owner, fencing token, lease
//!    not run out by the server's clock) and not already released by this release id — the
//!    one-row release's `WHERE`, decided at that instant.
//! 2. One multi-table `UPDATE` joins the rows so decided to their values and writes each as
//!    the one-row release does. The locks taken in 1 are held to the commit, so nothing the
//!    decision read can change in between; every assignment reads the request or columns the
//!    statement does not write (a multi-table `UPDATE` does not promise an order of
//!    assignments).
//! 3. The commit. Each caller's answer is its row's decision: freed, still held with the count
//!    it left, or not held.

use super::OnMySql;
use sqlx::mysql::{MySql, MySqlConnection};
use sqlx::{AssertSqlSafe, Row, SqlSafeStr};

use super::sql::{expand, NEW_ROW, UPSERT};
use super::{My, US_NOW};
use crate::backend::batch::{listed, pad};
use crate::backend::coalesce::ReleaseRow;
use crate::backend::{Acquire, Attempt, Binds, Grant, Outcome, Released};

/// The derived table's columns, named apart from the lock table's (`ON DUPLICATE KEY UPDATE`
/// sees both).
/// In the order of [`Acquire::args`].
const COLUMNS: &str =
    "b_key, b_owner, b_ttl, b_holder, b_attempt, b_tenure, b_held, b_min_hold, b_once";

/// The statement for `n` rows, its `?` the rows' values in [`COLUMNS`] order, row after row
/// (rows with a NULL key are padding, and select nothing).
fn statement(n: usize, table: &str) -> String {
    let first = format!(
        "SELECT ? AS {}",
        COLUMNS.split(", ").collect::<Vec<_>>().join(", ? AS ")
    );
    let rest = " UNION ALL SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?".repeat(n.saturating_sub(1));
    let new_row = NEW_ROW
        .replace(":owner", "r.b_owner")
        .replace(":ttl", "r.b_ttl")
        .replace(":holder", "r.b_holder")
        .replace(":min_hold", "r.b_min_hold")
        .replace(":once", "r.b_once")
        .replace("{attempt}", "r.b_attempt")
        .replace("{token}", US_NOW);
    let rows = format!(
        "SELECT r.b_key, {new_row}
FROM ({first}{rest}) AS r
WHERE r.b_key IS NOT NULL
ORDER BY CAST(r.b_key AS BINARY)"
    );
    expand(
        &(UPSERT.replace("{rows}", &rows).replace(
            "{expires}",
            "IF(owner = VALUES(owner), GREATEST(expires_at, VALUES(expires_at)), expires_at)",
        ) + "
RETURNING CONVERT(lock_key USING utf8mb4), owner, hold_count, fencing_token,
          TIMESTAMPDIFF(MICROSECOND, '1970-01-01', expires_at),
          GREATEST(0, (TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) + 999) DIV 1000),
          last_outcome <=> 1 AND NOT {ran_out},
          TIMESTAMPDIFF(MICROSECOND, '1970-01-01', finished_at)"),
    )
    .replace(":held", "r.b_held")
    .replace(":tenure", "r.b_tenure")
    .replace(":once", "r.b_once")
    .replace("{table}", table)
}

async fn acquire(
    my: &My,
    conn: &mut MySqlConnection,
    rows: &[Acquire<'_>],
) -> sqlx::Result<Vec<Attempt>> {
    let text = AssertSqlSafe(statement(listed(rows.len()), &my.table)).into_sql_str();
    let q = rows
        .iter()
        .flat_map(Acquire::args)
        .try_fold(sqlx::query(text), MySql::bind_value)?;
    let answer = pad(q, rows.len(), 9).fetch_all(&mut *conn).await?;
    // One row per key written or looked at (busy rows assign every column its own value and
    // come back too). On Galera with its autocommit retry on, a stale row can come first: the
    // last row of a key wins, as in the one-key statement.
    let mut by_key = std::collections::HashMap::with_capacity(answer.len());
    for row in &answer {
        by_key.insert(row.try_get::<String, _>(0)?, row);
    }
    rows.iter()
        .map(|a| {
            let Some(row) = by_key.get(a.key) else {
                return Err(sqlx::Error::Protocol(format!(
                    "the coalesced acquire did not answer for key `{}`",
                    a.key
                )));
            };
            let owner: Option<String> = row.try_get(1)?;
            // As the one-key statement: the row is this caller's after the statement.
            let acquired = owner.as_deref() == Some(a.owner);
            Ok(if acquired {
                Attempt::Acquired(Grant::at(*row, 2)?)
            } else if a.once && row.try_get::<Option<bool>, _>(6)?.unwrap_or(false) {
                Attempt::Done {
                    finished_at_us: row.try_get(7)?,
                }
            } else {
                Attempt::Busy {
                    retry_after: Some(crate::info::millis(row.try_get(5)?)),
                }
            })
        })
        .collect()
}

/// Step 1 of a release batch for `n` keys: each row's tenure and whether its lease is live, its
/// row locked (module docs).
fn release_read(n: usize, table: &str) -> String {
    format!(
        "SELECT CONVERT(lock_key USING utf8mb4), owner, fencing_token, attempt_id,
       expires_at > UTC_TIMESTAMP(6)
FROM {table} WHERE lock_key IN ({})
ORDER BY lock_key
FOR UPDATE",
        vec!["?"; n].join(", ")
    )
}

/// Step 2 for `n` rows decided to be released: (key, holds left, outcome or NULL, release id)
/// each, rows with a NULL key padding that joins nothing. As the one-row release (`sql.rs`):
/// the count set absolutely, the last release of a tenure recording its outcome (a success
/// committed with the work stands) and when, the key free at once or when min_hold has passed,
/// the release id and the tenure recorded.
fn release_write(n: usize, table: &str) -> String {
    let rest = " UNION ALL SELECT ?, ?, ?, ?".repeat(n.saturating_sub(1));
    format!(
        "UPDATE {table} AS l
JOIN (SELECT ? AS b_key, ? AS b_left, ? AS b_outcome, ? AS b_rid{rest}) AS r
  ON l.lock_key = r.b_key
SET l.hold_count   = r.b_left,
    l.owner        = IF(r.b_left = 0, NULL, l.owner),
    l.last_outcome = IF(r.b_left = 0,
                        IF(l.success_token <=> l.fencing_token, 1,
                           COALESCE(r.b_outcome, l.last_outcome)),
                        l.last_outcome),
    l.finished_at  = IF(r.b_left = 0 AND r.b_outcome IS NOT NULL, UTC_TIMESTAMP(6),
                        l.finished_at),
    l.expires_at   = IF(r.b_left = 0,
                        IF(r.b_outcome IS NULL, UTC_TIMESTAMP(6),
                           GREATEST(UTC_TIMESTAMP(6), COALESCE(l.available_at, UTC_TIMESTAMP(6)))),
                        l.expires_at),
    l.attempt_id   = r.b_rid,
    l.release_id   = r.b_rid,
    l.release_token = l.fencing_token"
    )
}

async fn release(
    my: &My,
    conn: &mut MySqlConnection,
    rows: &[ReleaseRow],
) -> sqlx::Result<Vec<Released>> {
    let Some(first) = rows.first() else {
        return Ok(Vec::new());
    };
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let listed_keys = listed(rows.len());
    let mut read = sqlx::query(AssertSqlSafe(release_read(listed_keys, &my.table)).into_sql_str());
    for r in rows {
        read = read.bind(r.key().as_bytes());
    }
    for _ in rows.len()..listed_keys {
        read = read.bind(first.key().as_bytes()); // padding: a key listed twice
    }
    let found = read.fetch_all(&mut *tx).await?;
    let mut live = std::collections::HashMap::with_capacity(found.len());
    for row in &found {
        live.insert(
            row.try_get::<String, _>(0)?,
            (
                row.try_get::<Option<String>, _>(1)?,
                row.try_get::<i64, _>(2)?,
                row.try_get::<Option<i64>, _>(3)?,
                row.try_get::<bool, _>(4)?,
            ),
        );
    }
    // The one-row release's WHERE, per row, on the row as locked.
    let ours: Vec<bool> = rows
        .iter()
        .map(|r| {
            live.get(r.key())
                .is_some_and(|(owner, token, attempt, live)| {
                    *live
                        && owner.as_deref() == Some(r.owner())
                        && *token == r.fencing_token as i64
                        && *attempt != Some(r.release_id)
                })
        })
        .collect();
    let released: Vec<&ReleaseRow> = rows
        .iter()
        .zip(&ours)
        .filter(|(_, &o)| o)
        .map(|(r, _)| r)
        .collect();
    if !released.is_empty() {
        let listed_rows = listed(released.len());
        let text = AssertSqlSafe(release_write(listed_rows, &my.table)).into_sql_str();
        let mut write = sqlx::query(text);
        for r in &released {
            write = write
                .bind(r.key().as_bytes())
                .bind(i64::from(r.remaining))
                .bind(r.outcome.map(Outcome::code))
                .bind(r.release_id);
        }
        let done = pad(write, released.len(), 4).execute(&mut *tx).await?;
        if done.rows_affected() != released.len() as u64 {
            // Every row was locked and checked above: a mismatch is a bug, never a guess.
            return Err(sqlx::Error::Protocol(format!(
                "the coalesced release wrote {} of {} rows",
                done.rows_affected(),
                released.len()
            )));
        }
    }
    tx.commit().await?;
    Ok(rows
        .iter()
        .zip(ours)
        .map(|(r, ours)| {
            if !ours {
                Released::NotHeld
            } else if r.remaining == 0 {
                Released::Free
            } else {
                Released::StillHeld(r.remaining)
            }
        })
        .collect())
}

/// Coalesced acquires: one statement where the server has `RETURNING` (MariaDB), else one
/// transaction of one-row statements.
async fn acquire_batch(
    my: &My,
    c: &mut MySqlConnection,
    rows: &[Acquire<'_>],
) -> sqlx::Result<Vec<Attempt>> {
    if my.supports_returning(c).await? {
        acquire(my, c, rows).await
    } else {
        // MySQL 8 (no `RETURNING`): the one-row statements in one transaction.
        super::in_one_transaction(my, c, None, rows).await
    }
}

crate::backend::runs! {
    OnMySql, mysql, My, MySqlConnection;
    crate::backend::coalesce::AcquireBatch<'_> => acquire_batch,
    // Four round trips, whatever the batch's size (above).
    crate::backend::coalesce::ReleaseBatch<'_> => release,
}

#[cfg(test)]
mod tests {
    #[test]
    fn one_placeholder_per_value_and_no_named_parameter_left() {
        for n in [1, 2, 64] {
            let text = super::statement(n, "`t`");
            assert_eq!(text.matches('?').count(), 9 * n, "{text}");
            assert!(
                !text.contains(":owner") && !text.contains(":held"),
                "{text}"
            );
            assert!(!text.contains('{'), "{text}");
        }
    }

    #[test]
    fn release_texts_have_one_placeholder_per_value() {
        for n in [1, 2, 64] {
            let read = super::release_read(n, "`t`");
            assert_eq!(read.matches('?').count(), n, "{read}");
            let write = super::release_write(n, "`t`");
            assert_eq!(write.matches('?').count(), 4 * n, "{write}");
            assert!(!write.contains('{'), "{write}");
        }
    }
}
