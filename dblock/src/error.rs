//! The one error type of the crate.

use std::time::Duration;

/// Everything that can go wrong when taking, keeping or giving back a lock.
///
/// Library code never panics on bad input or on a database failure: it returns one of these.
/// Functions under `#[distributed_lock]` convert it into their own error type with `From`.
///
/// ```
/// use dblock::LockError;
/// use std::time::Duration;
///
/// let e = LockError::Busy { key: "order:7".into(), waited: Duration::from_millis(250) };
/// assert_eq!(e.to_string(), "lock `order:7` is busy (gave up after 250ms)");
/// assert!(e.is_busy());
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// Someone else held the lock for the whole `wait` period.
    #[error("lock `{key}` is busy (gave up after {waited:?})")]
    Busy {
        /// The key that was asked for.
        key: String,
        /// How long the call kept trying.
        waited: Duration,
    },

    /// The lease ended, or was taken or force-released, while the caller believed it held the lock.
    #[error("lock `{key}` was lost while held (lease expired or was taken)")]
    Lost {
        /// The key that was lost.
        key: String,
    },

    /// A release or extend by an owner that does not hold the lock (anyone else, or after expiry).
    #[error("lock `{key}` is not held by this owner")]
    NotHeld {
        /// The key that was asked for.
        key: String,
    },

    /// The key cannot be used as a lock key; nothing was written.
    #[error("invalid lock key {key:?}: {reason}")]
    InvalidKey {
        /// The key as given (cut to 300 characters, so a huge key does not flood logs).
        key: String,
        /// Why it was refused.
        reason: &'static str,
    },

    /// `#[distributed_lock]` without `locker = ...` ran before [`set_default`](crate::set_default).
    #[error("no locker: call dblock::set_default(locker) at start-up or pass `locker = ...`")]
    NoLocker,

    /// A `once` lock (attribute `once = true`, [`LockRequest::once`](crate::LockRequest::once))
    /// whose last hold succeeded: the work is done, the body does not run again.
    #[error("lock `{key}` is done: its work already succeeded{}", finished_at.map(|t| format!(" (at {:?})", t)).unwrap_or_default())]
    AlreadyDone {
        /// The key.
        key: String,
        /// When the successful hold ended (database clock), where the backend reports it.
        finished_at: Option<std::time::SystemTime>,
    },

    /// The locker was shut down ([`Locker::shutdown`](crate::Locker::shutdown)): it takes no
    /// more locks, and the holds it had were released.
    #[error("the locker was shut down")]
    ShutDown,

    /// Called outside a tokio runtime. dblock runs its statements, releases and renewals on
    /// tokio (through sqlx): call it from `#[tokio::main]`, a `#[tokio::test]` or
    /// `Runtime::block_on`, with the runtime's I/O and time drivers enabled (`enable_all()`).
    #[error("dblock must be called inside a tokio runtime (sqlx and the background release run on tokio): use #[tokio::main] or Runtime::block_on")]
    NoRuntime,

    /// A setting is out of range (zero ttl, bad table name, unsupported URL, ...).
    #[error("dblock configuration: {0}")]
    Config(String),

    /// The database failed or could not be reached. The error is the real cause (a refused
    /// or lost connection, a server error), never a bare pool time-out when the server is
    /// unreachable; when a statement was sent and its answer never came, it says so
    /// ([`is_outcome_unknown`](LockError::is_outcome_unknown)).
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}

/// Wrapped around a database error after which a statement's outcome is unknown: it was sent,
/// and no answer came (the connection broke, or the reply did not arrive in time).
#[derive(Debug)]
struct OutcomeUnknown {
    what: String,
    source: sqlx::Error,
}

impl std::fmt::Display for OutcomeUnknown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "outcome of the {} unknown (it was sent, no answer came: {})",
            self.what, self.source
        )
    }
}

impl std::error::Error for OutcomeUnknown {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

impl LockError {
    /// `true` for [`LockError::Busy`].
    ///
    /// ```
    /// assert!(!dblock::LockError::NoLocker.is_busy());
    /// ```
    pub fn is_busy(&self) -> bool {
        matches!(self, LockError::Busy { .. })
    }

    /// `true` for [`LockError::Lost`].
    ///
    /// ```
    /// assert!(dblock::LockError::Lost { key: "k".into() }.is_lost());
    /// ```
    pub fn is_lost(&self) -> bool {
        matches!(self, LockError::Lost { .. })
    }

    /// `Err(NoRuntime)` unless the caller runs inside a tokio runtime: checked on entry to
    /// every async call, so that none of them can panic inside tokio or sqlx instead.
    pub(crate) fn require_runtime() -> Result<(), LockError> {
        match tokio::runtime::Handle::try_current() {
            Ok(_) => Ok(()),
            Err(_) => Err(LockError::NoRuntime),
        }
    }

    /// `true` when the database failed after a statement was sent and before its answer came:
    /// it may or may not have taken effect. dblock keeps resolving such a statement in the
    /// background (an acquire that did take effect is given back, a release goes on being sent)
    /// until its outcome is known or the lease it concerns has ended.
    ///
    /// ```
    /// # fn demo(e: dblock::LockError) {
    /// if e.is_outcome_unknown() {
    ///     eprintln!("the database did not answer: {e}");
    /// }
    /// # }
    /// assert!(!dblock::LockError::NoLocker.is_outcome_unknown());
    /// ```
    pub fn is_outcome_unknown(&self) -> bool {
        let LockError::Database(sqlx::Error::Io(io)) = self else {
            return false;
        };
        io.get_ref()
            .is_some_and(|inner| inner.downcast_ref::<OutcomeUnknown>().is_some())
    }

    /// A database failure of `what` (e.g. "acquire of `order:7`"); `unknown` when a send of it
    /// had no answer, which the error then says (still a `Database` error, so the cause stays
    /// where callers look for it; the original error is its `source()`).
    pub(crate) fn database(error: sqlx::Error, unknown: bool, what: &str) -> LockError {
        if !unknown {
            return LockError::Database(error);
        }
        let kind = match &error {
            sqlx::Error::Io(io) => io.kind(),
            _ => std::io::ErrorKind::Other,
        };
        LockError::Database(sqlx::Error::Io(std::io::Error::new(
            kind,
            OutcomeUnknown {
                what: what.to_owned(),
                source: error,
            },
        )))
    }

    pub(crate) fn invalid_key(key: &str, reason: &'static str) -> Self {
        let shown: String = key.chars().take(300).collect();
        LockError::InvalidKey { key: shown, reason }
    }
}

/// Shorthand for `Result<T, LockError>`.
pub type Result<T, E = LockError> = std::result::Result<T, E>;
