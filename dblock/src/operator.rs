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
use crate::backend::Runs;
use crate::error::LockError;
use crate::info::LockInfo;
use crate::info::{millis, time_from_micros};
use crate::locker::Locker;
use crate::validate;

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
    /// The current state of `key`'s row, or `None` if it has none. Read-only.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guard = locker.lock("k").await?;
    /// let info = locker.inspect("k").await?.expect("row exists");
    /// assert!(info.held);
    /// assert_eq!(info.fencing_token, guard.fencing_token());
    /// # Ok(()) }
    /// ```
    pub async fn inspect(&self, key: impl AsRef<str>) -> Result<Option<LockInfo>, LockError> {
        let key = key.as_ref();
        self.usable()?;
        validate::key(key)?;
        self.operate("inspect", crate::backend::Inspect(key)).await
    }

    /// Every lock currently held (live lease), ordered by key.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// for lock in locker.held().await? {
    ///     println!("{} held by {:?}, {:?} left", lock.key, lock.holder, lock.time_left);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn held(&self) -> Result<Vec<LockInfo>, LockError> {
        self.usable()?;
        let mut held = self.operate("held", crate::backend::LiveRows).await?;
        held.extend(crate::semaphore::all_live(self.shared()).await?);
        held.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(held)
    }

    /// The live permits of the semaphore `key` (see [`semaphore`](Locker::semaphore)), each a
    /// [`LockInfo`] with [`LockKind::Permit`](crate::LockKind::Permit): how many of its permits
    /// are in use, and by whom. Read-only.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let permit = locker.semaphore("exports", 3).holder("export-job").await?;
    /// let in_use = locker.permits("exports").await?;
    /// assert_eq!(in_use.len(), 1);
    /// assert!(matches!(in_use[0].kind, dblock::LockKind::Permit { permits: 3, .. }));
    /// assert_eq!(in_use[0].key, "exports");
    /// # Ok(()) }
    /// ```
    pub async fn permits(&self, key: impl AsRef<str>) -> Result<Vec<LockInfo>, LockError> {
        let key = key.as_ref();
        self.usable()?;
        validate::key(key)?;
        crate::semaphore::live(self.shared(), key).await
    }

    /// Frees `key` whoever holds it (operator action): the lock of that key, and every permit
    /// of the semaphore of that key. Returns `true` if anything live was freed.
    /// The old holder's release then fails with [`LockError::NotHeld`], its `extend`, `fence`
    /// and renewal with [`LockError::Lost`] (the lease was taken while it ran); the fencing
    /// token is kept, so the next owner still gets a larger one. A holder in this process
    /// learns it at once (its [`lost`](crate::LockGuard::lost) resolves, a locked body ends with
    /// `Lost`); one in another process at its next renewal. To take the key for yourself in
    /// the same breath, [`steal`](Locker::steal) it.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let stuck = locker.lock("k").await?;
    /// assert!(locker.force_release("k").await?);
    /// assert!(stuck.release().await.is_err()); // NotHeld
    /// # Ok(()) }
    /// ```
    pub async fn force_release(&self, key: impl AsRef<str>) -> Result<bool, LockError> {
        self.free(key.as_ref(), "").await
    }

    /// [`force_release`](Locker::force_release) of `owner`'s holds alone: frees the lock of
    /// `key` and the permits of the semaphore of `key` that the owner whose id is `owner` (as
    /// [`LockInfo::owner`] shows it) holds, and nothing else. For an operator who listed the
    /// holds of a dead machine and frees them: a key taken over by someone else since it was
    /// listed is left alone (one statement per row, the owner checked in it). Read holds are
    /// not freed this way (their row's owner is every reader's: `"(readers)"` is refused with
    /// a `Config` error). Returns `true` if anything live was freed.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let stuck = locker.lock("k").await?;
    /// let owner = stuck.owner().id().to_owned();
    /// assert!(!locker.force_release_if_owner("k", "someone-else").await?);
    /// assert!(locker.force_release_if_owner("k", &owner).await?);
    /// assert!(stuck.release().await.is_err()); // NotHeld
    /// # Ok(()) }
    /// ```
    pub async fn force_release_if_owner(
        &self,
        key: impl AsRef<str>,
        owner: &str,
    ) -> Result<bool, LockError> {
        if owner.is_empty() || crate::owner::is_marker(owner) {
            return Err(LockError::Config(format!(
                "force_release_if_owner: {owner:?} is no owner id (a row held under a marker, \
                 such as a read row, is every holder's: free it with force_release)"
            )));
        }
        self.free(key.as_ref(), owner).await
    }

    async fn free(&self, key: &str, owner: &str) -> Result<bool, LockError> {
        self.usable()?;
        validate::key(key)?;
        validate::text("owner id", owner)?;
        let freed = self.shared().free("force_release", key, owner).await?;
        let permits = crate::semaphore::force_release(self.shared(), key, owner).await?;
        tracing::info!(
            key = %crate::Escaped(key),
            owner = %crate::Escaped(owner),
            freed,
            permits,
            "force_release"
        );
        Ok(freed || permits > 0)
    }

    /// Makes a key that is not held runnable again: forgets how its last hold ended (a
    /// [`once`](crate::LockRequest::once) key whose work succeeded runs again, and
    /// [`purge`](Locker::purge) may then delete its row) and ends a
    /// [`min_hold`](crate::LockRequest::min_hold) wait. Returns `false` if the key is held (or has
    /// no row). For operators (`dblock reset KEY`, crate `dblock-cli`).
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// locker.lock("payout:9").once().await?.release().await?;
    /// assert!(locker.lock("payout:9").once().await.is_err()); // AlreadyDone
    /// assert!(locker.reset("payout:9").await?);
    /// assert!(locker.lock("payout:9").once().await.is_ok());
    /// # Ok(()) }
    /// ```
    pub async fn reset(&self, key: impl AsRef<str>) -> Result<bool, LockError> {
        let key = key.as_ref();
        self.usable()?;
        validate::key(key)?;
        let reset = self.operate("reset", crate::backend::Reset(key)).await?;
        tracing::info!(key = %crate::Escaped(key), reset, "reset");
        Ok(reset)
    }

    /// Deletes rows that have been free (or expired) for longer than `older_than` (locks and
    /// semaphore permits);
    /// `Duration::ZERO` deletes every row that is not held; an age over 100 years (up to
    /// `Duration::MAX`) is read as 100 years. Returns how many were deleted.
    /// Fencing tokens of purged keys still never go backwards: a new row's token is seeded from
    /// the database clock (in microseconds; on SQLite, its millisecond × 1000), and a row is
    /// deleted only once that seed is above its token. A row freed within the clock's current
    /// tick (a key released and purged within one millisecond on SQLite) is deleted after the
    /// tick: `purge` waits for it and deletes it then (it waits only for tokens at most a second
    /// ahead of the clock, twice at most). A row whose token went further past the clock (a key
    /// taken over faster than the clock moves, a server clock stepped back) stays until a later
    /// purge.
    ///
    /// The record of a [`once`](crate::LockRequest::once) key whose last hold succeeded is never
    /// deleted, whatever its age: without it the work would run again. An operator forgets one
    /// on purpose with [`reset`](Locker::reset) (`dblock reset KEY`), after which `purge`
    /// deletes it like any other free row.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let deleted = locker.purge(std::time::Duration::from_secs(24 * 3600)).await?;
    /// # Ok(()) }
    /// ```
    pub async fn purge(&self, older_than: Duration) -> Result<u64, LockError> {
        let deleted = self.purge_rows(older_than).await?;
        tracing::info!(table = %self.table_name(), deleted, ?older_than, "purge");
        Ok(deleted)
    }

    /// [`purge`](Locker::purge) without its log line (the background purge logs its own, at
    /// `DEBUG`).
    pub(crate) async fn purge_rows(&self, older_than: Duration) -> Result<u64, LockError> {
        self.usable()?;
        // Nothing is older than 100 years (the longest lease): a longer age, up to
        // `Duration::MAX`, deletes what that one does.
        let us = older_than.min(crate::validate::MAX_TTL).as_micros() as i64;
        let mut deleted = 0;
        // A row freed within the clock's current tick is kept for its fencing token (above);
        // a second round after that tick deletes it, so `Duration::ZERO` deletes every row not
        // held (whose token is not further ahead of the clock). The third round is for a tick
        // that had not quite turned, or rows freed meanwhile.
        for round in 1..=3 {
            let locks = self
                .operate("purge", crate::backend::Purge { older_than_us: us })
                .await?;
            let permits = crate::semaphore::purge(self.shared(), us).await?;
            deleted += locks.deleted + permits.deleted;
            let wait = locks.held_back_us.max(permits.held_back_us);
            match wait.map(|us| Duration::from_micros(us.max(1) as u64)) {
                Some(wait) if round < 3 && wait <= crate::timing::PURGE_HELD_BACK => {
                    tracing::debug!(?wait, "purge: rows freed within the clock's tick");
                    tokio::time::sleep(wait).await;
                }
                _ => break,
            }
        }
        Ok(deleted)
    }

    /// Which migrations of the lock table's schema (`migrations/<backend>/`, 0001 to 0007) this
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
    /// assert_eq!(status.len(), 7);
    /// assert!(status.iter().all(|m| m.applied));
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub async fn migration_status(&self) -> Result<Vec<MigrationStatus>, LockError> {
        self.usable()?;
        let applied = self
            .operate("migration status", Probes(self.table_name()))
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
        self.usable()?;
        let rows = self.operate("waiters", Queue(self.table_name())).await?;
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

impl Locker {
    /// Runs one of the operator's statements (`what` names it in errors) for at most one
    /// statement time-out, resending within it (after [`usable`](Self::usable)).
    async fn operate<S: Runs>(&self, what: &str, statement: S) -> Result<S::Output, LockError> {
        let shared = self.shared();
        let backend = shared.backend()?;
        shared
            .run_bounded(what, |limit| backend.run(&statement, limit))
            .await
    }

    /// What every operator call checks first: a runtime to run in, a locker not shut down.
    fn usable(&self) -> Result<(), LockError> {
        LockError::require_runtime()?;
        self.shared().check_open()
    }
}
