//! The fair queue's statements on MySQL and MariaDB, one per step of a waiter.

#[allow(unused_imports)]
use super::*;
use crate::backend::*;

impl OnMySql for QueueStep<'_> {
    async fn mysql(&self, my: &My, conn: &mut MySqlConnection) -> Result<i64, sqlx::Error> {
        let step = *self;
        let s = &my.sql;
        Ok(match step {
            QueueStep::Join {
                key,
                owner,
                lease_us,
            } => {
                let done = sqlx::query(s.queue_join.clone())
                    .bind(key)
                    .bind(owner)
                    .bind(lease_us)
                    .execute(conn)
                    .await?;
                done.last_insert_id() as i64
            }
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
                .bind(lease_us)
                .bind(key)
                .bind(owner)
                .bind(ticket)
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
