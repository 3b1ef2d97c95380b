//! The fair queue's statements on MySQL and MariaDB, one per step of a waiter, bound as
//! [`QueueStep::args`] lists them; a join answers its ticket as the `AUTO_INCREMENT` id it
//! inserted.

#[allow(unused_imports)]
use super::*;
use crate::backend::*;

impl OnMySql for QueueStep<'_> {
    async fn mysql(&self, my: &My, conn: &mut MySqlConnection) -> sqlx::Result<i64> {
        let args = self.args();
        let q = my.sql.queue_steps.of(self).bound(&args)?;
        Ok(match self {
            QueueStep::Join { .. } => q.execute(conn).await?.last_insert_id() as i64,
            QueueStep::Ahead { .. } => q.fetch_one(conn).await?.try_get(0)?,
            QueueStep::Touch { .. } | QueueStep::Leave { .. } => {
                q.execute(conn).await?.rows_affected() as i64
            }
        })
    }
}
