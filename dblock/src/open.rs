//! How a [`Locker`] is made: from a URL, or on a pool of the application's own.

use tracing::Instrument;

use crate::backend::Backend;
use crate::connect::ConnectOptions;
use crate::error::LockError;
use crate::locker::{Locker, DEFAULT_TABLE};
use crate::shared::{default_holder, Shared};

impl Locker {
    pub(crate) fn from_backend(backend: Backend) -> Locker {
        Locker::from_shared(Shared::new(Ok(backend), DEFAULT_TABLE, default_holder()))
    }

    /// Connects to `url` and builds a pool configured for locking: autocommit connections at
    /// READ COMMITTED, no ping before each statement, a 3 s limit on waiting for a connection, a
    /// 5 s limit on each statement (see [`ConnectOptions`] for these and
    /// [`connect_with`](Locker::connect_with) to change them).
    ///
    /// | URL | backend | feature |
    /// |---|---|---|
    /// | `sqlite://path/locks.db?mode=rwc`, `sqlite::memory:` | SQLite (WAL; busy timeout: the statement time-out, 5 s by default) | `sqlite` (default) |
    /// | `postgres://user@host/db` | PostgreSQL | `postgres` |
    /// | `mysql://user@host/db` | MySQL 8, MariaDB ≥ 10.5 (also Galera) | `mysql` |
    ///
    #[cfg_attr(feature = "sqlite", doc = "```")]
    #[cfg_attr(not(feature = "sqlite"), doc = "```no_run")]
    /// # async fn demo() -> Result<(), dblock::LockError> {
    /// let locker = dblock::Locker::connect("sqlite::memory:").await?;
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub async fn connect(url: &str) -> Result<Locker, LockError> {
        Self::connect_with(url, ConnectOptions::default()).await
    }

    /// [`connect`](Locker::connect) with a pool and time-outs of your choosing.
    ///
    #[cfg_attr(feature = "sqlite", doc = "```")]
    #[cfg_attr(not(feature = "sqlite"), doc = "```no_run")]
    /// # async fn demo() -> Result<(), dblock::LockError> {
    /// use std::time::Duration;
    /// let options = dblock::ConnectOptions::new()
    ///     .max_connections(20)
    ///     .statement_timeout(Duration::from_secs(2));
    /// let locker = dblock::Locker::connect_with("sqlite::memory:", options).await?;
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub async fn connect_with(url: &str, options: ConnectOptions) -> Result<Locker, LockError> {
        LockError::require_runtime()?;
        options.check().map_err(LockError::Config)?;
        let scheme = crate::redact::scheme(url).unwrap_or("(none)");
        let span = tracing::debug_span!("dblock.connect", scheme);
        let backend = Backend::connect(url, DEFAULT_TABLE, &options)
            .instrument(span)
            .await?;
        Ok(Self::with_options(Ok(backend), &options))
    }

    /// Locks in an existing PostgreSQL pool. Lock statements run as single autocommit
    /// statements on it, each borrowing a connection only for itself; the LISTEN that wakes
    /// waiters opens a connection of its own (with the pool's connect options), never one of
    /// the pool's. For the best behaviour give the pool `test_before_acquire(false)` and
    /// `default_transaction_isolation=read committed` (as [`Locker::connect`] does). Statements
    /// are bounded by the default statement time-out (5 s) in the client.
    ///
    /// The pool's sessions keep their own planner settings ([`Locker::connect`]'s sessions turn
    /// sequential scans off): on a server with autovacuum off, `ANALYZE` the lock table once it
    /// has grown from empty, or the plans PostgreSQL cached for the statements that lock many
    /// keys at once may keep scanning the whole table.
    ///
    /// A pool behind a transaction pooler (PgBouncer in transaction mode) is found out before
    /// the first statement: two connections of the locker's own (with the pool's connect
    /// options, not the pool's connections) look whether server sessions are shared between
    /// clients. If they are, statements go as simple queries with their settings inlined (as
    /// with `pooler(true)`) and LISTEN is never sent through the pool (waiters poll), so a pool
    /// that reaches a pooler cannot disturb the pooler's other clients; this is said once at
    /// `info`. Should a prepared statement still meet another client's server connection
    /// ("prepared statement … does not exist"), the locker switches to pooler mode then and
    /// sends it again. [`Locker::postgres_with`] with `pooler(true)` or `pooler(false)` skips
    /// the look.
    ///
    /// After a failover, a pooled connection that still reaches the old primary (now a
    /// standby, `read_only_sql_transaction`) is closed and the statement sent again on a new
    /// connection, within the call's `wait`.
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
        Self::from_backend(crate::backend::postgres::Pg::new(pool.into(), DEFAULT_TABLE).into())
    }

    /// [`Locker::postgres`] with options: those of [`ConnectOptions`] that are not about
    /// building a pool apply — [`pooler`](ConnectOptions::pooler),
    /// [`listen`](ConnectOptions::listen), [`listen_url`](ConnectOptions::listen_url),
    /// [`durable_release`](ConnectOptions::durable_release) and
    /// [`statement_timeout`](ConnectOptions::statement_timeout) (in the client; behind a pooler
    /// also on the server, with each statement). `max_connections` and `acquire_timeout` are
    /// your pool's own business. A `listen_url` that does not parse makes every call fail with
    /// [`LockError::Config`].
    ///
    /// Behind PgBouncer in transaction mode: `pooler(true)`, and a pool whose connections send
    /// no start-up parameter PgBouncer refuses (sqlx's `extra_float_digits` is one, unless
    /// PgBouncer lists it in `ignore_startup_parameters`; so is `options`).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::str::FromStr;
    /// use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    ///
    /// let through_pgbouncer = PgConnectOptions::from_str("postgres://app@pgbouncer:6432/app")?
    ///     .extra_float_digits(None);
    /// let pool = PgPoolOptions::new().connect_with(through_pgbouncer).await?;
    /// let options = dblock::ConnectOptions::new()
    ///     .pooler(true)
    ///     .listen_url("postgres://app@db.internal:5432/app"); // optional: LISTEN past PgBouncer
    /// let locker = dblock::Locker::postgres_with(pool, options);
    /// locker.migrate().await?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub fn postgres_with(pool: sqlx::PgPool, options: ConnectOptions) -> Locker {
        let backend = options.check().and_then(|()| {
            crate::backend::postgres::Pg::configured(pool.into(), DEFAULT_TABLE, &options)
                .map(Backend::from)
                .map_err(|e| match e {
                    LockError::Config(msg) => msg,
                    other => other.to_string(),
                })
        });
        Self::with_options(backend, &options)
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
        Self::from_backend(crate::backend::mysql::My::new(pool.into(), DEFAULT_TABLE).into())
    }

    /// [`Locker::mysql`] with options: those of [`ConnectOptions`] that are not about building
    /// a pool or PostgreSQL's apply — [`coalesce`](ConnectOptions::coalesce),
    /// [`lock_delay`](ConnectOptions::lock_delay) (the locker's default) and
    /// [`statement_timeout`](ConnectOptions::statement_timeout) (in the client).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = sqlx::MySqlPool::connect("mysql://root@localhost/app").await?;
    /// let options = dblock::ConnectOptions::new().coalesce(false);
    /// let locker = dblock::Locker::mysql_with(pool, options);
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "mysql")]
    #[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
    pub fn mysql_with(pool: sqlx::MySqlPool, options: ConnectOptions) -> Locker {
        let backend = crate::backend::mysql::My::new(pool.into(), DEFAULT_TABLE).into();
        Self::with_options(options.check().map(|()| backend), &options)
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
        Self::from_backend(crate::backend::sqlite::Lite::new(pool.into(), DEFAULT_TABLE).into())
    }

    /// [`Locker::sqlite`] with options: those of [`ConnectOptions`] that are not about building
    /// a pool or PostgreSQL's apply — [`coalesce`](ConnectOptions::coalesce),
    /// [`lock_delay`](ConnectOptions::lock_delay) (the locker's default) and
    /// [`statement_timeout`](ConnectOptions::statement_timeout) (in the client).
    ///
    /// ```
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
    /// let options = dblock::ConnectOptions::new().lock_delay(std::time::Duration::from_secs(5));
    /// let locker = dblock::Locker::sqlite_with(pool, options);
    /// locker.migrate().await?;
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    #[cfg(feature = "sqlite")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    pub fn sqlite_with(pool: sqlx::SqlitePool, options: ConnectOptions) -> Locker {
        let backend = crate::backend::sqlite::Lite::new(pool.into(), DEFAULT_TABLE).into();
        Self::with_options(options.check().map(|()| backend), &options)
    }

    /// A locker on `backend` with `options` (`Err`: the options' or the backend's
    /// configuration error, which every call on the locker then reports).
    fn with_options(backend: Result<Backend, String>, options: &ConnectOptions) -> Locker {
        Locker::from_shared(Shared::with_options(
            backend,
            DEFAULT_TABLE,
            default_holder(),
            options,
        ))
    }
}
