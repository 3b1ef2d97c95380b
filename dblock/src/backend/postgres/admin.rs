//! The operator's statements on PostgreSQL and the last-writer read.

#[allow(unused_imports)]
use super::*;
use crate::backend::*;
use crate::info::LockInfo;

impl OnPostgres for LastWriteOf<'_> {
    async fn postgres(
        &self,
        pg: &Pg,
        conn: &mut PgConnection,
    ) -> Result<Option<LastWrite>, sqlx::Error> {
        let key = self.0;
        let row = pg
            .fetch_optional(conn, &pg.sql.last_write, &[Arg::Text(key)])
            .await?;
        row.map(|r| {
            Ok(LastWrite {
                writer: r.try_get(0)?,
                fencing_token: r.try_get(1)?,
                release_id: r.try_get(2)?,
                release_token: r.try_get(3)?,
            })
        })
        .transpose()
    }
}

impl OnPostgres for Inspect<'_> {
    async fn postgres(
        &self,
        pg: &Pg,
        conn: &mut PgConnection,
    ) -> Result<Option<LockInfo>, sqlx::Error> {
        let key = self.0;
        let row = pg
            .fetch_optional(conn, &pg.sql.inspect, &[Arg::Text(key)])
            .await?;
        row.map(|r| crate::backend::admin::decode(&r).map(LockInfo::from))
            .transpose()
    }
}

impl OnPostgres for LiveRows {
    async fn postgres(
        &self,
        pg: &Pg,
        conn: &mut PgConnection,
    ) -> Result<Vec<LockInfo>, sqlx::Error> {
        let rows = pg.fetch_all(conn, &pg.sql.held, &[]).await?;
        rows.iter()
            .map(|r| crate::backend::admin::decode(r).map(LockInfo::from))
            .collect()
    }
}

impl OnPostgres for RowsIn<'_> {
    async fn postgres(
        &self,
        pg: &Pg,
        conn: &mut PgConnection,
    ) -> Result<Vec<LockInfo>, sqlx::Error> {
        let &RowsIn {
            from,
            to,
            taken_within_us,
        } = self;
        let args = [Arg::Text(from), Arg::Text(to), Arg::Int8(taken_within_us)];
        let rows = pg.fetch_all(conn, &pg.sql.rows_in, &args).await?;
        rows.iter()
            .map(|r| crate::backend::admin::decode(r).map(LockInfo::from))
            .collect()
    }
}

impl OnPostgres for ForceRelease<'_> {
    async fn postgres(&self, pg: &Pg, conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
        let key = self.0;
        Ok(pg
            .execute(conn, &pg.sql.force_release, &[Arg::Text(key)])
            .await?
            > 0)
    }
}

impl OnPostgres for Reset<'_> {
    async fn postgres(&self, pg: &Pg, conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
        let key = self.0;
        Ok(pg.execute(conn, &pg.sql.reset, &[Arg::Text(key)]).await? > 0)
    }
}

impl OnPostgres for Purge {
    async fn postgres(&self, pg: &Pg, conn: &mut PgConnection) -> Result<u64, sqlx::Error> {
        let older_than_us = self.older_than_us;
        let mut total = 0;
        loop {
            let n = pg
                .execute(conn, &pg.sql.purge, &[Arg::Int8(older_than_us)])
                .await?;
            total += n;
            if n < PURGE_BATCH {
                return Ok(total);
            }
        }
    }
}
