//! The fair queue's statements on PostgreSQL, one per step of a waiter.

#[allow(unused_imports)]
use super::*;
use crate::backend::*;

impl OnPostgres for QueueStep<'_> {
    async fn postgres(&self, pg: &Pg, conn: &mut PgConnection) -> Result<i64, sqlx::Error> {
        let step = *self;
        let s = &pg.sql;
        match step {
            QueueStep::Join {
                key,
                owner,
                lease_us,
            } => {
                let row = pg
                    .fetch_optional(
                        conn,
                        &s.queue_join,
                        &[Arg::Text(key), Arg::Text(owner), Arg::Int8(lease_us)],
                    )
                    .await?
                    .ok_or(sqlx::Error::RowNotFound)?;
                row.try_get(0)
            }
            QueueStep::Ahead { key, ticket } => {
                let row = pg
                    .fetch_optional(conn, &s.queue_ahead, &[Arg::Text(key), Arg::Int8(ticket)])
                    .await?
                    .ok_or(sqlx::Error::RowNotFound)?;
                row.try_get(0)
            }
            QueueStep::Touch {
                key,
                owner,
                ticket,
                lease_us,
            } => {
                let args = [
                    Arg::Text(key),
                    Arg::Text(owner),
                    Arg::Int8(ticket),
                    Arg::Int8(lease_us),
                ];
                Ok(pg.execute(conn, &s.queue_touch, &args).await? as i64)
            }
            QueueStep::Leave { key, owner, ticket } => {
                let args = [Arg::Text(key), Arg::Text(owner), Arg::Int8(ticket)];
                Ok(pg.execute(conn, &s.queue_leave, &args).await? as i64)
            }
        }
    }
}
