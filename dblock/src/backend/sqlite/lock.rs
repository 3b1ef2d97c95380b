//! The lock's own statements on SQLite: acquire (one key, several keys), release, extend, and
//! renewal's extension of many leases.

#[allow(unused_imports)]
use super::*;
use crate::backend::*;

impl OnSqlite for Acquire<'_> {
    async fn sqlite(&self, lite: &Lite, conn: &mut SqliteConnection) -> sqlx::Result<Attempt> {
        let p = self;
        let q = bound::<Sqlite>(lite.sql.acquire.clone(), &p.args())?;
        let row = q.fetch_optional(&mut *conn).await?;
        match row {
            Some(row) => Ok(Attempt::Acquired(Grant::at(&row, 0)?)),
            None if p.once => lite.done(conn, p.key).await,
            None => Ok(Attempt::Busy { retry_after: None }),
        }
    }
}

impl OnSqlite for AcquireMany<'_> {
    /// Several keys in one statement: `req` (a CTE of the keys with their attempt ids and what
    /// the process holds of each) is inserted only if none of its keys is busy (held by another
    /// owner, or done for `once`) — checked inside the statement, under SQLite's single write
    /// lock, so the set is taken whole or not at all, and a busy set writes nothing. Conflicting
    /// rows go through the same `ON CONFLICT` as the one-key statement, reading the process's
    /// holds of each key from `req`.
    async fn sqlite(
        &self,
        lite: &Lite,
        conn: &mut SqliteConnection,
    ) -> sqlx::Result<Option<Vec<Attempt>>> {
        let AcquireMany { first, all } = *self;
        // ?1-?5 are shared (owner, ttl µs, holder, min_hold µs, once), then four per key from
        // ?6 on; times are rounded up to milliseconds in the text, as the one-key statement's.
        let rows = (0..all.len())
            .map(|i| {
                let n = 6 + 4 * i;
                format!("(?{n}, ?{}, ?{}, ?{})", n + 1, n + 2, n + 3)
            })
            .collect::<Vec<_>>()
            .join(", ");
        let of_key =
            |column: &str| format!("(SELECT {column} FROM req WHERE req.k = excluded.lock_key)");
        let text = format!(
            "WITH req(k, attempt, tenure, held) AS (VALUES {rows})
INSERT INTO {table} AS l
    (lock_key, owner, hold_count, fencing_token, expires_at, acquired_at, holder, attempt_id,
     available_at, once_key)
SELECT k, ?1, 1, {{now}} * 1000, {{now}} + max((?2 + 999) / 1000, (?4 + 999) / 1000), {{now}},
       ?3, attempt, CASE WHEN ?4 > 0 THEN {{now}} + (?4 + 999) / 1000 END, ?5
FROM req
WHERE NOT EXISTS (
    SELECT 1 FROM {table} AS b JOIN req AS q ON b.lock_key = q.k
    WHERE (b.expires_at > {{now}} AND b.owner IS NOT ?1)
       OR (?5 AND b.last_outcome IS 1 AND NOT {ran_out_b}))
{take_over}
RETURNING lock_key, hold_count, fencing_token, expires_at * 1000",
            ran_out_b = ran_out("b."),
            take_over = TAKE_OVER
                .replace("{ran_out_l}", &ran_out("l."))
                .replace("{same}", SAME)
                .replace("{tenure}", &of_key("tenure"))
                .replace("{held}", &of_key("held"))
                .replace("{once}", "?5"),
            table = lite.table,
        )
        .replace("{now}", NOW);
        let mut q = sqlx::query(AssertSqlSafe(text))
            .bind(first.owner)
            .bind(first.ttl_us)
            .bind(first.holder)
            .bind(first.min_hold_us)
            .bind(first.once);
        for a in all {
            q = q
                .bind(a.key)
                .bind(a.attempt)
                .bind(a.tenure)
                .bind(i64::from(a.held));
        }
        let rows = q.fetch_all(&mut *conn).await?;
        let grants = rows.iter().map(|row| crate::backend::keyed_grant(row, 1));
        Ok(Some(crate::backend::per_key_decoded(all, grants)?))
    }
}

impl OnSqlite for Release<'_> {
    async fn sqlite(&self, lite: &Lite, conn: &mut SqliteConnection) -> sqlx::Result<Released> {
        let q = bound::<Sqlite>(lite.sql.release.clone(), &self.args())?;
        let row = q.fetch_optional(&mut *conn).await?;
        Ok(Released::left(row.map(|r| r.try_get(0)).transpose()?))
    }
}

impl OnSqlite for Extend<'_> {
    async fn sqlite(&self, lite: &Lite, conn: &mut SqliteConnection) -> sqlx::Result<Option<i64>> {
        let q = bound::<Sqlite>(lite.sql.extend.clone(), &self.args())?;
        let row = q.fetch_optional(&mut *conn).await?;
        row.map(|r| r.try_get(0)).transpose()
    }
}

impl OnSqlite for ExtendMany<'_> {
    /// Renewal of many leases: one UPDATE ... FROM a list of (key, owner, token, ttl, max_hold)
    /// rows, under SQLite's single write lock, with the same owner/tenure/live check and the
    /// same rounding to milliseconds as `extend`.
    async fn sqlite(&self, lite: &Lite, conn: &mut SqliteConnection) -> sqlx::Result<Extended> {
        let items = self.0;
        let rows = vec!["(?, ?, ?, ?, ?)"; items.len()].join(", ");
        let text = format!(
            "UPDATE {table} AS l
SET expires_at = max(l.expires_at, min({now} + (r.column4 + 999) / 1000, l.acquired_at + r.column5 / 1000)),
    {renewed}
FROM (VALUES {rows}) AS r
WHERE l.lock_key = r.column1 AND l.owner = r.column2 AND l.fencing_token = r.column3
  AND l.expires_at > {now}
RETURNING lock_key, owner, fencing_token",
            table = lite.table,
            now = NOW,
            renewed = crate::backend::migrations::RENEWED,
        );
        let q = bound::<Sqlite>(AssertSqlSafe(text).into_sql_str(), &self.args())?;
        let rows = q.fetch_all(&mut *conn).await?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get::<i64, _>(2)? as u64)))
            .collect()
    }
}
