//! What an operator asks about a lock table beyond its rows (`Locker::inspect`, `held`): which of
//! the schema's migrations its database has ([`Locker::migration_status`]), and who waits in the
//! fair queue of its keys ([`Locker::waiters`]). The `dblock` command-line tool (crate
//! `dblock-cli`) is built on these.
//!
//! Both are reads sent as plain simple-protocol statements without parameters (one round trip
//! each, nothing prepared), so they work the same through a transaction pooler (PgBouncer in
//! transaction mode) as against the server.

use std::time::{Duration, SystemTime};

use crate::backend::operator::{Probes, Queue, MIGRATIONS};
use crate::error::LockError;
use crate::info::{millis, time_from_micros};
use crate::locker::Locker;

/// One migration of the lock table's schema (the files `migrations/<backend>/NNNN_name.sql` of
/// the dblock package, which [`Locker::migrate`] applies in order), and whether the database has
/// it.
///
/// ```
/// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
/// for m in locker.migration_status().await? {
///     println!("{:04} {:<14} {}", m.version, m.name, if m.applied { "applied" } else { "pending" });
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationStatus {
    /// The migration's number: 1 for `0001_dblock_locks.sql`.
    pub version: u32,
    /// Its file's name without number and extension: `"dblock_locks"`, `"outcomes"`,
    /// `"exactly_once"`, `"fair_queue"`, `"permits"`, `"shared"`.
    pub name: &'static str,
    /// Whether the tables and columns it creates are there.
    pub applied: bool,
}

/// A caller waiting in arrival order for a key ([`LockRequest::fair`](crate::LockRequest::fair)):
/// its ticket in the key's queue (the lock table's `<table>_queue`). The ticket is a short lease
/// the waiter renews while it waits, so a waiter that died leaves the queue by itself.
///
/// ```
/// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
/// for w in locker.waiters("report:").await? {
///     println!("{} ticket {} owner {} (ticket lease {:?} left)", w.key, w.ticket, w.owner, w.time_left);
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Waiter {
    /// The key waited for.
    pub key: String,
    /// Its place in the key's queue: smaller tickets go first.
    pub ticket: u64,
    /// The waiting owner's id.
    pub owner: String,
    /// When the ticket's lease ends unless the waiter renews it. Database clock.
    pub expires_at: SystemTime,
    /// What is left of the ticket's lease, measured by the database.
    pub time_left: Duration,
}

impl Locker {
    /// Which migrations of the lock table's schema (`migrations/<backend>/`, 0001 to 0006) this
    /// locker's table has, oldest first: each probed by reading none of the rows of the
    /// tables and columns it creates. Read-only; a table that is not there is no error (its
    /// migrations are pending). [`migrate`](Locker::migrate) applies the pending ones.
    ///
    #[cfg_attr(feature = "sqlite", doc = "```")]
    #[cfg_attr(not(feature = "sqlite"), doc = "```no_run")]
    /// # async fn demo() -> Result<(), dblock::LockError> {
    /// let locker = dblock::Locker::connect("sqlite::memory:").await?;
    /// assert!(locker.migration_status().await?.iter().all(|m| !m.applied));
    /// locker.migrate().await?;
    /// let status = locker.migration_status().await?;
    /// assert_eq!(status.len(), 6);
    /// assert!(status.iter().all(|m| m.applied));
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub async fn migration_status(&self) -> Result<Vec<MigrationStatus>, LockError> {
        LockError::require_runtime()?;
        let shared = self.shared();
        shared.check_open()?;
        let backend = shared.backend()?;
        let probes = Probes {
            table: self.table_name(),
        };
        let applied = shared
            .once("migration status", |limit| backend.run(&probes, limit))
            .await?;
        Ok(MIGRATIONS
            .iter()
            .zip(applied)
            .map(|(m, applied)| MigrationStatus {
                version: m.version,
                name: m.name,
                applied,
            })
            .collect())
    }

    /// The fair waiters ([`LockRequest::fair`](crate::LockRequest::fair)) of the keys that
    /// start with `prefix` (`""`: every key) whose tickets are live, ordered by key, then in
    /// the order they will be served. Callers waiting without `fair` poll and are not
    /// recorded anywhere. Read-only.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let queued = locker.waiters("payout:").await?;
    /// if let Some(next) = queued.first() {
    ///     println!("{} is next for {}", next.owner, next.key);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn waiters(&self, prefix: &str) -> Result<Vec<Waiter>, LockError> {
        LockError::require_runtime()?;
        let shared = self.shared();
        shared.check_open()?;
        let backend = shared.backend()?;
        let read = Queue {
            table: self.table_name(),
        };
        let rows = shared
            .once("waiters", |limit| backend.run(&read, limit))
            .await?;
        // The queue holds live waiters only: reading it whole and keeping the prefix here
        // needs no parameter (nothing to inline behind a pooler).
        Ok(rows
            .into_iter()
            .filter(|r| r.key.starts_with(prefix))
            .map(|r| Waiter {
                key: r.key,
                ticket: u64::try_from(r.ticket).unwrap_or(0),
                owner: r.owner,
                expires_at: time_from_micros(r.expires_at_us),
                time_left: millis(r.left_ms),
            })
            .collect())
    }
}
