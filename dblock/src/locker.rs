//! [`Locker`]: the public handle to a lock table.

use std::fmt;
use std::sync::Arc;

use tracing::Instrument;

use crate::error::LockError;
use crate::request::LockRequest;
use crate::shared::Shared;

/// The lock table used unless [`Locker::table`] names another.
pub(crate) const DEFAULT_TABLE: &str = "dblock_locks";

/// The handle to a lock table in a database. Cheap to clone (an `Arc` inside), `Send + Sync`.
///
#[cfg_attr(feature = "sqlite", doc = "```")]
#[cfg_attr(not(feature = "sqlite"), doc = "```no_run")]
/// # async fn demo() -> Result<(), dblock::LockError> {
/// use std::time::Duration;
/// let locker = dblock::Locker::connect("sqlite::memory:").await?; // or postgres://…, mysql://…
/// locker.migrate().await?;
///
/// let guard = locker
///     .lock("report:2026-11")
///     .ttl(Duration::from_secs(30))
///     .wait(Duration::from_secs(5))
///     .await?;
/// // ... the critical section ...
/// guard.release().await?;
/// # Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
/// ```
#[derive(Clone)]
pub struct Locker {
    shared: Arc<Shared>,
}

impl fmt::Debug for Locker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locker")
            .field("backend", &self.shared.backend_name())
            .field("table", &self.shared.table)
            .finish()
    }
}

impl Locker {
    /// The private core, for the crate's own modules (the operator API, test hooks).
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// A handle on the core (the test hooks, `watch`'s task).
    pub(crate) fn from_shared(shared: Arc<Shared>) -> Locker {
        Locker { shared }
    }

    /// The same database, another lock table (default `dblock_locks`). The name is an
    /// identifier (`[A-Za-z_][A-Za-z0-9_]*`, optionally `schema.table`, at most 63 bytes a part);
    /// anything else makes every call on the returned locker fail with [`LockError::Config`].
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let jobs = locker.table("job_locks");
    /// jobs.migrate().await?;
    /// assert!(matches!(locker.table("x; DROP TABLE y").migrate().await,
    ///                  Err(dblock::LockError::Config(_))));
    /// # Ok(()) }
    /// ```
    pub fn table(&self, name: &str) -> Locker {
        Locker {
            shared: self.shared.with_table(name),
        }
    }

    /// The lock table's name.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) {
    /// assert_eq!(locker.table_name(), "dblock_locks");
    /// # }
    /// ```
    pub fn table_name(&self) -> &str {
        &self.shared.table
    }

    /// Which backend this locker talks to: `"postgres"`, `"mysql"` or `"sqlite"`.
    ///
    /// ```
    /// # async fn demo() -> Result<(), dblock::LockError> {
    /// let locker = dblock::Locker::connect("sqlite::memory:").await?;
    /// assert_eq!(locker.backend_name(), "sqlite");
    /// # Ok(()) }
    /// ```
    pub fn backend_name(&self) -> &'static str {
        self.shared.backend_name()
    }

    /// Creates the lock table and its companions (the fair queue `<table>_queue`, the
    /// semaphores' `<table>_permits`), or brings tables made by an older version up to date.
    /// Idempotent and safe to run from many processes at once; it never touches sqlx's
    /// `_sqlx_migrations`, and says nothing when there is nothing to do. For teams that run
    /// their own migrations, the same statements are the files `migrations/<backend>/0001` to
    /// `0007` shipped in this crate's package (what `migrate()` runs is read from them); rename
    /// the tables there when [`table`](Locker::table) names another.
    ///
    #[cfg_attr(feature = "sqlite", doc = "```")]
    #[cfg_attr(not(feature = "sqlite"), doc = "```no_run")]
    /// # async fn demo() -> Result<(), dblock::LockError> {
    /// let locker = dblock::Locker::connect("sqlite::memory:").await?;
    /// locker.migrate().await?;
    /// locker.migrate().await?; // no-op
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub async fn migrate(&self) -> Result<(), LockError> {
        LockError::require_runtime()?;
        self.shared.check_open()?;
        let backend = self.shared.backend()?;
        let span = tracing::debug_span!("dblock.migrate", backend = backend.name(), table = %self.shared.table);
        async {
            self.shared
                .run_bounded("migration", |limit| {
                    backend.run(&crate::backend::Migrate, limit)
                })
                .await?;
            // The semaphores' permits: a lock table of their own (`semaphore.rs`).
            let permits = self.shared.permits();
            let backend = permits.backend()?;
            permits
                .run_bounded("migration", |limit| {
                    backend.run(&crate::backend::Migrate, limit)
                })
                .await
        }
        .instrument(span)
        .await
        .inspect_err(|e| tracing::warn!(error = %e, "migration failed"))
    }

    /// Starts a request for the lock on `key`; configure it, then `.await` it.
    ///
    /// Keys are exact byte strings of 1 to 255 bytes (`"a"`, `"A"` and `"a "` are three locks).
    /// Inside an owner scope or a locked body the lock is taken as that owner (reentrant);
    /// outside, as a fresh owner. Defaults: `ttl` 30 s, `wait` zero (one attempt).
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// use std::time::Duration;
    /// let guard = locker.lock(format!("order:{}", 42))
    ///     .ttl(Duration::from_secs(10))
    ///     .wait(Duration::from_secs(2))
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn lock(&self, key: impl Into<String>) -> LockRequest {
        LockRequest::new(self.shared.clone(), key.into())
    }

    /// Takes the exclusive lock on `key` now, from whoever holds it (the Web Locks API's
    /// `steal`): a stuck holder, or a run superseded by a newer one. The old holder's lease ends
    /// at once (recorded `Failed`) and the key is taken with a new, larger fencing token; the
    /// old holder's next renewal finds it gone (its [`lost`](crate::LockGuard::lost) resolves,
    /// a locked body is cancelled with `Err(Lost)`), and its `extend`, `fence` and `succeed_in`
    /// fail with `Lost`, so none of its fenced writes can commit after the steal. Safe because
    /// of fencing: writes that are not fenced, or that do not check the token, are not stopped.
    ///
    /// Configure it as a [`lock`](Self::lock) (`ttl`, `holder`, `owner`, `max_hold`, ...);
    /// `wait` does not apply: a free key, or one this owner holds, is simply taken; a held one
    /// is freed and taken, a few times over if other owners race for it in between (then
    /// `Busy`). A key held by readers is freed the same way; a semaphore of the same name is
    /// another lock and is left alone.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let stuck = locker.lock("nightly-import").await?;
    /// let newer = locker.steal("nightly-import").await?;
    /// assert!(newer.fencing_token() > stuck.fencing_token());
    /// assert!(stuck.extend(std::time::Duration::from_secs(30)).await.unwrap_err().is_lost());
    /// # Ok(()) }
    /// ```
    pub fn steal(&self, key: impl Into<String>) -> LockRequest {
        LockRequest::new(self.shared.clone(), key.into()).stealing()
    }

    /// Shuts the locker down, for graceful deploys: every hold of its guards is released at once
    /// (recorded as failed; locked bodies end with [`LockError::Lost`] at their next `.await`),
    /// renewal and the PostgreSQL listener stop, calls still waiting for a key end with
    /// [`LockError::ShutDown`], and so does every later call on it (or on a clone). Another
    /// instance can take the keys at once. Idempotent.
    ///
    /// When a locked body or a call ends because of the shutdown, its own release is already
    /// over (done, or failed and logged): a `main` that returns as soon as its work ends with
    /// `Lost` or `ShutDown` loses nothing, and the next instance does not wait for the ttl.
    ///
    /// It covers the lockers made from this one with [`table`](Locker::table) (and the one it
    /// was made from): they share its connections, and a deploy that shuts one down means all
    /// of them. A locker connected separately is shut down on its own.
    ///
    /// Outside a tokio runtime (polled by another executor) no statement can be sent: the
    /// locker is shut down all the same, but its holds are left to their leases, which run out
    /// on the database (one warning each).
    ///
    /// Wire it to the signal that ends the process:
    ///
    /// ```no_run
    /// # async fn demo(locker: dblock::Locker) {
    /// let for_signal = locker.clone();
    /// tokio::spawn(async move {
    ///     let _ = tokio::signal::ctrl_c().await; // or tokio::signal::unix::signal(SIGTERM)
    ///     for_signal.shutdown().await;
    /// });
    /// # }
    /// ```
    pub async fn shutdown(&self) {
        self.shared.shutdown().await;
    }

    /// Shuts the locker down after the work already under its locks has finished, for at most
    /// `grace`: the deploy that lets running jobs end instead of cutting them.
    ///
    /// From the call on, nothing new is taken: a call that would take a new hold, and a call
    /// still waiting for a key, ends with [`LockError::ShutDown`] (on this locker and its
    /// [`table`](Locker::table) copies, as for `shutdown`). What is held goes on as before,
    /// renewed: locked bodies run to their end and release, guards are released by their
    /// holders, and an owner's re-entry of a key it holds is still granted (nested locked calls
    /// of running work). Once no hold is left, or when `grace` has passed, it runs
    /// [`shutdown`](Locker::shutdown), which releases whatever is still held (those bodies end
    /// with `Lost`). Returns how many holds were still live then (0: everything finished in
    /// time, its releases done). A leadership is a hold that lasts until resigned: resign it
    /// first, or it is cut at the end of `grace`. Work that takes a key it does not hold yet
    /// while the locker drains (a second key half-way) gets `ShutDown` for it: drain finishes
    /// work that holds its keys.
    ///
    #[cfg_attr(feature = "sqlite", doc = "```")]
    #[cfg_attr(not(feature = "sqlite"), doc = "```no_run")]
    /// # async fn demo() -> Result<(), dblock::LockError> {
    /// use std::time::Duration;
    /// let locker = dblock::Locker::connect("sqlite::memory:").await?;
    /// locker.migrate().await?;
    /// let job = locker.lock("nightly").await?;
    /// let finishing = tokio::spawn(async move {
    ///     tokio::time::sleep(Duration::from_millis(50)).await; // the job's last step
    ///     job.release().await
    /// });
    /// // SIGTERM: no new jobs; the running one may finish within 30 s.
    /// assert_eq!(locker.drain(Duration::from_secs(30)).await, 0);
    /// finishing.await.unwrap()?;
    /// assert!(matches!(locker.lock("nightly").await, Err(dblock::LockError::ShutDown)));
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub async fn drain(&self, grace: std::time::Duration) -> usize {
        self.shared.drain(grace).await
    }
}
