//! The fair queue's statements on PostgreSQL, one per step of a waiter, bound as
//! [`QueueStep::args`] lists them; a join answers its ticket with `RETURNING`.

#[allow(unused_imports)]
use super::*;
use crate::backend::*;

impl OnPostgres for QueueStep<'_> {
    async fn postgres(&self, pg: &Pg, conn: &mut PgConnection) -> sqlx::Result<i64> {
        let (sql, args) = (pg.sql.queue_steps.of(self), self.args());
        match self {
            QueueStep::Join { .. } | QueueStep::Ahead { .. } => {
                let row = pg.send::<Option<PgRow>>(conn, sql, &args).await?;
                row.ok_or(sqlx::Error::RowNotFound)?.try_get(0)
            }
            QueueStep::Touch { .. } | QueueStep::Leave { .. } => {
                Ok(pg.send::<Changed>(conn, sql, &args).await?.0 as i64)
            }
        }
    }
}
