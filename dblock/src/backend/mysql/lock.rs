//! The lock's own statements on MySQL and MariaDB: acquire (one key, several keys), release,
//! extend, and renewal's extension of many leases.

use super::sql::*;
#[allow(unused_imports)]
use super::*;
use crate::backend::*;

impl OnMySql for Acquire<'_> {
    async fn mysql(&self, my: &My, conn: &mut MySqlConnection) -> sqlx::Result<Attempt> {
        let p = self;
        let args = p.args();
        if my.supports_returning(conn).await? {
            // Read ALL rows and keep the last: a Galera node whose automatic autocommit retry
            // fired (when the pool is not ours and wsrep_retry_autocommit could not be set to 0)
            // sends one stale row per aborted attempt before the committed one.
            let query = my.sql.acquire_returning.bound(&args)?;
            let rows = query.fetch_all(&mut *conn).await?;
            let Some(row) = rows.last() else {
                return Err(sqlx::Error::RowNotFound);
            };
            crate::backend::attempt_row(row)
        } else {
            let sent_at = std::time::SystemTime::now();
            let query = my.sql.acquire_last_insert_id.bound(&args)?;
            let done = query.execute(&mut *conn).await?;
            let packed = done.last_insert_id();
            if packed == 0 {
                if p.once {
                    let done: Option<(bool, Option<i64>)> = sqlx::query_as(my.sql.done.clone())
                        .bind(p.key)
                        .fetch_optional(&mut *conn)
                        .await?;
                    if let Some((true, finished_at_us)) = done {
                        return Ok(Attempt::Done { finished_at_us });
                    }
                }
                return Ok(Attempt::Busy { retry_after: None });
            }
            Ok(Attempt::Acquired(packed_grant(
                packed,
                sent_at,
                p.ttl_us.max(p.min_hold_us),
            )))
        }
    }
}

impl OnMySql for AcquireMany<'_> {
    async fn mysql(
        &self,
        my: &My,
        conn: &mut MySqlConnection,
    ) -> sqlx::Result<Option<Vec<Attempt>>> {
        let AcquireMany { first, all } = *self;
        if !my.supports_returning(conn).await? {
            // MySQL 8: one grant per statement travels in LAST_INSERT_ID; one key at a time.
            return Ok(None);
        }
        let (text, order) = acquire_sql(
            &(upsert_many(all.len()).replace(
                "{expires}",
                "IF(owner = VALUES(owner), GREATEST(expires_at, VALUES(expires_at)), expires_at)",
            ) + "
RETURNING CONVERT(lock_key USING utf8mb4), owner <=> :owner, hold_count, fencing_token,
          TIMESTAMPDIFF(MICROSECOND, '1970-01-01', expires_at)")
                .replace("{token}", US_NOW),
            &my.table,
        );
        let rows = bind(&text, &order, first, all)
            .fetch_all(&mut *conn)
            .await?;
        let mut grants = Vec::with_capacity(rows.len());
        for row in rows {
            // Every row this statement wrote comes back; those of other owners were not taken.
            // (On Galera with its autocommit retry on, a stale row can come first: the last
            // row of a key wins, as in `acquire`.)
            if row.try_get::<bool, _>(1)? {
                grants.push(crate::backend::keyed_grant(&row, 2)?);
            }
        }
        Ok(Some(crate::backend::per_key(all, grants)))
    }
}

impl OnMySql for Release<'_> {
    async fn mysql(&self, my: &My, conn: &mut MySqlConnection) -> sqlx::Result<Released> {
        let done = my.sql.release.bound(&self.args())?.execute(conn).await?;
        // The holds left travel in LAST_INSERT_ID.
        let left = (done.rows_affected() > 0).then_some(done.last_insert_id() as i64);
        Ok(Released::left(left))
    }
}

impl OnMySql for Extend<'_> {
    async fn mysql(&self, my: &My, conn: &mut MySqlConnection) -> sqlx::Result<Option<i64>> {
        let done = my.sql.extend.bound(&self.args())?.execute(conn).await?;
        Ok((done.rows_affected() > 0).then_some(done.last_insert_id() as i64))
    }
}

impl OnMySql for ExtendMany<'_> {
    /// Renewal of many leases: one multi-table UPDATE joined to a derived table of
    /// (key, owner, token, ttl). Each row is updated under its exclusive lock with the same
    /// owner/tenure/live check as `extend`. MySQL has no RETURNING for UPDATE: when fewer rows
    /// matched than were sent, one read names the holds still live (a hold that was not extended
    /// cannot be live again: its token would have changed).
    async fn mysql(&self, my: &My, conn: &mut MySqlConnection) -> sqlx::Result<Extended> {
        let items = self.0;
        let mut rows = vec!["SELECT ? AS k, ? AS o, ? AS tok, ? AS ttl, ? AS cap"; 1];
        rows.extend(std::iter::repeat_n("SELECT ?, ?, ?, ?, ?", items.len() - 1));
        let text = format!(
            "UPDATE {table} AS l JOIN ({rows}) AS r
  ON l.lock_key = r.k AND l.owner = r.o AND l.fencing_token = r.tok
SET l.expires_at = GREATEST(l.expires_at, LEAST(UTC_TIMESTAMP(6) + INTERVAL r.ttl MICROSECOND,
                                                l.acquired_at + INTERVAL r.cap MICROSECOND)),
    {renewed}
WHERE l.expires_at > UTC_TIMESTAMP(6)",
            table = my.table,
            rows = rows.join(" UNION ALL "),
            renewed = super::sql::renewed("l."),
        );
        let q = bound::<MySql>(AssertSqlSafe(text).into_sql_str(), &self.args())?;
        let matched = q.execute(&mut *conn).await?.rows_affected();
        let all = || {
            items
                .iter()
                .map(|i| (i.key.to_owned(), i.owner.to_owned(), i.fencing_token))
                .collect()
        };
        if matched as usize >= items.len() {
            return Ok(all());
        }
        let marks = vec!["?"; items.len()].join(", ");
        let text = format!(
            "SELECT lock_key, owner, fencing_token FROM {table}
WHERE lock_key IN ({marks}) AND expires_at > UTC_TIMESTAMP(6)",
            table = my.table
        );
        let mut q = sqlx::query_as::<_, (Vec<u8>, Option<String>, i64)>(AssertSqlSafe(text));
        for i in items {
            q = q.bind(i.key);
        }
        let live = q.fetch_all(&mut *conn).await?;
        Ok(items
            .iter()
            .filter(|i| {
                live.iter().any(|(k, o, t)| {
                    k.as_slice() == i.key.as_bytes()
                        && o.as_deref() == Some(i.owner)
                        && *t as u64 == i.fencing_token
                })
            })
            .map(|i| (i.key.to_owned(), i.owner.to_owned(), i.fencing_token))
            .collect())
    }
}
