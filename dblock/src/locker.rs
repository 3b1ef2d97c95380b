//! [`Locker`]: the handle to the lock table, and [`LockRequest`], one `lock()` call.

use std::collections::HashMap;
use std::fmt;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use tracing::Instrument;

use crate::backend::{self, AcquireParams, Attempt, Backend, Grant};
use crate::guard::{Hold, LockGuard};
#[cfg(feature = "postgres")]
use crate::notify::Notifier;
use crate::owner::Context;
use crate::renew::Renewer;
use crate::{LockError, LockInfo, Owner};

/// Longest key, in bytes (the `lock_key` column's size).
pub const MAX_KEY_LEN: usize = 255;
/// The lease length when none is given.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);
/// How often a statement the server rolled back (deadlock, serialization failure, Galera
/// certification conflict) is sent again before the error is returned.
pub(crate) const MAX_ROLLBACK_RETRIES: u32 = 10;
/// How many broken pooled connections one call steps over (each is dropped by the pool) before
/// the error is returned. Waiting for a new connection is bounded by the pool's own timeout.
pub(crate) const MAX_RECONNECTS: u32 = 10;
/// Longest accepted lease: 100 years.
const MAX_TTL: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
/// First and largest pause between attempts while waiting for a busy key.
const FIRST_BACKOFF: Duration = Duration::from_millis(5);
const MAX_BACKOFF: Duration = Duration::from_millis(250);
/// How long `Locker::connect`'s pool waits for a connection before failing.
#[cfg(any(feature = "postgres", feature = "mysql"))]
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The handle to a lock table in a database. Cheap to clone (an `Arc` inside), `Send + Sync`.
///
/// ```
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
    inner: Arc<Inner>,
}

/// hash(owner, key) → the async mutex serialising that owner's statements on that key. A hash
/// collision only serialises two unrelated pairs, which is harmless; hashing spares the two
/// string allocations per statement that owned keys would cost.
type SerialMap = HashMap<u64, Weak<tokio::sync::Mutex<()>>>;

struct Inner {
    /// `Err` when `table()` was given a bad name: every call then reports it.
    backend: Result<Backend, String>,
    /// The leases this locker keeps alive, and its one renewal task.
    renewer: Arc<Renewer>,
    /// PostgreSQL: the LISTEN connection that wakes this locker's waiters on release.
    #[cfg(feature = "postgres")]
    notifier: Option<Arc<Notifier>>,
    /// One async mutex per (owner, key) with a statement in flight: see [`Locker::serialise`].
    serial: std::sync::Mutex<SerialMap>,
    table: String,
    holder: String,
}

impl fmt::Debug for Locker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locker")
            .field("backend", &self.inner.backend.as_ref().map(Backend::name))
            .field("table", &self.inner.table)
            .finish()
    }
}

impl Locker {
    fn from_backend(make: impl Fn(&str) -> Backend, table: &str) -> Locker {
        let backend = validate_table(table).map(|()| make(table));
        Locker::with(backend, table, default_holder())
    }

    fn with(backend: Result<Backend, String>, table: &str, holder: String) -> Locker {
        #[cfg(feature = "postgres")]
        let notifier = match &backend {
            #[cfg(feature = "postgres")]
            Ok(Backend::Postgres(pg)) => {
                Some(Notifier::new(pg.pool.clone(), pg.channel.to_string()))
            }
            _ => None,
        };
        Locker {
            inner: Arc::new(Inner {
                backend,
                renewer: Arc::default(),
                #[cfg(feature = "postgres")]
                notifier,
                serial: std::sync::Mutex::default(),
                table: table.to_owned(),
                holder,
            }),
        }
    }

    /// Connects to `url` and builds a pool configured for locking: autocommit connections at
    /// READ COMMITTED, no ping before each statement, a 3 s limit on waiting for a connection.
    ///
    /// | URL | backend | feature |
    /// |---|---|---|
    /// | `sqlite://path/locks.db?mode=rwc`, `sqlite::memory:` | SQLite (WAL, 10 s busy timeout) | `sqlite` (default) |
    /// | `postgres://user@host/db` | PostgreSQL | `postgres` |
    /// | `mysql://user@host/db` | MySQL 8, MariaDB ≥ 10.5 (also Galera) | `mysql` |
    ///
    /// ```
    /// # async fn demo() -> Result<(), dblock::LockError> {
    /// let locker = dblock::Locker::connect("sqlite::memory:").await?;
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub async fn connect(url: &str) -> Result<Locker, LockError> {
        LockError::require_runtime()?;
        let scheme = url.split(':').next().unwrap_or_default();
        let span = tracing::debug_span!("dblock.connect", scheme);
        async {
            match scheme {
                #[cfg(feature = "postgres")]
                "postgres" | "postgresql" => connect_postgres(url).await,
                #[cfg(feature = "mysql")]
                "mysql" | "mariadb" => connect_mysql(url).await,
                #[cfg(feature = "sqlite")]
                "sqlite" => connect_sqlite(url).await,
                #[allow(unreachable_patterns)]
                "postgres" | "postgresql" | "mysql" | "mariadb" | "sqlite" => Err(LockError::Config(
                    format!("dblock was built without the `{}` feature", feature_for(scheme)),
                )),
                _ => Err(LockError::Config(format!(
                    "unsupported database URL scheme `{scheme}:` (expected postgres://, mysql:// or sqlite:)"
                ))),
            }
        }
        .instrument(span)
        .await
    }

    /// Locks in an existing PostgreSQL pool. Lock statements run as single autocommit
    /// statements on it; for the best behaviour give it `test_before_acquire(false)` and
    /// `default_transaction_isolation=read committed` (as [`Locker::connect`] does).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = sqlx::PgPool::connect("postgres://localhost/app").await?;
    /// let locker = dblock::Locker::postgres(pool);
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub fn postgres(pool: sqlx::PgPool) -> Locker {
        Self::from_backend(
            |t| Backend::Postgres(backend::postgres::Pg::new(pool.clone(), t)),
            DEFAULT_TABLE,
        )
    }

    /// Locks in an existing MySQL / MariaDB pool (see [`Locker::postgres`] for advice on its
    /// settings; on Galera also set `wsrep_retry_autocommit=0`, which [`Locker::connect`] does).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = sqlx::MySqlPool::connect("mysql://root@localhost/app").await?;
    /// let locker = dblock::Locker::mysql(pool);
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "mysql")]
    #[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
    pub fn mysql(pool: sqlx::MySqlPool) -> Locker {
        Self::from_backend(
            |t| Backend::MySql(backend::mysql::My::new(pool.clone(), t)),
            DEFAULT_TABLE,
        )
    }

    /// Locks in an existing SQLite pool (use WAL and a busy timeout, as [`Locker::connect`] does).
    ///
    /// ```
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
    /// let locker = dblock::Locker::sqlite(pool);
    /// locker.migrate().await?;
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    #[cfg(feature = "sqlite")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    pub fn sqlite(pool: sqlx::SqlitePool) -> Locker {
        Self::from_backend(
            |t| Backend::Sqlite(backend::sqlite::Lite::new(pool.clone(), t)),
            DEFAULT_TABLE,
        )
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
        let backend = validate_table(name).and_then(|()| {
            let current = self.inner.backend.as_ref().map_err(Clone::clone)?;
            Ok(match current {
                #[cfg(feature = "postgres")]
                Backend::Postgres(b) => {
                    Backend::Postgres(backend::postgres::Pg::new(b.pool.clone(), name))
                }
                #[cfg(feature = "mysql")]
                Backend::MySql(b) => Backend::MySql(backend::mysql::My::new(b.pool.clone(), name)),
                #[cfg(feature = "sqlite")]
                Backend::Sqlite(b) => {
                    Backend::Sqlite(backend::sqlite::Lite::new(b.pool.clone(), name))
                }
            })
        });
        Locker::with(backend, name, self.inner.holder.clone())
    }

    /// PostgreSQL: the LISTEN/NOTIFY channel releases of this table are announced on.
    #[doc(hidden)]
    pub fn __notify_channel(&self) -> Option<String> {
        match self.backend() {
            #[cfg(feature = "postgres")]
            Ok(Backend::Postgres(pg)) => Some(pg.channel.to_string()),
            _ => None,
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
        &self.inner.table
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
        self.inner.backend.as_ref().map_or("invalid", Backend::name)
    }

    /// Serialises one owner's acquire and release statements on one key (in this process, which
    /// is where all of an owner's holds live). While an operation retries after a lost reply,
    /// no other operation of the same owner on the key can change the row, so the repeat's
    /// "did my earlier attempt commit?" check (attempt / release id in the row) is exact.
    pub(crate) async fn serialise(
        &self,
        owner: &str,
        key: &str,
    ) -> tokio::sync::OwnedMutexGuard<()> {
        let mutex = {
            let mut map = self
                .inner
                .serial
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if map.len() > 1024 {
                map.retain(|_, m| m.strong_count() > 0);
            }
            let slot = std::hash::BuildHasher::hash_one(&SERIAL_HASHER, (owner, key));
            match map.get(&slot).and_then(Weak::upgrade) {
                Some(m) => m,
                None => {
                    let m = Arc::new(tokio::sync::Mutex::new(()));
                    map.insert(slot, Arc::downgrade(&m));
                    m
                }
            }
        };
        mutex.lock_owned().await
    }

    pub(crate) fn renewer(&self) -> &Arc<Renewer> {
        &self.inner.renewer
    }

    pub(crate) fn backend(&self) -> Result<&Backend, LockError> {
        self.inner
            .backend
            .as_ref()
            .map_err(|e| LockError::Config(e.clone()))
    }

    /// The SQL text of the lock statements (acquire, release, extend), for the benchmark's
    /// raw-sqlx ceiling. Not part of the API.
    #[doc(hidden)]
    pub fn __statements(&self) -> Vec<(&'static str, String)> {
        self.backend().map(Backend::statements).unwrap_or_default()
    }

    /// The same locker without LISTEN/NOTIFY wake-ups (waiters only poll). For the benchmark.
    #[doc(hidden)]
    pub fn __polling_only(&self) -> Locker {
        Locker {
            inner: Arc::new(Inner {
                backend: self.inner.backend.clone(),
                renewer: Arc::default(),
                #[cfg(feature = "postgres")]
                notifier: None,
                serial: std::sync::Mutex::default(),
                table: self.inner.table.clone(),
                holder: self.inner.holder.clone(),
            }),
        }
    }

    /// Uses the MySQL 8 statements (no `RETURNING`) even on MariaDB. For tests of that path.
    #[doc(hidden)]
    pub fn __without_returning(&self) -> Locker {
        #[cfg(feature = "mysql")]
        if let Ok(Backend::MySql(b)) = &self.inner.backend {
            return Locker::with(
                Ok(Backend::MySql(b.clone().without_returning())),
                &self.inner.table,
                self.inner.holder.clone(),
            );
        }
        self.clone()
    }

    /// Creates the lock table if it does not exist. Idempotent and safe to run from many
    /// processes at once; it never touches sqlx's `_sqlx_migrations`. The same DDL is in
    /// `migrations/<backend>/0001_dblock_locks.sql` for teams that run their own migrations.
    ///
    /// ```
    /// # async fn demo() -> Result<(), dblock::LockError> {
    /// let locker = dblock::Locker::connect("sqlite::memory:").await?;
    /// locker.migrate().await?;
    /// locker.migrate().await?; // no-op
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub async fn migrate(&self) -> Result<(), LockError> {
        LockError::require_runtime()?;
        let backend = self.backend()?;
        let span = tracing::debug_span!("dblock.migrate", backend = backend.name(), table = %self.inner.table);
        backend.migrate().instrument(span).await.map_err(|e| {
            tracing::warn!(error = %e, "migration failed");
            e.into()
        })
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
        LockRequest {
            locker: self.clone(),
            key: key.into(),
            ttl: DEFAULT_TTL,
            wait: Duration::ZERO,
            owner: None,
            holder: None,
        }
    }

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
    pub async fn inspect(&self, key: &str) -> Result<Option<LockInfo>, LockError> {
        LockError::require_runtime()?;
        validate_key(key)?;
        let backend = self.backend()?;
        retrying(|| backend.inspect(key)).await
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
        LockError::require_runtime()?;
        let backend = self.backend()?;
        retrying(|| backend.held()).await
    }

    /// Frees `key` whoever holds it (operator action). Returns `true` if a live lock was freed.
    /// The old holder's release and extend then fail with [`LockError::NotHeld`]; the fencing
    /// token is kept, so the next owner still gets a larger one.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let stuck = locker.lock("k").await?;
    /// assert!(locker.force_release("k").await?);
    /// assert!(stuck.release().await.is_err()); // NotHeld
    /// # Ok(()) }
    /// ```
    pub async fn force_release(&self, key: &str) -> Result<bool, LockError> {
        LockError::require_runtime()?;
        validate_key(key)?;
        let backend = self.backend()?;
        let freed = retrying(|| backend.force_release(key)).await?;
        tracing::info!(key, freed, "force_release");
        Ok(freed)
    }

    /// Deletes rows that have been free (or expired) for longer than `older_than`;
    /// `Duration::ZERO` deletes every row that is not held. Returns how many were deleted.
    /// Fencing tokens of purged keys still never go backwards (new rows are seeded from the
    /// database clock in microseconds).
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let deleted = locker.purge(std::time::Duration::from_secs(24 * 3600)).await?;
    /// # Ok(()) }
    /// ```
    pub async fn purge(&self, older_than: Duration) -> Result<u64, LockError> {
        LockError::require_runtime()?;
        let us = i64::try_from(older_than.as_micros())
            .map_err(|_| LockError::Config("purge: older_than is too large".into()))?;
        let backend = self.backend()?;
        let n = retrying(|| backend.purge(us)).await?;
        tracing::info!(deleted = n, ?older_than, "purge");
        Ok(n)
    }

    /// Takes the lock: the loop behind `LockRequest::await`.
    async fn acquire(self, req: Request) -> Result<LockGuard, LockError> {
        LockError::require_runtime()?;
        validate_key(&req.key)?;
        let ttl_us = ttl_micros(req.ttl)?;
        self.backend()?;
        let holder = match &req.holder {
            Some(label) => truncate(format!("{}/{label}", self.inner.holder)),
            None => self.inner.holder.clone(),
        };
        let holder: Arc<str> = holder.into();
        let attempt = fastrand::i64(1..i64::MAX);

        let started = Instant::now();
        // `wait(Duration::MAX)` means "as long as it takes", not an overflow.
        let deadline = started
            .checked_add(req.wait)
            .unwrap_or_else(|| started + Duration::from_secs(100 * 365 * 24 * 3600));
        let mut backoff = FIRST_BACKOFF;
        let mut attempts = 0u32;
        // Set once this call waits on PostgreSQL: a release of the key wakes it at once.
        #[cfg(feature = "postgres")]
        let mut interest: Option<crate::notify::Interest> = None;
        loop {
            attempts += 1;
            #[cfg(feature = "postgres")]
            let waiting = interest.is_some();
            #[cfg(not(feature = "postgres"))]
            let waiting = false;
            match self.try_once(&req, ttl_us, &holder, attempt, waiting).await {
                Ok(Try::Got(guard)) => {
                    tracing::debug!(
                        fencing_token = guard.fencing_token(),
                        hold_count = guard.hold_count(),
                        attempts,
                        "acquired"
                    );
                    return Ok(guard);
                }
                Ok(Try::Busy(retry_after)) => {
                    let now = Instant::now();
                    if now >= deadline {
                        let waited = now - started;
                        tracing::debug!(?waited, attempts, "busy: giving up");
                        return Err(LockError::Busy {
                            key: req.key,
                            waited,
                        });
                    }
                    // Jitter over the upper half of the step, so waiters spread out instead of
                    // arriving together; never past the holder's lease end or our deadline.
                    #[cfg(feature = "postgres")]
                    if interest.is_none() {
                        if let Some(notifier) = &self.inner.notifier {
                            interest = notifier.interest(&req.key).await;
                            if interest.is_some() {
                                continue; // ask again, now asking the holder to notify
                            }
                        }
                    }
                    let jittered = backoff / 2 + backoff.mul_f64(fastrand::f64() / 2.0);
                    let mut pause = jittered.min(deadline - now);
                    if let Some(left) = retry_after {
                        pause = pause.min(left + Duration::from_millis(1));
                    }
                    tracing::trace!(?pause, "busy: waiting");
                    #[cfg(feature = "postgres")]
                    let woken = interest.as_ref().map(|i| i.notify.notified());
                    #[cfg(not(feature = "postgres"))]
                    let woken: Option<std::future::Pending<()>> = None;
                    match woken {
                        // Polling stays the fallback: a lost notification costs one pause.
                        Some(woken) => {
                            tokio::select! {
                                () = woken => tracing::trace!("woken by release"),
                                () = tokio::time::sleep(pause) => {}
                            }
                        }
                        None => tokio::time::sleep(pause).await,
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "acquire failed");
                    return Err(e);
                }
            }
        }
    }

    /// One acquire attempt, run to completion in a task of its own.
    ///
    /// If the caller's future is dropped while the statement is in flight, the statement still
    /// finishes (it is not left half-sent on a pooled connection, to run whenever that connection
    /// is next used), and a lock it took comes back as a guard nobody receives: dropping it
    /// releases it at once. So a cancelled `lock()` never orphans a hold.
    async fn try_once(
        &self,
        req: &Request,
        ttl_us: i64,
        holder: &Arc<str>,
        attempt: i64,
        waiting: bool,
    ) -> Result<Try, LockError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (locker, req, holder) = (self.clone(), req.clone(), holder.clone());
        tokio::spawn(
            async move {
                let outcome = locker
                    .send_acquire(&req, ttl_us, &holder, attempt, waiting)
                    .await;
                // If the receiver is gone, the guard inside is dropped here: released.
                let _ = tx.send(outcome);
            }
            .in_current_span(),
        );
        rx.await
            .unwrap_or_else(|_| Err(LockError::Database(sqlx::Error::WorkerCrashed)))
    }

    async fn send_acquire(
        self,
        req: &Request,
        ttl_us: i64,
        holder: &str,
        attempt: i64,
        waiting: bool,
    ) -> Result<Try, LockError> {
        let backend = self.backend()?;
        let params = AcquireParams {
            key: &req.key,
            owner: req.owner.id(),
            ttl_us,
            holder,
            attempt,
            waiting,
        };
        let serial = self.serialise(req.owner.id(), &req.key).await;
        let sent = tokio::time::Instant::now();
        let outcome = send_acquire(backend, &params).await;
        drop(serial);
        Ok(match outcome? {
            Attempt::Acquired(Grant {
                hold_count,
                fencing_token,
                expires_at_us,
            }) => {
                let hold = Hold {
                    locker: self.clone(),
                    key: req.key.clone(),
                    owner: req.owner.clone(),
                    fencing_token,
                    level: hold_count,
                };
                Try::Got(LockGuard::new(
                    hold,
                    hold_count,
                    expires_at_us,
                    sent,
                    req.ttl,
                ))
            }
            Attempt::Busy { retry_after } => Try::Busy(retry_after),
        })
    }
}

/// The outcome of one attempt, with the lock already inside a guard.
enum Try {
    Got(LockGuard),
    Busy(Option<Duration>),
}

/// Runs a statement that may safely be sent again (a read, or a write whose repeat changes
/// nothing more), stepping over rolled-back statements and broken pooled connections.
async fn retrying<T, F, Fut>(mut op: F) -> Result<T, LockError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, sqlx::Error>>,
{
    let mut tries = 0;
    loop {
        match op().await {
            Ok(v) => return Ok(v),
            Err(e)
                if tries < MAX_RECONNECTS && backend::classify(&e) != backend::Failure::Fatal =>
            {
                tries += 1;
                tracing::debug!(error = %e, "statement failed; sending it again");
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Sends one acquire statement, sending it again when the server rolled it back and once after
/// a broken connection (same attempt id, so an earlier success is recognised, not counted twice).
async fn send_acquire(
    backend: &Backend,
    params: &AcquireParams<'_>,
) -> Result<Attempt, sqlx::Error> {
    let mut rolled_back = 0;
    let mut reconnected = 0;
    loop {
        match backend.acquire(params).await {
            Ok(outcome) => return Ok(outcome),
            Err(e) => match backend::classify(&e) {
                backend::Failure::NotCommitted if rolled_back < MAX_ROLLBACK_RETRIES => {
                    rolled_back += 1;
                    tracing::debug!(error = %e, "acquire rolled back by the server; retrying");
                    tokio::time::sleep(Duration::from_micros(fastrand::u64(100..2000))).await;
                }
                backend::Failure::Unknown if reconnected < MAX_RECONNECTS => {
                    reconnected += 1;
                    tracing::debug!(error = %e, "connection lost during acquire; retrying the same attempt");
                }
                _ => return Err(e),
            },
        }
    }
}

/// The resolved parameters of one `lock()` call.
#[derive(Clone)]
struct Request {
    key: String,
    ttl: Duration,
    wait: Duration,
    owner: Owner,
    holder: Option<String>,
}

/// One `locker.lock(key)` call being configured; `.await` it to take the lock.
///
/// ```
/// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
/// use std::time::Duration;
/// let guard = locker
///     .lock("nightly-report")
///     .ttl(Duration::from_secs(120))  // lease length (default 30 s)
///     .wait(Duration::from_secs(10))  // keep trying this long (default: one attempt)
///     .holder("report-job")           // shown to operators next to host and pid
///     .await?;
/// # Ok(()) }
/// ```
#[must_use = "a lock request does nothing until it is awaited"]
pub struct LockRequest {
    locker: Locker,
    key: String,
    ttl: Duration,
    wait: Duration,
    owner: Option<Owner>,
    holder: Option<String>,
}

impl LockRequest {
    /// Lease length; the lock is free for others once it runs out unless extended. Must be
    /// greater than zero. Default 30 s.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guard = locker.lock("k").ttl(std::time::Duration::from_millis(500)).await?;
    /// # Ok(()) }
    /// ```
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long to keep trying while someone else holds the key; zero (the default) means one
    /// attempt. Attempts back off exponentially with jitter and never sleep past the deadline.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// match locker.lock("k").wait(std::time::Duration::from_secs(1)).await {
    ///     Err(dblock::LockError::Busy { waited, .. }) => println!("gave up after {waited:?}"),
    ///     other => { other?; }
    /// }
    /// # Ok(()) }
    /// ```
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Acquires as this owner instead of the scope's (or a fresh) one.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let me = dblock::Owner::new();
    /// let a = locker.lock("k").owner(&me).await?;
    /// let b = locker.lock("k").owner(&me).await?;
    /// assert_eq!(b.hold_count(), 2);
    /// # Ok(()) }
    /// ```
    pub fn owner(mut self, owner: &Owner) -> Self {
        self.owner = Some(owner.clone());
        self
    }

    /// A label stored in the `holder` column after `host/pid`, for operators.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guard = locker.lock("k").holder("billing::settle").await?;
    /// # Ok(()) }
    /// ```
    pub fn holder(mut self, label: impl Into<String>) -> Self {
        self.holder = Some(label.into());
        self
    }
}

impl IntoFuture for LockRequest {
    type Output = Result<LockGuard, LockError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 'static>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move {
            // Resolved when first polled, in the awaiting task: the scope's owner if any.
            let owner = self
                .owner
                .or_else(|| Context::get().map(|c| c.owner))
                .unwrap_or_default();
            let span = tracing::debug_span!(
                "dblock.lock",
                key = %self.key,
                backend = self.locker.backend_name(),
                owner = %owner,
                ttl_ms = self.ttl.as_millis() as u64,
                wait_ms = self.wait.as_millis() as u64,
            );
            let req = Request {
                key: self.key,
                ttl: self.ttl,
                wait: self.wait,
                owner,
                holder: self.holder,
            };
            self.locker.acquire(req).instrument(span).await
        })
    }
}

const DEFAULT_TABLE: &str = "dblock_locks";

/// Refuses keys the lock table cannot hold exactly.
pub(crate) fn validate_key(key: &str) -> Result<(), LockError> {
    if key.is_empty() {
        return Err(LockError::invalid_key(key, "the key is empty"));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(LockError::invalid_key(
            key,
            "the key is longer than 255 bytes",
        ));
    }
    if key.contains('\0') {
        return Err(LockError::invalid_key(key, "the key contains a NUL byte"));
    }
    Ok(())
}

/// A lease length in microseconds, refused when zero or absurdly long.
pub(crate) fn ttl_micros(ttl: Duration) -> Result<i64, LockError> {
    if ttl.is_zero() {
        return Err(LockError::Config("ttl must be greater than zero".into()));
    }
    if ttl > MAX_TTL {
        return Err(LockError::Config(format!(
            "ttl {ttl:?} is longer than 100 years"
        )));
    }
    // Sub-microsecond leases round up to one microsecond rather than to an already-ended lease.
    Ok((ttl.as_micros() as i64).max(1))
}

fn validate_table(name: &str) -> Result<(), String> {
    let parts: Vec<&str> = name.split('.').collect();
    let ok = parts.len() <= 2
        && parts.iter().all(|p| {
            let mut chars = p.chars();
            p.len() <= 63
                && chars
                    .next()
                    .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "invalid table name {name:?}: expected an identifier such as `dblock_locks` or `schema.locks`"
        ))
    }
}

fn truncate(mut s: String) -> String {
    if let Some((at, _)) = s.char_indices().nth(255) {
        s.truncate(at);
    }
    s
}

/// `host/pid`, for the `holder` column.
fn default_holder() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".into());
    truncate(format!("{host}/{}", std::process::id()))
}

fn feature_for(scheme: &str) -> &'static str {
    match scheme {
        "postgres" | "postgresql" => "postgres",
        "mysql" | "mariadb" => "mysql",
        _ => "sqlite",
    }
}

/// Shows a URL without its password, for error messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let userinfo = &url[s + 3..at];
            match userinfo.find(':') {
                Some(colon) => format!("{}{}:***{}", &url[..s + 3], &userinfo[..colon], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

fn bad_url(url: &str, e: sqlx::Error) -> LockError {
    LockError::Config(format!("cannot parse database URL {}: {e}", redact(url)))
}

#[cfg(feature = "postgres")]
async fn connect_postgres(url: &str) -> Result<Locker, LockError> {
    use std::str::FromStr;
    let options = sqlx::postgres::PgConnectOptions::from_str(url)
        .map_err(|e| bad_url(url, e))?
        // READ COMMITTED on every lock connection, with no extra round trip (sent at startup).
        .options([("default_transaction_isolation", "read committed")]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(10)
        .test_before_acquire(false)
        .acquire_timeout(CONNECT_TIMEOUT)
        .connect_with(options)
        .await?;
    Ok(Locker::postgres(pool))
}

#[cfg(feature = "mysql")]
async fn connect_mysql(url: &str) -> Result<Locker, LockError> {
    use std::str::FromStr;
    let url = url.replacen("mariadb://", "mysql://", 1);
    let options = sqlx::mysql::MySqlConnectOptions::from_str(&url).map_err(|e| bad_url(&url, e))?;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(10)
        .test_before_acquire(false)
        .acquire_timeout(CONNECT_TIMEOUT)
        .after_connect(|conn, _meta| {
            Box::pin(async move {
                use sqlx::Executor as _;
                conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                    .await?;
                // Galera: no automatic autocommit retry (it can answer one RETURNING statement
                // with two rows, the first stale), and causal reads for read-only paths.
                // Servers without wsrep (MySQL) do not know these variables: error 1193, fine.
                match conn
                    .execute("SET SESSION wsrep_retry_autocommit = 0, wsrep_sync_wait = 1")
                    .await
                {
                    Err(sqlx::Error::Database(e))
                        if e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                            .is_some_and(|e| e.number() == 1193) =>
                    {
                        Ok(())
                    }
                    other => other.map(|_| ()),
                }
            })
        })
        .connect_with(options)
        .await?;
    Ok(Locker::mysql(pool))
}

#[cfg(feature = "sqlite")]
async fn connect_sqlite(url: &str) -> Result<Locker, LockError> {
    use sqlx::sqlite::{
        SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous,
    };
    use std::str::FromStr;
    let options = SqliteConnectOptions::from_str(url)
        .map_err(|e| bad_url(url, e))?
        .journal_mode(SqliteJournalMode::Wal)
        // FULL: a granted lock (and its fencing token) survives a power cut.
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(Duration::from_secs(10));
    let in_memory = url.contains(":memory:") || url.contains("mode=memory");
    let mut pool = SqlitePoolOptions::new()
        .max_connections(if in_memory { 1 } else { 8 })
        .test_before_acquire(false)
        .acquire_timeout(Duration::from_secs(10));
    if in_memory {
        // An in-memory database lives only as long as a connection to it: keep one forever.
        pool = pool
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None);
    }
    Ok(Locker::sqlite(pool.connect_with(options).await?))
}

/// Fixed keys, so every locker of the process hashes alike (only in-process maps use it).
static SERIAL_HASHER: std::hash::BuildHasherDefault<std::collections::hash_map::DefaultHasher> =
    std::hash::BuildHasherDefault::new();

/// The process-wide default locker, used by `#[distributed_lock]` without `locker = ...`.
static DEFAULT: RwLock<Option<Locker>> = RwLock::new(None);

/// Sets the process-wide default locker (replacing any earlier one).
///
/// ```
/// # async fn demo() -> Result<(), dblock::LockError> {
/// let locker = dblock::Locker::connect("sqlite::memory:").await?;
/// dblock::set_default(locker);
/// assert!(dblock::default_locker().is_ok());
/// # Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
/// ```
pub fn set_default(locker: Locker) {
    let mut slot = DEFAULT
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    *slot = Some(locker);
}

/// The locker given to [`set_default`], or [`LockError::NoLocker`].
///
/// ```
/// // before any set_default:
/// # if false {
/// assert!(matches!(dblock::default_locker(), Err(dblock::LockError::NoLocker)));
/// # }
/// ```
pub fn default_locker() -> Result<Locker, LockError> {
    DEFAULT
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone()
        .ok_or(LockError::NoLocker)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked_for_length_and_emptiness() {
        assert!(validate_key("a").is_ok());
        assert!(validate_key(&"x".repeat(255)).is_ok());
        assert!(matches!(
            validate_key(""),
            Err(LockError::InvalidKey { .. })
        ));
        assert!(matches!(
            validate_key(&"x".repeat(256)),
            Err(LockError::InvalidKey { .. })
        ));
        // 128 two-byte characters = 256 bytes: counted in bytes, not characters.
        assert!(validate_key(&"é".repeat(128)).is_err());
        assert!(validate_key("a\0b").is_err());
        assert!(validate_key("'; DROP TABLE dblock_locks; --").is_ok());
    }

    #[test]
    fn table_names_are_identifiers() {
        assert!(validate_table("dblock_locks").is_ok());
        assert!(validate_table("app.locks").is_ok());
        assert!(validate_table("_x1").is_ok());
        for bad in [
            "",
            "1abc",
            "a-b",
            "a.b.c",
            "x; DROP TABLE y",
            "a b",
            "\"q\"",
            &"a".repeat(64),
        ] {
            assert!(validate_table(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn ttl_must_be_positive_and_sane() {
        assert!(ttl_micros(Duration::ZERO).is_err());
        assert!(ttl_micros(Duration::from_secs(u64::MAX)).is_err());
        assert_eq!(ttl_micros(Duration::from_millis(1500)).unwrap(), 1_500_000);
    }

    #[test]
    fn passwords_never_reach_messages() {
        assert_eq!(redact("postgres://u:secret@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact("mysql://root@h/db"), "mysql://root@h/db");
        assert_eq!(redact("sqlite://x.db"), "sqlite://x.db");
    }
}
