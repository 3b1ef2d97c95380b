//! The one error type of the crate.

use std::time::Duration;

use crate::escape::Escaped;

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
    #[error("lock `{}` is busy (gave up after {waited:?})", Escaped(.key))]
    Busy {
        /// The key that was asked for.
        key: String,
        /// How long the call kept trying.
        waited: Duration,
    },

    /// The lease ended, or was taken or force-released, while the caller believed it held the lock.
    #[error("lock `{}` was lost while held (lease expired or was taken)", Escaped(.key))]
    Lost {
        /// The key that was lost.
        key: String,
    },

    /// A release or extend by an owner that does not hold the lock (anyone else, or after expiry).
    #[error("lock `{}` is not held by this owner", Escaped(.key))]
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
    #[error("lock `{}` is done: its work already succeeded{}", Escaped(.key), finished_at.map(|t| format!(" (at {})", Rfc3339(t))).unwrap_or_default())]
    AlreadyDone {
        /// The key.
        key: String,
        /// When the successful hold ended (database clock), where the backend reports it.
        finished_at: Option<std::time::SystemTime>,
    },

    /// The owner asked for a key in a way that would wait for a hold of its own: the write lock
    /// of a key it reads ([`Locker::read`](crate::Locker::read)), a read of a key it holds for
    /// writing, or a call with [`reentrant(false)`](crate::LockRequest::reentrant) inside a
    /// locked body that holds the key. Refused at once; release the one it holds first (or, in
    /// the body, use the body's own hold).
    #[error("`{}` is held by this owner in a way this call cannot re-enter (the other mode, read or write, or `reentrant(false)` inside the body that holds it): waiting for it would wait for itself; release that hold first", Escaped(.key))]
    WouldWaitForItself {
        /// The key.
        key: String,
    },

    /// A semaphore was asked for with another number of permits than its live holders took it
    /// with ([`Locker::semaphore`](crate::Locker::semaphore)): two numbers for one key would let
    /// more holders in than either allows, so the call is refused instead. Nothing was taken.
    #[error("semaphore `{}` is held with {in_use} permits; this call asked for {asked}", Escaped(.key))]
    PermitsMismatch {
        /// The semaphore's key.
        key: String,
        /// The number of permits this call asked for.
        asked: u32,
        /// The number its live holders took it with.
        in_use: u32,
    },

    /// The locker was shut down ([`Locker::shutdown`](crate::Locker::shutdown)): it takes no
    /// more locks, and the holds it had were released. Also a call that would take a new hold
    /// while the locker drains ([`Locker::drain`](crate::Locker::drain)).
    #[error("the locker was shut down")]
    ShutDown,

    /// Called outside a tokio runtime. dblock runs its statements, releases and renewals on
    /// tokio (through sqlx): call it from `#[tokio::main]`, a `#[tokio::test]` or
    /// `Runtime::block_on`, with the runtime's I/O and time drivers enabled (`enable_all()`).
    /// Outside one, a call on the locker returns it (nothing is sent); `lost()` resolves with it at
    /// once (it cannot watch the clock), the streams yield it and end, and `shutdown` ends the
    /// holds without sending their releases (their leases run out).
    #[error("dblock must be called inside a tokio runtime (sqlx and the background release run on tokio): use #[tokio::main] or Runtime::block_on")]
    NoRuntime,

    /// A setting is out of range (zero ttl, bad table name, unsupported URL, ...).
    #[error("dblock configuration: {0}")]
    Config(String),

    /// The database failed or could not be reached. The error is the real cause (a refused
    /// or lost connection, a server error), never a bare pool time-out when the server is
    /// unreachable; when a statement was sent and its answer never came, it says so
    /// ([`is_outcome_unknown`](LockError::is_outcome_unknown)).
    ///
    /// A table or column dblock needs that is not there (never migrated, or migrated by an
    /// older version) is not reported here but as [`Config`](LockError::Config), naming the
    /// table and the fix ([`is_not_migrated`](LockError::is_not_migrated)).
    #[error("database error: {0}")]
    Database(sqlx::Error),
}

impl From<sqlx::Error> for LockError {
    fn from(error: sqlx::Error) -> Self {
        LockError::database(error, false, "statement")
    }
}

/// How every "not migrated" message starts (see [`LockError::is_not_migrated`]).
const NOT_MIGRATED: &str = "not migrated: ";

/// A table (or a column) the statement needs that the database does not have: PostgreSQL
/// undefined_table / undefined_column, MySQL ER_NO_SUCH_TABLE / ER_BAD_FIELD_ERROR, SQLite
/// "no such table" / "no such column". `Some(true)` for a table, `Some(false)` for a column.
fn missing_object(error: &sqlx::Error) -> Option<bool> {
    let sqlx::Error::Database(db) = error else {
        return None;
    };
    let message = db.message();
    match db.code().as_deref() {
        Some("42P01") | Some("42S02") => Some(true),
        Some("42703") | Some("42S22") => Some(false),
        _ if message.contains("no such table") => Some(true),
        _ if message.contains("no such column") => Some(false),
        _ => None,
    }
}

/// The name of the missing table in a database's message, where it names one
/// (`relation "t" does not exist`, `Table 'db.t' doesn't exist`, `no such table: t`).
fn missing_table_name(message: &str) -> Option<&str> {
    let quoted = |open: char, close: char| {
        let start = message.find(open)? + open.len_utf8();
        let end = start + message[start..].find(close)?;
        Some(&message[start..end])
    };
    if let Some(rest) = message.split_once("no such table: ") {
        return Some(rest.1.trim());
    }
    if message.starts_with("relation ") {
        return quoted('"', '"');
    }
    if message.starts_with("Table ") {
        let name = quoted('\'', '\'')?;
        return Some(name.rsplit_once('.').map_or(name, |(_, t)| t));
    }
    None
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
    /// The error for a statement that found a table (`table`) or a column missing: the
    /// `Config` error that names it and the fix.
    fn not_migrated(error: &sqlx::Error, table: bool) -> LockError {
        let said = match error {
            sqlx::Error::Database(db) => db.message().to_owned(),
            other => other.to_string(),
        };
        let what = match (table, missing_table_name(&said)) {
            (true, Some(name)) => format!("the table `{}` does not exist", Escaped(name)),
            (true, None) => "a table of dblock's does not exist".to_owned(),
            (false, _) => "the lock table lacks a column of a later migration".to_owned(),
        };
        LockError::Config(format!(
            "{NOT_MIGRATED}{what}: run `Locker::migrate()` once (or the CLI's `dblock migrate`), \
             or apply the SQL files in the dblock package's `migrations/<backend>/` \
             (the database said: {})",
            Escaped(&said)
        ))
    }

    /// `true` when the lock table (or its queue or permits table, or a column of a later
    /// migration) is not in the database: [`Locker::migrate`](crate::Locker::migrate) was never
    /// run on it, or [`Locker::table`](crate::Locker::table) names another table. The error is
    /// a [`Config`](LockError::Config) error whose message names the table and the fix.
    ///
    #[cfg_attr(feature = "sqlite", doc = "```")]
    #[cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
    /// # async fn demo() -> Result<(), dblock::LockError> {
    /// let locker = dblock::Locker::connect("sqlite::memory:").await?; // not migrated
    /// let err = locker.lock("job").await.unwrap_err();
    /// assert!(err.is_not_migrated());
    /// assert!(err.to_string().contains("migrate()"));
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub fn is_not_migrated(&self) -> bool {
        matches!(self, LockError::Config(message) if message.starts_with(NOT_MIGRATED))
    }

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

    /// `true` for [`LockError::AlreadyDone`]: a `once` key whose work already succeeded.
    ///
    /// ```
    /// let e = dblock::LockError::AlreadyDone { key: "payout:7".into(), finished_at: None };
    /// assert!(e.is_already_done());
    /// ```
    pub fn is_already_done(&self) -> bool {
        matches!(self, LockError::AlreadyDone { .. })
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
        if let Some(table) = missing_object(&error) {
            return LockError::not_migrated(&error, table);
        }
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

    /// A call whose time ran out with no answer from the database: the outcome of its last
    /// statement (`what`) is unknown.
    pub(crate) fn no_answer(waited: Duration, what: &str) -> LockError {
        LockError::database(
            sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer from the database within {waited:?}"),
            )),
            true,
            what,
        )
    }

    pub(crate) fn invalid_key(key: &str, reason: &'static str) -> Self {
        let shown: String = key.chars().take(300).collect();
        LockError::InvalidKey { key: shown, reason }
    }
}

/// A time as an RFC 3339 UTC timestamp with microseconds, `2026-11-25T10:04:05.123456Z`:
/// readable in an error message, where `SystemTime`'s `Debug` shows raw epoch fields.
struct Rfc3339(std::time::SystemTime);

impl std::fmt::Display for Rfc3339 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Whole seconds and microseconds since the epoch, floored (a time before 1970 too).
        let (secs, micros) = match self.0.duration_since(std::time::UNIX_EPOCH) {
            Ok(d) => (d.as_secs() as i64, i64::from(d.subsec_micros())),
            Err(e) => {
                let d = e.duration();
                let micros = i64::from(d.subsec_nanos().div_ceil(1_000));
                let secs = -(d.as_secs() as i64);
                if micros == 0 {
                    (secs, 0)
                } else {
                    (secs - 1, 1_000_000 - micros)
                }
            }
        };
        let (days, of_day) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
        let (year, month, day) = civil_from_days(days);
        write!(
            f,
            "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{micros:06}Z",
            of_day / 3_600,
            of_day % 3_600 / 60,
            of_day % 60
        )
    }
}

/// The proleptic Gregorian date (year, month 1-12, day 1-31) `days` days after 1970-01-01
/// (Howard Hinnant's `civil_from_days`: eras of 400 years, years starting on 1 March).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468; // days since 0000-03-01
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of the era, 0..=146_096
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365; // year of the era, 0..=399
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of the year from 1 March, 0..=365
    let mp = (5 * doy + 2) / 153; // month from March, 0..=11
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Shorthand for `Result<T, LockError>`.
pub type Result<T, E = LockError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{SystemTime, UNIX_EPOCH};

    fn at(secs: u64, micros: u32) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_micros(u64::from(micros))
    }

    #[test]
    fn already_done_shows_a_readable_utc_time() {
        let e = LockError::AlreadyDone {
            key: "payout:9".into(),
            // 2026-11-25T10:04:05Z
            finished_at: Some(at(1_795_601_045, 123_456)),
        };
        assert_eq!(
            e.to_string(),
            "lock `payout:9` is done: its work already succeeded (at 2026-11-25T10:04:05.123456Z)"
        );
        let e = LockError::AlreadyDone {
            key: "payout:9".into(),
            finished_at: None,
        };
        assert_eq!(
            e.to_string(),
            "lock `payout:9` is done: its work already succeeded"
        );
    }

    #[test]
    fn timestamps_across_the_calendar() {
        let cases = [
            (at(0, 0), "1970-01-01T00:00:00.000000Z"),
            (at(951_782_400, 1), "2000-02-29T00:00:00.000001Z"), // leap day of a 400-year leap
            (at(4_107_542_399, 999_999), "2100-02-28T23:59:59.999999Z"), // 2100 is no leap year
            (at(4_107_542_400, 0), "2100-03-01T00:00:00.000000Z"),
            (at(1_735_689_599, 0), "2024-12-31T23:59:59.000000Z"),
            (
                UNIX_EPOCH - Duration::from_micros(1),
                "1969-12-31T23:59:59.999999Z",
            ),
            (
                UNIX_EPOCH - Duration::from_secs(86_400 * 365),
                "1969-01-01T00:00:00.000000Z",
            ),
        ];
        for (time, want) in cases {
            assert_eq!(Rfc3339(time).to_string(), want);
        }
    }
}
