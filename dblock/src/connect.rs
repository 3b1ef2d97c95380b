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
///
/// Whatever the options, a `lock()` call returns by its `wait` (an attempt that `wait` cannot
/// cover gets at most one second), a release or extend by the statement time-out, and no
/// statement keeps a lease looking alive past its ttl. PostgreSQL connections also ask the
/// server for TCP keepalives (idle 10 s, then every 5 s, 3 probes), so the server drops a
/// vanished client's connection instead of keeping it for hours.
///
/// ```
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
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ConnectOptions {
    pub(crate) max_connections: Option<u32>,
    pub(crate) acquire_timeout: Option<Duration>,
    pub(crate) statement_timeout: Duration,
    pub(crate) listen: bool,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            max_connections: None,
            acquire_timeout: None,
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
            listen: true,
        }
    }
}

/// One statement's limit unless set otherwise.
pub(crate) const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

impl ConnectOptions {
    /// The defaults (see the table above).
    ///
    /// ```
    /// let options = dblock::ConnectOptions::new();
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Most connections the locker's pool opens (at least 1).
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
}
