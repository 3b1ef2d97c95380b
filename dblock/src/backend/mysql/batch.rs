//! Coalesced acquires on MariaDB (`backend/coalesce.rs`): the rows of many callers, on distinct
//! keys, as one `INSERT ... SELECT ... ON DUPLICATE KEY UPDATE ... RETURNING`: one round trip,
//! one commit, one answer row per key.
//!
//! Atomic per row as the one-key statement (`UPSERT` in `mysql.rs`): InnoDB takes each row's
//! exclusive lock for its duplicate check and keeps it through that row's UPDATE and to the
//! commit, so every row's "may I take it" decision and its write see one row version. The rows
//! come from a derived table of the callers' values, ordered by key (bytes): every batch of
//! every process takes its row locks in that order, so two batches cannot deadlock. Each row's
//! own values (owner, lease, attempt id, the process's tenure and holds, once) are read from its
//! derived row, in the INSERT part and in the `ON DUPLICATE KEY UPDATE` alike.
//!
//! MySQL 8 has no `RETURNING`: there a batch is the one-key statements in one transaction
//! (`backend::acquire_in_transaction`), one commit for all of them.

use sqlx::mysql::MySqlConnection;
use sqlx::{AssertSqlSafe, Row, SqlSafeStr};

use super::{expand, My, NEW_ROW, UPSERT, US_NOW};
use crate::backend::{Acquire, Attempt, Grant};

/// The derived table's columns, named apart from the lock table's (`ON DUPLICATE KEY UPDATE`
/// sees both).
const COLUMNS: &str =
    "b_key, b_owner, b_lease, b_holder, b_attempt, b_min_hold, b_tenure, b_held, b_once";

/// The statement for `n` rows, its `?` the rows' values in [`COLUMNS`] order, row after row.
fn statement(n: usize, table: &str) -> String {
    let first = format!(
        "SELECT ? AS {}",
        COLUMNS.split(", ").collect::<Vec<_>>().join(", ? AS ")
    );
    let rest = " UNION ALL SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?".repeat(n.saturating_sub(1));
    let new_row = NEW_ROW
        .replace(":owner", "r.b_owner")
        .replace(":lease", "r.b_lease")
        .replace(":holder", "r.b_holder")
        .replace(":min_hold", "r.b_min_hold")
        .replace(":once", "r.b_once")
        .replace("{attempt}", "r.b_attempt")
        .replace("{token}", US_NOW);
    let rows = format!(
        "SELECT r.b_key, {new_row}
FROM ({first}{rest}) AS r
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

pub(crate) async fn acquire(
    my: &My,
    conn: &mut MySqlConnection,
    rows: &[Acquire<'_>],
) -> Result<Vec<Attempt>, sqlx::Error> {
    let text = AssertSqlSafe(statement(rows.len(), &my.table)).into_sql_str();
    let mut q = sqlx::query(text);
    for a in rows {
        q = q
            .bind(a.key)
            .bind(a.owner)
            .bind(a.ttl_us.max(a.min_hold_us))
            .bind(a.holder)
            .bind(a.attempt)
            .bind(a.min_hold_us)
            .bind(a.tenure)
            .bind(i64::from(a.held))
            .bind(a.once);
    }
    let answer = q.fetch_all(&mut *conn).await?;
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
                Attempt::Acquired(Grant {
                    hold_count: row.try_get::<i32, _>(2)?.max(0) as u32,
                    fencing_token: row.try_get::<i64, _>(3)? as u64,
                    expires_at_us: row.try_get(4)?,
                })
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
}
