//! The lock's own statements on PostgreSQL: acquire (one key, several keys), release, extend, and
//! renewal's extension of many leases.

#[allow(unused_imports)]
use super::*;
use crate::backend::*;

impl OnPostgres for Acquire<'_> {
    async fn postgres(&self, pg: &Pg, conn: &mut PgConnection) -> sqlx::Result<Attempt> {
        // A waiter whose LISTEN is in place sends the text with `flag`, which reads `$10`.
        let mut args = self.args().to_vec();
        let text = if self.waiting {
            args.push(Arg::Bool(true));
            &pg.sql.acquire_waiting
        } else {
            &pg.sql.acquire
        };
        let row = pg.send::<Option<PgRow>>(conn, text, &args).await?;
        let Some(row) = row else {
            // The key was inserted by someone else during this statement.
            return Ok(Attempt::Busy { retry_after: None });
        };
        crate::backend::attempt_row(&row)
    }
}

impl OnPostgres for AcquireMany<'_> {
    async fn postgres(
        &self,
        pg: &Pg,
        conn: &mut PgConnection,
    ) -> sqlx::Result<Option<Vec<Attempt>>> {
        let AcquireMany { first, all } = *self;
        let keys: Vec<&str> = all.iter().map(|a| a.key).collect();
        let attempts: Vec<i64> = all.iter().map(|a| a.attempt).collect();
        let tenures: Vec<i64> = all.iter().map(|a| a.tenure.unwrap_or(-1)).collect();
        let held: Vec<i64> = all.iter().map(|a| i64::from(a.held)).collect();
        let rows = pg
            .send::<Vec<PgRow>>(
                conn,
                &pg.sql.acquire_many,
                &[
                    Arg::TextArray(&keys),
                    Arg::Int8Array(&attempts),
                    Arg::Int8Array(&tenures),
                    Arg::Int8Array(&held),
                    Arg::Text(first.owner),
                    Arg::Float8(first.ttl_us as f64),
                    Arg::Text(first.holder),
                    Arg::Float8(first.min_hold_us as f64),
                    Arg::Bool(first.once),
                ],
            )
            .await?;
        let grants = rows.iter().map(|row| crate::backend::keyed_grant(row, 1));
        Ok(Some(crate::backend::per_key_decoded(all, grants)?))
    }
}

impl OnPostgres for Release<'_> {
    async fn postgres(&self, pg: &Pg, conn: &mut PgConnection) -> sqlx::Result<Released> {
        let mut args = self.args();
        args.extend([Arg::Text(&pg.channel), Arg::Bool(pg.settings.lazy_release)]);
        let row = pg
            .send::<Option<PgRow>>(conn, &pg.sql.release, &args)
            .await?;
        let left: Option<i32> = row.map(|r| r.try_get(0)).transpose()?;
        Ok(Released::left(left.map(i64::from)))
    }
}

impl OnPostgres for Extend<'_> {
    async fn postgres(&self, pg: &Pg, conn: &mut PgConnection) -> sqlx::Result<Option<i64>> {
        let row = pg
            .send::<Option<PgRow>>(conn, &pg.sql.extend, &self.args())
            .await?;
        row.map(|r| r.try_get(0)).transpose()
    }
}

impl OnPostgres for ExtendMany<'_> {
    async fn postgres(&self, pg: &Pg, conn: &mut PgConnection) -> sqlx::Result<Extended> {
        let items = self.0;
        let keys: Vec<&str> = items.iter().map(|i| i.key).collect();
        let owners: Vec<&str> = items.iter().map(|i| i.owner).collect();
        let tokens: Vec<i64> = items.iter().map(|i| i.fencing_token as i64).collect();
        let ttls: Vec<f64> = items.iter().map(|i| i.ttl_us as f64).collect();
        let caps: Vec<f64> = items.iter().map(|i| i.max_hold_us as f64).collect();
        let rows = pg
            .send::<Vec<PgRow>>(
                conn,
                &pg.sql.extend_many,
                &[
                    Arg::TextArray(&keys),
                    Arg::TextArray(&owners),
                    Arg::Int8Array(&tokens),
                    Arg::Float8Array(&ttls),
                    Arg::Float8Array(&caps),
                ],
            )
            .await?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get::<i64, _>(2)? as u64)))
            .collect()
    }
}
