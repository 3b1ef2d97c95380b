//! Semaphores' one statement of their own (the permits are lock rows: `semaphore.rs` at the
//! crate's root): waiters that found every permit taken ask the holders' releases to wake them.

use super::Statement;

/// A waiter of a semaphore whose permits are all taken asks each live slot's release to NOTIFY
/// (PostgreSQL, as the lock's waiters ask theirs: the slot rows' `contended` flag). Nothing to
/// do elsewhere: there the waiters poll.
pub(crate) struct FlagSlots<'a> {
    /// The slot rows' keys.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub keys: &'a [String],
}

impl Statement for FlagSlots<'_> {
    type Output = ();
}

/// Nothing to do where waiters poll.
#[cfg(feature = "mysql")]
impl super::OnMySql for FlagSlots<'_> {
    async fn mysql(&self, _: &super::mysql::My, _: &mut sqlx::MySqlConnection) -> sqlx::Result<()> {
        Ok(())
    }
}

#[cfg(feature = "sqlite")]
impl super::OnSqlite for FlagSlots<'_> {
    async fn sqlite(
        &self,
        _: &super::sqlite::Lite,
        _: &mut sqlx::SqliteConnection,
    ) -> sqlx::Result<()> {
        Ok(())
    }
}
