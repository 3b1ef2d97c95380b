//! The schema on SQLite: the statements of the migration files, applied in order.

#[allow(unused_imports)]
use super::*;
use crate::backend::*;

impl OnSqlite for Migrate {
    async fn sqlite(&self, lite: &Lite, conn: &mut SqliteConnection) -> sqlx::Result<()> {
        // One statement under SQLite's write lock; IF NOT EXISTS makes repeats a no-op.
        let schema = &lite.sql.schema;
        sqlx::raw_sql(schema.create.clone())
            .execute(&mut *conn)
            .await?;
        // Migrations 0002, 0003, 0006 and 0007, each unless its columns are there: checked again
        // and applied under the database's write lock (BEGIN IMMEDIATE), so racing processes add
        // them once.
        for (has, add) in lite.sql.has_columns.iter().zip(&schema.columns) {
            if sqlx::query(has.clone()).execute(&mut *conn).await.is_ok() {
                continue;
            }
            let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
            if sqlx::query(has.clone()).execute(&mut *tx).await.is_err() {
                sqlx::raw_sql(add.clone()).execute(&mut *tx).await?;
            }
            tx.commit().await?;
        }
        // Migration 0004, IF NOT EXISTS as the table's own.
        sqlx::raw_sql(schema.queue.clone())
            .execute(&mut *conn)
            .await?;
        // The one clock check that costs nothing at run time: a lock taken "in the future" was
        // written by a process whose clock is ahead of this one's, and expiry between the two
        // is then wrong by that much.
        let ahead_ms: Option<i64> = sqlx::query_scalar(lite.sql.clock_check.clone())
            .fetch_one(&mut *conn)
            .await?;
        if let Some(ms) = ahead_ms.filter(|ms| *ms > CLOCK_TOLERANCE_MS) {
            tracing::warn!(
                ahead_ms = ms,
                "a process sharing this SQLite file took a lock {ms} ms ahead of this process's \
                 clock: every process sharing one SQLite file must share one clock, or leases \
                 end early or late by the difference"
            );
        }
        Ok(())
    }
}
