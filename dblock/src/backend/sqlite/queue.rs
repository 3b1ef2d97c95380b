//! The fair queue's statements on SQLite, one per step of a waiter.

#[allow(unused_imports)]
use super::*;
use crate::backend::*;

impl OnSqlite for QueueStep<'_> {
    async fn sqlite(&self, lite: &Lite, conn: &mut SqliteConnection) -> Result<i64, sqlx::Error> {
        let step = *self;
        let s = &lite.sql;
        Ok(match step {
            QueueStep::Join {
                key,
                owner,
                lease_us,
            } => sqlx::query(s.queue_join.clone())
                .bind(key)
                .bind(owner)
                .bind(ms_ceil(lease_us))
                .execute(conn)
                .await?
                .last_insert_rowid(),
            QueueStep::Ahead { key, ticket } => {
                sqlx::query_scalar(s.queue_ahead.clone())
                    .bind(key)
                    .bind(ticket)
                    .fetch_one(conn)
                    .await?
            }
            QueueStep::Touch {
                key,
                owner,
                ticket,
                lease_us,
            } => sqlx::query(s.queue_touch.clone())
                .bind(key)
                .bind(owner)
                .bind(ticket)
                .bind(ms_ceil(lease_us))
                .execute(conn)
                .await?
                .rows_affected() as i64,
            QueueStep::Leave { key, owner, ticket } => sqlx::query(s.queue_leave.clone())
                .bind(key)
                .bind(owner)
                .bind(ticket)
                .execute(conn)
                .await?
                .rows_affected() as i64,
        })
    }
}
