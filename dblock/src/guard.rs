//! [`LockGuard`]: a held lock, released by [`LockGuard::release`] or in the background on drop.

use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use crate::backend::{self, HoldRef, Released};
use crate::locker::{ttl_micros, Locker};
use crate::renew::Lease;
use crate::{LockError, Owner};

/// A lock this process holds. Dropping it releases the lock at once, in the background on the
/// current tokio runtime; [`release`](LockGuard::release) does the same and reports the outcome.
///
/// ```
/// # async fn demo() -> Result<(), dblock::LockError> {
/// use std::time::Duration;
/// let locker = dblock::Locker::connect("sqlite::memory:").await?;
/// locker.migrate().await?;
///
/// let guard = locker.lock("report:2026-11").ttl(Duration::from_secs(30)).await?;
/// assert_eq!(guard.key(), "report:2026-11");
/// assert_eq!(guard.hold_count(), 1);
/// let token = guard.fencing_token(); // hand this to the resource you write to
/// guard.extend(Duration::from_secs(60)).await?;
/// guard.release().await?;
/// # let _ = token; Ok(())
/// # }
/// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
/// ```
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard {
    hold: Option<Hold>,
    fencing_token: u64,
    hold_count: u32,
    expires_at_us: AtomicI64,
    /// Lease length asked for.
    ttl: Duration,
    /// Conservative local end of the lease: send time of the acquire (or last extend) + ttl.
    deadline: Mutex<Instant>,
    /// Present while the locker's renewal task keeps this lease alive.
    lease: Option<Lease>,
}

/// What a release needs; taken out of the guard by whoever releases it.
pub(crate) struct Hold {
    pub(crate) locker: Locker,
    pub(crate) key: String,
    pub(crate) owner: Owner,
    pub(crate) fencing_token: u64,
    /// The owner's count right after this guard's acquisition (its nesting level).
    pub(crate) level: u32,
}

impl Hold {
    fn as_ref(&self) -> HoldRef<'_> {
        HoldRef {
            key: &self.key,
            owner: self.owner.id(),
            fencing_token: self.fencing_token,
        }
    }

    /// Gives one hold back. Retries statements the server rolled back; after a broken connection
    /// it sends the same release again, which recognises its own earlier success by the release
    /// id it left in the row. The owner's operations on this key are serialised meanwhile, so no
    /// re-entry of the same owner can slip in between and make a repeat count twice.
    pub(crate) async fn release(&self) -> Result<Released, LockError> {
        let backend = self.locker.backend()?;
        let _serial = self.locker.serialise(self.owner.id(), &self.key).await;
        let release_id = fastrand::i64(1..i64::MAX);
        let mut rolled_back = 0;
        let mut unknown = 0;
        loop {
            match backend.release(&self.as_ref(), release_id).await {
                Ok(Released::NotHeld) if unknown > 0 => {
                    tracing::debug!(key = %self.key, "release after a lost reply: earlier attempt took effect");
                    return Ok(Released::StillHeld(self.level.saturating_sub(1)));
                }
                Ok(outcome) => return Ok(outcome),
                Err(e) => match backend::classify(&e) {
                    backend::Failure::NotCommitted
                        if rolled_back < crate::locker::MAX_ROLLBACK_RETRIES =>
                    {
                        rolled_back += 1;
                    }
                    backend::Failure::Unknown if unknown < crate::locker::MAX_RECONNECTS => {
                        unknown += 1;
                    }
                    _ => return Err(LockError::Database(e)),
                },
            }
        }
    }
}

impl LockGuard {
    pub(crate) fn new(
        hold: Hold,
        hold_count: u32,
        expires_at_us: i64,
        sent: Instant,
        ttl: Duration,
    ) -> Self {
        LockGuard {
            fencing_token: hold.fencing_token,
            hold: Some(hold),
            hold_count,
            expires_at_us: AtomicI64::new(expires_at_us),
            ttl,
            deadline: Mutex::new(sent + ttl),
            lease: None,
        }
    }

    fn deadline(&self) -> Instant {
        *self
            .deadline
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Keeps the lease alive while this guard lives: the locker's one renewal task extends it
    /// about every ttl/3 (batched with every other renewed lease of the locker). Renewal stops
    /// the moment the guard is released or dropped. Watch [`lost`](Self::lost) for the case
    /// where an extension finds the lock gone.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// use std::time::Duration;
    /// let guard = locker.lock("long-job").ttl(Duration::from_secs(3)).await?.auto_renew();
    /// tokio::select! {
    ///     lost = guard.lost() => return Err(lost),     // someone force-released it, say
    ///     () = tokio::time::sleep(Duration::from_secs(10)) => {} // the work, longer than the ttl
    /// }
    /// guard.release().await
    /// # }
    /// ```
    pub fn auto_renew(mut self) -> Self {
        if self.lease.is_none() {
            if let Some(hold) = &self.hold {
                if let Ok(backend) = hold.locker.backend() {
                    let sent = self.deadline() - self.ttl;
                    self.lease = Some(hold.locker.renewer().register(
                        backend,
                        &hold.key,
                        hold.owner.id(),
                        hold.fencing_token,
                        self.ttl,
                        sent,
                    ));
                }
            }
        }
        self
    }

    /// `true` once the lock is known lost: renewal found it gone or, without renewal, the ttl
    /// has run out (by the local clock, counted from when the acquire was sent).
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guard = locker.lock("k").await?;
    /// assert!(!guard.is_lost());
    /// # Ok(()) }
    /// ```
    pub fn is_lost(&self) -> bool {
        match &self.lease {
            Some(lease) => lease.is_lost(),
            None => Instant::now() >= self.deadline(),
        }
    }

    /// Resolves with [`LockError::Lost`] when the lock is lost: when renewal (see
    /// [`auto_renew`](Self::auto_renew)) finds it gone, or, without renewal, when the ttl runs
    /// out. Use it to stop work that must not continue unprotected.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guard = locker.lock("k").ttl(std::time::Duration::from_millis(100)).await?;
    /// let lost = guard.lost().await; // the ttl ran out
    /// assert!(lost.is_lost());
    /// # Ok(()) }
    /// ```
    pub async fn lost(&self) -> LockError {
        match &self.lease {
            Some(lease) => lease.lost().await,
            // An `extend` meanwhile moves the deadline: sleep again until the current one.
            None => loop {
                let deadline = self.deadline();
                if Instant::now() >= deadline {
                    break;
                }
                tokio::time::sleep_until(deadline).await;
            },
        }
        LockError::Lost {
            key: self.hold().key.clone(),
        }
    }

    fn hold(&self) -> &Hold {
        // Only `release(self)` and `Drop` take the hold out, and neither leaves a guard behind.
        self.hold.as_ref().expect("LockGuard used after release")
    }

    /// The lock key.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guard = locker.lock("invoice:42").await?;
    /// assert_eq!(guard.key(), "invoice:42");
    /// # Ok(()) }
    /// ```
    pub fn key(&self) -> &str {
        &self.hold().key
    }

    /// The fencing token: strictly larger every time the key changes owner (re-entry keeps it).
    /// Hand it to the resource the lock protects so it can refuse writes from an older holder.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let first = locker.lock("k").await?.fencing_token(); // guard dropped: released
    /// # tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    /// let second = locker.lock("k").wait(std::time::Duration::from_secs(1)).await?;
    /// assert!(second.fencing_token() > first);
    /// # Ok(()) }
    /// ```
    pub fn fencing_token(&self) -> u64 {
        self.fencing_token
    }

    /// The owner's hold count for this key right after this acquisition: 1 for a first hold,
    /// 2 for the first re-entry, and so on.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// assert_eq!(locker.lock("k").await?.hold_count(), 1);
    /// # Ok(()) }
    /// ```
    pub fn hold_count(&self) -> u32 {
        self.hold_count
    }

    /// The owner holding this lock.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let owner = dblock::Owner::new();
    /// let guard = locker.lock("k").owner(&owner).await?;
    /// assert_eq!(guard.owner(), &owner);
    /// # Ok(()) }
    /// ```
    pub fn owner(&self) -> &Owner {
        &self.hold().owner
    }

    /// When the lease ends, on the database clock, as of the last acquire or extend. (On the
    /// MySQL 8 path, which cannot read it back, an estimate: client send time + ttl.)
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guard = locker.lock("k").await?;
    /// assert!(guard.expires_at() > std::time::UNIX_EPOCH);
    /// # Ok(()) }
    /// ```
    pub fn expires_at(&self) -> SystemTime {
        backend::time_from_micros(self.expires_at_us.load(Ordering::Relaxed))
    }

    /// Makes the lease end no earlier than `ttl` from now (database clock). Never shortens it.
    ///
    /// Fails with [`LockError::NotHeld`] when the lease already ended (or the lock was
    /// force-released): the guard no longer protects anything.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// use std::time::Duration;
    /// let guard = locker.lock("k").ttl(Duration::from_secs(5)).await?;
    /// guard.extend(Duration::from_secs(60)).await?;
    /// # Ok(()) }
    /// ```
    pub async fn extend(&self, ttl: Duration) -> Result<(), LockError> {
        LockError::require_runtime()?;
        let ttl_us = ttl_micros(ttl)?;
        let hold = self.hold();
        let backend = hold.locker.backend()?;
        let mut rolled_back = 0;
        loop {
            let sent = Instant::now();
            match backend.extend(&hold.as_ref(), ttl_us).await {
                Ok(Some(expires_at_us)) => {
                    self.expires_at_us.store(expires_at_us, Ordering::Relaxed);
                    let mut deadline = self
                        .deadline
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner());
                    *deadline = (*deadline).max(sent + ttl);
                    tracing::trace!(key = %hold.key, "lease extended");
                    return Ok(());
                }
                Ok(None) => {
                    tracing::debug!(key = %hold.key, "extend refused: lease no longer ours");
                    return Err(LockError::NotHeld {
                        key: hold.key.clone(),
                    });
                }
                // An extend is idempotent (it only moves the end to now + ttl), so any failure
                // that may not have committed can be sent again.
                Err(e)
                    if rolled_back < crate::locker::MAX_ROLLBACK_RETRIES
                        && backend::classify(&e) != backend::Failure::Fatal =>
                {
                    rolled_back += 1;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Releases now and reports how it went: [`LockError::NotHeld`] if the lease had already
    /// ended (someone else may have the lock by now).
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guard = locker.lock("k").await?;
    /// guard.release().await?;
    /// assert!(!locker.inspect("k").await?.unwrap().held);
    /// # Ok(()) }
    /// ```
    pub async fn release(mut self) -> Result<(), LockError> {
        // Outside a runtime the guard is dropped as it is (its Drop says the lease will expire).
        LockError::require_runtime()?;
        drop(self.lease.take()); // no renewal from here on
        let hold = self.hold.take().expect("LockGuard used after release");
        // In a task of its own, so that dropping this future half-way cannot leave the release
        // unsent (or queued on a pooled connection until it is next used).
        let key = hold.key.clone();
        let outcome = tokio::spawn(async move { hold.release().await })
            .await
            .unwrap_or_else(|_| Err(LockError::Database(sqlx::Error::WorkerCrashed)));
        match outcome? {
            Released::NotHeld => Err(LockError::NotHeld { key }),
            outcome => {
                tracing::debug!(%key, ?outcome, "released");
                Ok(())
            }
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        drop(self.lease.take()); // no renewal from here on
        let Some(hold) = self.hold.take() else { return };
        // Not lazily on the next use of a connection: a task of its own, right now.
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    match hold.release().await {
                        Ok(outcome) => {
                            tracing::debug!(key = %hold.key, ?outcome, "released on drop")
                        }
                        Err(e) => tracing::warn!(key = %hold.key, error = %e,
                            "release on drop failed; the lease will expire on its own"),
                    }
                });
            }
            Err(_) => tracing::warn!(key = %hold.key,
                "LockGuard dropped outside a tokio runtime; the lease will expire on its own"),
        }
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("LockGuard");
        if let Some(hold) = &self.hold {
            d.field("key", &hold.key).field("owner", &hold.owner);
        }
        d.field("fencing_token", &self.fencing_token)
            .field("hold_count", &self.hold_count)
            .field("expires_at", &self.expires_at())
            .finish()
    }
}
