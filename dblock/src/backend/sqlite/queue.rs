//! The fair queue's statements on SQLite, one per step of a waiter, bound as
//! [`QueueStep::args`] lists them; a join answers its ticket as the row id it inserted.

#[allow(unused_imports)]
use super::*;
use crate::backend::*;

impl OnSqlite for QueueStep<'_> {
    async fn sqlite(&self, lite: &Lite, conn: &mut SqliteConnection) -> sqlx::Result<i64> {
        let args = self.args();
        let q = bound::<Sqlite>(lite.sql.queue_steps.of(self).clone(), &args)?;
        Ok(match self {
            QueueStep::Join { .. } => q.execute(conn).await?.last_insert_rowid(),
            QueueStep::Ahead { .. } => q.fetch_one(conn).await?.try_get(0)?,
            QueueStep::Touch { .. } | QueueStep::Leave { .. } => {
                q.execute(conn).await?.rows_affected() as i64
            }
        })
    }
}
