//! [`ConnectOptions`]: the pool and time-outs of a locker that [`Locker::connect_with`] builds.
//!
//! [`Locker::connect_with`]: crate::Locker::connect_with

use std::time::Duration;

/// How [`Locker::connect_with`](crate::Locker::connect_with) sets up its own pool, and how long
/// one statement may take. [`Locker::connect`](crate::Locker::connect) uses the defaults.
///
/// | option | default | what it bounds |
/// |---|---|---|
/// | [`max_connections`](Self::max_connections) | 10 (SQLite file 8, SQLite memory 1) | the pool's size |
/// | [`acquire_timeout`](Self::acquire_timeout) | 3 s (SQLite 10 s) | waiting for a pooled connection; a lock call's own `wait` bounds it further |
/// | [`statement_timeout`](Self::statement_timeout) | 5 s | one statement: on the server (PostgreSQL `statement_timeout` and `lock_timeout`, MariaDB `max_statement_time` and `innodb_lock_wait_timeout`) and in the client, which closes a connection whose reply does not come in time |
/// | [`listen`](Self::listen) | `true` | PostgreSQL: one connection of the locker's own LISTENs for releases, so waiters wake at once |
/// | [`durable_release`](Self::durable_release) | `false` | PostgreSQL and SQLite: whether a release waits for its own disk flush (see there) |
/// | [`pooler`](Self::pooler) | found out | PostgreSQL: the URL is a transaction pooler such as PgBouncer (no prepared statements, no session settings, no LISTEN through it); `Locker::connect` finds out by itself, this forces either way |
/// | [`coalesce`](Self::coalesce) | `true` | concurrent acquires, releases and extends on distinct keys share one statement and round trip |
/// | [`lock_delay`](Self::lock_delay) | zero | how long a key stays unavailable after a lease that ends without a release (a request's own `.lock_delay(d)` wins) |
/// | [`listen_url`](Self::listen_url) | none | PostgreSQL: a URL of its own for the LISTEN connection, e.g. straight to the server past the pooler |
/// | [`auto_purge`](Self::auto_purge) | off | deletes rows free for longer than the age given, in the background, in each table the locker takes holds in |
///
/// Whatever the options, a `lock()` call returns by its `wait` (an attempt that `wait` cannot
/// cover gets at most one second), a release or extend by the statement time-out, and no
/// statement keeps a lease looking alive past its ttl. PostgreSQL connections also ask the
/// server for TCP keepalives (idle 10 s, then every 5 s, 3 probes), so the server drops a
/// vanished client's connection instead of keeping it for hours.
///
#[cfg_attr(feature = "sqlite", doc = "```")]
#[cfg_attr(not(feature = "sqlite"), doc = "```no_run")]
/// # async fn demo() -> Result<(), dblock::LockError> {
/// use std::time::Duration;
/// let options = dblock::ConnectOptions::new()
///     .max_connections(4)
///     .acquire_timeout(Duration::from_secs(1))
///     .statement_timeout(Duration::from_secs(2));
/// let locker = dblock::Locker::connect_with("sqlite::memory:", options).await?;
/// # Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct ConnectOptions {
    pub(crate) max_connections: Option<u32>,
    pub(crate) acquire_timeout: Option<Duration>,
    pub(crate) statement_timeout: Duration,
    pub(crate) listen: bool,
    pub(crate) durable_release: bool,
    /// `None`: found out on the first connection (`Locker::connect`); `Some`: as the caller says.
    pub(crate) pooler: Option<bool>,
    pub(crate) listen_url: Option<String>,
    pub(crate) coalesce: bool,
    pub(crate) lock_delay: Duration,
    pub(crate) auto_purge: Option<Duration>,
}

/// Every setting, with `listen_url` shown without its password.
impl std::fmt::Debug for ConnectOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectOptions")
            .field("max_connections", &self.max_connections)
            .field("acquire_timeout", &self.acquire_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .field("listen", &self.listen)
            .field("durable_release", &self.durable_release)
            .field("pooler", &self.pooler)
            .field(
                "listen_url",
                &self.listen_url.as_deref().map(crate::redact::Redacted),
            )
            .field("coalesce", &self.coalesce)
            .field("lock_delay", &self.lock_delay)
            .field("auto_purge", &self.auto_purge)
            .finish()
    }
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            max_connections: None,
            acquire_timeout: None,
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
            listen: true,
            durable_release: false,
            pooler: None,
            listen_url: None,
            coalesce: true,
            lock_delay: Duration::ZERO,
            auto_purge: None,
        }
    }
}

/// One statement's limit unless set otherwise.
pub(crate) const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Longest [`ConnectOptions::statement_timeout`] and
/// [`ConnectOptions::acquire_timeout`]: 24 days, under PostgreSQL's own limit for
/// `statement_timeout` (2<sup>31</sup> − 1 ms, about 24.8 days), and so the same on every backend.
/// A longer one is refused at connect with [`LockError::Config`](crate::LockError::Config).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 24 * 3600);

impl ConnectOptions {
    /// The settings that cannot work, named: a time-out over [`MAX_TIMEOUT`].
    pub(crate) fn check(&self) -> Result<(), String> {
        let too_long = |what: &str, d: Duration| {
            (d > MAX_TIMEOUT).then(|| {
                format!("{what} {d:?} is longer than the longest dblock supports (24 days)")
            })
        };
        match too_long("statement_timeout", self.statement_timeout)
            .or_else(|| too_long("acquire_timeout", self.acquire_timeout.unwrap_or_default()))
        {
            Some(problem) => Err(problem),
            None => Ok(()),
        }
    }
}

impl ConnectOptions {
    /// The defaults (see the table above).
    ///
    /// ```
    /// let options = dblock::ConnectOptions::new();
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Most connections the locker's pool opens (at least 1). A connection whose statement
    /// answered in full is kept for the next statement rather than tested by the pool on its way
    /// back (a round trip each time); it goes back to the pool after 1 s idle or 30 s out of it.
    ///
    /// ```
    /// let options = dblock::ConnectOptions::new().max_connections(20);
    /// ```
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = Some(n.max(1));
        self
    }

    /// Longest wait for a pooled connection (a lock call's `wait` may cut it shorter).
    ///
    /// ```
    /// let options = dblock::ConnectOptions::new().acquire_timeout(std::time::Duration::from_secs(1));
    /// ```
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = Some(timeout);
        self
    }

    /// Longest time one statement may take, on the server and in the client (at least 10 ms).
    ///
    /// ```
    /// let options = dblock::ConnectOptions::new().statement_timeout(std::time::Duration::from_secs(2));
    /// ```
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout.max(Duration::from_millis(10));
        self
    }

    /// PostgreSQL: whether a connection of the locker's own LISTENs for releases (waiters then
    /// wake at once instead of at their next poll). Off, waiters only poll. Other backends
    /// ignore it.
    ///
    /// ```
    /// let options = dblock::ConnectOptions::new().listen(false);
    /// ```
    pub fn listen(mut self, on: bool) -> Self {
        self.listen = on;
        self
    }

    /// Whether a release waits for its own disk flush. By default (`false`) it does not, where
    /// the database allows that per statement or connection: PostgreSQL commits the release
    /// with `synchronous_commit = off` (set for that one statement's transaction), SQLite
    /// releases on connections of the locker's own at `synchronous = NORMAL` (WAL). A lock
    /// cycle then costs one disk flush (the grant's) instead of two. Grants and extensions are
    /// always durable; MySQL / MariaDB have no per-session durability and are unaffected.
    ///
    /// Why this is safe: a crash can lose only a release whose flush had not happened yet, and
    /// a lost release leaves the key held by its old owner until the lease ends, exactly as if
    /// that holder had died. It can never lose a grant or a fencing token: a grant is
    /// acknowledged only after its own flush, and that flush covers everything written before
    /// it in the log, including the release that freed the key. With synchronous replication
    /// the same holds for the standby: the grant waits for it, and the release is ahead of the
    /// grant in the stream. `true` keeps both commits durable (the release then survives a
    /// crash the moment it returns).
    ///
    /// ```
    /// let options = dblock::ConnectOptions::new().durable_release(true);
    /// ```
    pub fn durable_release(mut self, durable: bool) -> Self {
        self.durable_release = durable;
        self
    }

    /// PostgreSQL: the URL points at a connection pooler in **transaction** (or statement)
    /// pooling mode, such as PgBouncer with `pool_mode = transaction`, which hands every
    /// transaction to whichever server connection is free. Session pooling needs nothing.
    ///
    /// What changes (other backends ignore it):
    /// - **No prepared statements.** Each statement goes as one simple-protocol query, its values
    ///   written in as escaped, typed literals: still one round trip, and nothing is left on a
    ///   server connection that another client may get next. (Named prepared statements break
    ///   there at once; unnamed ones silently run another client's statement.) The server parses
    ///   and plans every statement anew, which costs some throughput (`docs/benchmarks.md`).
    /// - **No session settings.** The pool's connections send no `options` start-up parameter
    ///   (PgBouncer refuses it) and no `extra_float_digits`, so a stock PgBouncer accepts them.
    ///   READ COMMITTED, `statement_timeout` and `lock_timeout` come with each statement
    ///   instead (`SET LOCAL`, in the same query); TCP keepalives are the pooler's
    ///   (`tcp_keepalive`, `client_idle_timeout`).
    /// - **No LISTEN through the pooler** (a LISTEN would stay on one server connection):
    ///   waiters poll with backoff, unless [`listen_url`](Self::listen_url) gives a direct
    ///   connection for it.
    /// - `migrate()` runs as one implicit transaction, and `fence` sends its statement the
    ///   same way inside the caller's transaction.
    ///
    /// **Found out, not configured.** Without this option, [`Locker::connect`] finds out on
    /// its first connection: it connects with its session settings, and falls back to pooler
    /// mode (logged once at `info`, with the reason) when the server side refuses them (a stock
    /// PgBouncer: "unsupported startup parameter"), drops them silently (`options` in
    /// `ignore_startup_parameters`), or when session state set on one of its connections shows
    /// up on another (transaction pooling: server connections are shared). Session pooling
    /// and a direct server stay on the prepared path. `pooler(true)` skips the check;
    /// `pooler(false)` forces the direct path, and then a transaction pooler is a
    /// [`LockError::Config`](crate::LockError::Config) naming `pooler(true)` at connect.
    ///
    /// The same option works for a pool of your own: [`Locker::postgres_with`] (where nothing
    /// is found out: give `pooler(true)` for a pool behind a transaction pooler).
    ///
    /// [`Locker::postgres_with`]: crate::Locker::postgres_with
    /// [`Locker::connect`]: crate::Locker::connect
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), dblock::LockError> {
    /// let options = dblock::ConnectOptions::new()
    ///     .pooler(true)
    ///     // optional: wake waiters at once, through a connection straight to PostgreSQL
    ///     .listen_url("postgres://app@db.internal:5432/app");
    /// let locker = dblock::Locker::connect_with("postgres://app@pgbouncer:6432/app", options).await?;
    /// # Ok(()) }
    /// ```
    pub fn pooler(mut self, on: bool) -> Self {
        self.pooler = Some(on);
        self
    }

    /// PostgreSQL: the URL the LISTEN connection uses instead of the pool's, typically one that
    /// reaches the server directly while the pool goes through a transaction pooler
    /// ([`pooler`](Self::pooler)). One connection per locker, opened when a waiter first needs
    /// it; its server keepalives are set as on a direct pool. Releases still NOTIFY through the
    /// pool: notifications reach every listener of the database. Ignored when
    /// [`listen`](Self::listen) is off. A URL that does not parse is a
    /// [`LockError::Config`](crate::LockError::Config) from `connect_with` (from every call of
    /// a [`Locker::postgres_with`](crate::Locker::postgres_with) locker).
    ///
    /// ```
    /// let options = dblock::ConnectOptions::new()
    ///     .pooler(true)
    ///     .listen_url("postgres://app@db.internal:5432/app");
    /// ```
    pub fn listen_url(mut self, url: impl Into<String>) -> Self {
        self.listen_url = Some(url.into());
        self
    }

    /// Whether concurrent lock statements of this locker share a round trip (default `true`).
    ///
    /// With coalescing on, a call that finds a free slot of its kind (acquire, release, extend;
    /// one slot per pooled connection, one on SQLite) and nobody queued is sent at once, alone:
    /// a lone caller pays nothing. Calls that find every slot taken wait for a statement to end
    /// and then go together, up to 64 rows in one statement (PostgreSQL: one statement over
    /// arrays; MariaDB: one multi-row upsert; SQLite, MySQL 8 and releases on MySQL/MariaDB:
    /// one transaction, one commit). No timer: only what would have waited anyway travels
    /// together. Every guarantee holds per row: each call gets its own answer, keeps its own
    /// attempt or release id (an unknown outcome is settled row by row) and its own deadline;
    /// rows take their row locks in key order, and two rows of one key never share a
    /// statement. `lock_all` keeps its own all-or-nothing statement.
    ///
    /// `false` sends every statement on its own, as one round trip per call.
    ///
    /// ```
    /// let options = dblock::ConnectOptions::new().coalesce(false);
    /// ```
    pub fn coalesce(mut self, on: bool) -> Self {
        self.coalesce = on;
        self
    }

    /// The locker's default lock-delay (Chubby's and Consul's): after a lease ends without a
    /// release (a holder that crashed, stalled or was cut off), its key stays unavailable to
    /// every owner for this long more, on the database clock, so the vanished holder's writes
    /// in flight land before anyone else starts (for resources that cannot check a fencing
    /// token). A release, `force_release` or `steal` ends it at once. Default zero; a request
    /// overrides it with `.lock_delay(d)`.
    ///
    /// ```
    /// let options = dblock::ConnectOptions::new().lock_delay(std::time::Duration::from_secs(15));
    /// ```
    pub fn lock_delay(mut self, delay: Duration) -> Self {
        self.lock_delay = delay;
        self
    }

    /// Deletes, in the background, the rows that have been free for longer than `older_than`
    /// (as [`Locker::purge`](crate::Locker::purge), whose rules it keeps: a `once` key whose
    /// work succeeded is never deleted, fencing tokens never go backwards), so that a table of
    /// keys like `order:{id}` does not grow for ever. Each table in which the locker (or a
    /// [`table`](crate::Locker::table) copy of it) takes a lock, read lock, permit or
    /// `lock_in` is purged from then on: a second after the first, then once per quarter of
    /// `older_than` (1 s to an hour, each wait jittered down to half of it, so that many
    /// processes do not purge together), until the locker and all its copies are shut down or
    /// dropped. A table not migrated is skipped; a failure is logged (`WARN`, once until a
    /// purge works again) and tried again at the next turn; each purge is a `DEBUG` event.
    /// Default off. Pick an age well above your longest ttl and `min_hold` (a day is a good
    /// start): a free row costs a few hundred bytes, a purge one statement per thousand rows.
    ///
    /// ```
    /// let options = dblock::ConnectOptions::new()
    ///     .auto_purge(std::time::Duration::from_secs(24 * 3600));
    /// ```
    pub fn auto_purge(mut self, older_than: Duration) -> Self {
        self.auto_purge = Some(older_than);
        self
    }
}
