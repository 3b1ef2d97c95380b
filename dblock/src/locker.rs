//! [`Locker`]: the public handle to a lock table.

use std::fmt;
use std::sync::Arc;

use tracing::Instrument;

use crate::backend::fence::FenceConnection;
use crate::error::LockError;
use crate::in_tx::LockInRequest;
use crate::leader::LeaderRequest;
use crate::multi::LockAllRequest;
use crate::request::LockRequest;
use crate::semaphore::SemaphoreRequest;
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

    /// A shared (read) hold of `key`: any number of readers at once; [`lock`](Locker::lock) of
    /// the same key is the writer, which excludes them and which they exclude. Once a writer
    /// waits, readers that arrive after it wait behind it (recorded in the database, so across
    /// processes), and the writer gets the key when the readers already in leave. The guard is
    /// a lease like a lock's (ttl, renewal, release, the read tenure's fencing token). See
    /// [`ReadRequest`](crate::ReadRequest).
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let snapshot = locker.read("config").wait(std::time::Duration::from_secs(5)).await?;
    /// // ... read the configuration; writers wait ...
    /// snapshot.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn read(&self, key: impl Into<String>) -> crate::ReadRequest {
        crate::ReadRequest::new(self.shared.clone(), key.into())
    }

    /// A counting semaphore on `key` with `permits` permits: at most that many holders at once,
    /// across processes. `.await` the request for a permit (a [`LockGuard`](crate::LockGuard)); each permit is a
    /// lease of its own (owner, ttl, renewal, its own fencing token). Every call on one key must
    /// ask for the same number of permits ([`LockError::PermitsMismatch`] otherwise). Semaphore
    /// keys live apart from lock keys (`lock("k")` and `semaphore("k", 3)` are unrelated) and
    /// are at most 233 bytes. See [`SemaphoreRequest`].
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let permit = locker.semaphore("exports", 3).wait(std::time::Duration::from_secs(30)).await?;
    /// // ... at most 3 of these run at once ...
    /// permit.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn semaphore(&self, key: impl Into<String>, permits: u32) -> SemaphoreRequest {
        SemaphoreRequest::new(self.shared.clone(), key.into(), permits)
    }

    /// An election on `key` (leader election on a lease, as etcd's): `.campaign()` waits until
    /// this instance leads, `.current()` names the leader, `.observe()` follows the changes.
    /// The election is the lock on `key` in this table. See [`LeaderRequest`].
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let leadership = locker.leader("scheduler").holder("node-a").campaign().await?;
    /// tokio::select! {
    ///     _ = leadership.lost() => {}                      // stop leading
    ///     () = std::future::pending::<()>() => {}          // ... run the scheduler ...
    /// }
    /// # Ok(()) }
    /// ```
    pub fn leader(&self, key: impl Into<String>) -> LeaderRequest {
        LeaderRequest::new(self.shared.clone(), key.into())
    }

    /// Takes `key` **inside the caller's open transaction** on the lock's own database, with one
    /// statement of that transaction, and holds it until the transaction commits or rolls back.
    /// The database's row lock is the lock: no lease, no renewal, nothing to release; a crash
    /// or a dropped connection ends the transaction and frees the key at once. The key's
    /// fencing token goes up, as for any tenure. It excludes lease holders of the key
    /// ([`lock`](Self::lock), [`read`](Self::read), [`lock_all`](Self::lock_all), a
    /// [`leader`](Self::leader)) and they exclude it; semaphores are keys of their own. Inside
    /// a locked body (`tx = ..` on the attribute) [`dblock::current`](crate::current) reports
    /// it, and committed, the hold records `Succeeded`.
    ///
    /// `.wait(d)` bounds it ([`LockError::Busy`] after); the caller's session never waits on a
    /// row lock for it:
    /// - PostgreSQL: the row is locked with `FOR UPDATE SKIP LOCKED`, only if free; a key held
    ///   by a lease or by another transaction is busy at once, and tried again until `wait`.
    ///   Works through PgBouncer in transaction mode (a simple query then). At REPEATABLE READ
    ///   or SERIALIZABLE take it first in the transaction: a key taken or released after the
    ///   transaction's snapshot makes the statement fail with a serialization error (roll back).
    /// - MariaDB: one `UPDATE` whose wait for the row is bounded by `SET STATEMENT
    ///   innodb_lock_wait_timeout = 0`; a key no one has used gets its row first on the
    ///   locker's own connections (never an insert or gap lock in the caller's transaction).
    ///   MySQL 8 has no per-statement bound: the session's `innodb_lock_wait_timeout` applies.
    ///   At REPEATABLE READ (the default there), an `UPDATE` that finds the key taken (by a
    ///   lease, in the instant after that check) keeps the row locked until the transaction
    ///   ends, which would hold up the holder's release: then `lock_in` answers `Busy` at once,
    ///   whatever its `wait`; roll back and try again. At READ COMMITTED it waits as asked.
    ///   On MariaDB Galera a row lock is the node's own: a `lock_in` or a lease of the key on
    ///   another node is granted beside it (same fencing token), and certification settles it
    ///   at commit — the first to commit wins, the other transaction fails its commit (1213)
    ///   with all its work. Before its commit such a hold excludes nothing outside the database:
    ///   send every `lock_in` of a key to one node, or use a lease.
    /// - SQLite: the statement takes the database's write lock, kept by the transaction: while
    ///   it is open no other connection writes anything in that file, and every lock statement
    ///   of every locker on it waits (up to its busy timeout). Begin with `BEGIN IMMEDIATE` so
    ///   the transaction never has to upgrade a read snapshot (`SQLITE_BUSY`).
    ///
    /// A lease call on a key held this way is `Busy`: PostgreSQL's lock statements wait at most
    /// 250 ms for a row lock (`lock_timeout`) and try again within their `wait`; MySQL's one
    /// second (`innodb_lock_wait_timeout`, whole seconds).
    ///
    #[cfg_attr(feature = "sqlite", doc = "```")]
    #[cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// # let path = std::env::temp_dir().join(format!("dblock-lock-in-doc-{}.db", std::process::id()));
    /// # let url = format!("sqlite://{}?mode=rwc", path.display());
    /// let db = sqlx::SqlitePool::connect(&url).await?;
    /// let locker = dblock::Locker::sqlite(db.clone());
    /// locker.migrate().await?;
    ///
    /// let mut tx = db.begin_with("BEGIN IMMEDIATE").await?;
    /// let lock = locker.lock_in(&mut *tx, "order:7").await?;
    /// // ... the work in `tx`, fenced by the row lock; `lock.fencing_token()` for other stores ...
    /// tx.commit().await?; // the key is free, and its hold recorded as succeeded
    /// # let _ = lock;
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub fn lock_in<'c, C: FenceConnection>(
        &self,
        conn: &'c mut C,
        key: impl Into<String>,
    ) -> LockInRequest<'c, C> {
        LockInRequest::new(self.shared.clone(), conn, key.into())
    }

    /// Starts a request for several keys at once, all or nothing: they are taken in one
    /// canonical order (sorted bytes, duplicates merged) as one owner, so two calls naming the
    /// same keys in any order cannot deadlock; `wait` bounds the whole set; whatever was taken
    /// when one key cannot be had is given back at once. Keys are anything `AsRef<str>`: an
    /// array or slice of `&str`, a `Vec<String>`. See [`LockAllRequest`].
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guards = locker.lock_all(["acct:2", "acct:1"]).wait(std::time::Duration::from_secs(5)).await?;
    /// assert_eq!(guards.len(), 2);
    /// # Ok(()) }
    /// ```
    pub fn lock_all<I>(&self, keys: I) -> LockAllRequest
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        LockAllRequest::new(
            self.shared.clone(),
            keys.into_iter().map(|k| k.as_ref().to_owned()).collect(),
        )
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
        if LockError::require_runtime().is_ok() {
            self.shared.shutdown().await;
        }
    }
}
