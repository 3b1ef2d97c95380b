//! [`LockInfo`]: one row of the lock table, as the operator API reports it, and the time
//! conversions every backend's rows go through.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The `owner` of a row held by readers ([`LockKind::Read`]). Owner ids are UUIDs; this never
/// is one.
pub(crate) const READERS: &str = "(readers)";

/// One row of the lock table as [`Locker::inspect`](crate::Locker::inspect) and
/// [`Locker::held`](crate::Locker::held) report it.
///
/// When the lock is not held (free, or its lease ran out) `owner` is `None` and `hold_count` 0;
/// `holder` still names the last holder, for operators.
///
/// ```
/// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
/// if let Some(info) = locker.inspect("order:42").await? {
///     println!("held={} token={} holder={:?} left={:?}",
///              info.held, info.fencing_token, info.holder, info.time_left);
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockInfo {
    /// The lock key.
    pub key: String,
    /// The owner id while held, else `None`.
    pub owner: Option<String>,
    /// `host/pid[/label]` of the current (or last) holder.
    pub holder: Option<String>,
    /// The owner's re-entry count while held, else 0.
    pub hold_count: u32,
    /// The key's fencing token (of the current or last tenure).
    pub fencing_token: u64,
    /// Lease end while held; when free, the time it was freed. Database clock.
    pub expires_at: SystemTime,
    /// When the current (or last) owner took the key. Database clock.
    pub acquired_at: SystemTime,
    /// `true` while an owner holds a live lease.
    pub held: bool,
    /// Lease time left, measured by the database (zero when not held).
    pub time_left: Duration,
    /// How the last finished hold ended (`None`: none has finished yet, or an operator reset
    /// the key). A hold whose lease ran out without a release (a crashed or stalled holder)
    /// ended in failure: reported as [`Outcome::Failed`] at its lease end as soon as the lease
    /// is over, and written into the row when someone takes the key over.
    pub last_outcome: Option<Outcome>,
    /// When the last finished hold ended (for a lease that ran out: its end). Database clock.
    pub finished_at: Option<SystemTime>,
    /// How many times the current (or last) tenure's lease was extended: by renewal
    /// (`renew = true`, a [`Leadership`](crate::Leadership), a semaphore permit) and by
    /// [`LockGuard::extend`](crate::LockGuard::extend). Re-entry does not count; a new tenure
    /// starts at 0. With [`acquired_at`](Self::acquired_at) (the hold's age), it tells a hold
    /// that lives on renewal from one that was just taken.
    pub renewals: u32,
    /// What kind of hold the row is: a lock (also a leadership), or one permit of a semaphore.
    pub kind: LockKind,
}

/// What a [`LockInfo`] row is.
///
/// ```
/// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
/// let permit = locker.semaphore("exports", 3).await?;
/// for info in locker.held().await? {
///     match info.kind {
///         dblock::LockKind::Permit { slot, permits } => {
///             println!("{}: permit {slot} of {permits}, held by {:?}", info.key, info.holder)
///         }
///         _ => println!("{}: lock held by {:?}", info.key, info.holder),
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum LockKind {
    /// An exclusive lock ([`Locker::lock`](crate::Locker::lock)), or a leadership
    /// ([`Locker::leader`](crate::Locker::leader)), which is one.
    #[default]
    Lock,
    /// Held (or last held) by readers ([`Locker::read`](crate::Locker::read)): `hold_count` is
    /// how many read holds, `owner` is `"(readers)"`.
    Read {
        /// A writer waits for the readers to leave; readers that come now wait behind it.
        writer_waiting: bool,
    },
    /// One permit of the semaphore of the row's key
    /// ([`Locker::semaphore`](crate::Locker::semaphore)): slot `slot` of `permits`.
    Permit {
        /// Which of the semaphore's slots (`0..permits`).
        slot: u32,
        /// The semaphore's number of permits.
        permits: u32,
    },
}

/// How a hold ended, as the row records it: the attribute's body returned `Ok` (or
/// [`LockGuard::release`](crate::LockGuard::release)); or it failed: returned `Err`, panicked,
/// was cancelled, was released with [`release_failed`](crate::LockGuard::release_failed), its
/// lease ran out, or an operator force-released it; or a guard was simply dropped (`Dropped`:
/// nothing was said about the work).
///
/// ```
/// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
/// locker.lock("job").await?.release().await?;
/// let info = locker.inspect("job").await?.unwrap();
/// assert_eq!(info.last_outcome, Some(dblock::Outcome::Succeeded));
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The work under the lock finished and said so.
    Succeeded,
    /// The work under the lock did not finish well: the body returned `Err`, panicked or was
    /// cancelled, [`release_failed`](crate::LockGuard::release_failed), a guard dropped while
    /// its thread panicked, or a lease that ran out without a release.
    Failed,
    /// A [`LockGuard`](crate::LockGuard) of the handle API was dropped without a word on how
    /// the work went: neutral. [`once`](crate::LockRequest::once) treats it as not done (the
    /// work may run again); say how it went with [`release`](crate::LockGuard::release) or
    /// [`release_failed`](crate::LockGuard::release_failed).
    Dropped,
}

impl Outcome {
    /// The code in the `last_outcome` column.
    pub(crate) fn code(self) -> i16 {
        match self {
            Outcome::Succeeded => 1,
            Outcome::Failed => 2,
            Outcome::Dropped => 3,
        }
    }

    pub(crate) fn from_code(code: i64) -> Option<Outcome> {
        match code {
            1 => Some(Outcome::Succeeded),
            2 => Some(Outcome::Failed),
            3 => Some(Outcome::Dropped),
            _ => None,
        }
    }
}

impl LockKind {
    /// The kind of a lock table's row from its owner column: the readers' marker is a read
    /// (`writer_waiting`: a writer's intent is live and the row held), any other a lock.
    pub(crate) fn of_row(owner: Option<&str>, writer_waiting: bool) -> LockKind {
        if owner == Some(READERS) {
            LockKind::Read { writer_waiting }
        } else {
            LockKind::Lock
        }
    }
}

/// A count column (non-negative in every row) as a `u32`, saturating.
pub(crate) fn count(n: i64) -> u32 {
    u32::try_from(n.max(0)).unwrap_or(u32::MAX)
}

/// Microseconds since the Unix epoch (as the database reports them) to `SystemTime`.
pub(crate) fn time_from_micros(us: i64) -> SystemTime {
    if us >= 0 {
        UNIX_EPOCH + Duration::from_micros(us as u64)
    } else {
        UNIX_EPOCH - Duration::from_micros(us.unsigned_abs())
    }
}

/// A non-negative millisecond count from the database to a `Duration`.
pub(crate) fn millis(ms: i64) -> Duration {
    Duration::from_millis(ms.max(0) as u64)
}
