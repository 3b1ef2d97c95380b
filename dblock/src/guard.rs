//! [`LockGuard`]: a held lock, released by [`LockGuard::release`] or in the background on drop.

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use crate::backend::{Outcome, Released};
use crate::detach::{Detached, Unreceived};
use crate::error::LockError;
use crate::hold::Hold;
use crate::info::time_from_micros;
use crate::meter;
use crate::owner::{HeldLock, Owner};
use crate::registry::Serial;
use crate::renew::Registration;
use crate::shared::{Releasing, Shared};
use tokio::time::Instant;

/// A lock this process holds. Dropping it releases the lock at once, in the background on the
/// current tokio runtime; [`release`](LockGuard::release) does the same and reports the outcome.
///
#[cfg_attr(feature = "sqlite", doc = "```")]
#[cfg_attr(not(feature = "sqlite"), doc = "```no_run")]
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
    pub(crate) hold: Arc<Hold>,
    pub(crate) shared: Arc<Shared>,
    /// Present while the locker's renewal task keeps this lease alive.
    pub(crate) renewal: Option<Registration>,
    /// `false` once `release` has taken over: `Drop` then has nothing to do.
    armed: bool,
    /// What `Drop` records: `Dropped` (the handle API: nothing said about the work), `Failed`
    /// (a locked body's guard: dropped means cancelled), or nothing for a hold nothing ran
    /// under yet (one key of a multi-key call still being taken). A drop while the thread
    /// panics records `Failed` whatever this says.
    drop_outcome: Option<Outcome>,
    /// What [`held`](Self::held) lends, made on its first call (`proof.rs`).
    pub(crate) proof: OnceLock<Box<HeldLock>>,
}

impl LockGuard {
    /// The guard of a fresh grant; `Err(Refused)` if the locker was shut down while the grant
    /// was on its way: the caller gives the hold back ([`Refused::give_back`]) before it
    /// reports `ShutDown`, as `shutdown` gives back the holds it found.
    pub(crate) fn new(hold: Hold, shared: Arc<Shared>) -> Result<Self, Refused> {
        let hold = Arc::new(hold);
        let open = shared.track(&hold);
        meter::held(&hold.meter);
        let guard = LockGuard {
            hold,
            shared,
            renewal: None,
            armed: true,
            drop_outcome: Some(Outcome::Dropped),
            proof: OnceLock::new(),
        };
        if open {
            Ok(guard)
        } else {
            Err(Refused(guard))
        }
    }

    /// Resolves once a hold that `Locker::shutdown` took away has been released by it (at
    /// once for any other hold).
    pub(crate) async fn shutdown_settled(&self) {
        if self.hold.is_revoked() {
            self.hold.settled().await;
        }
    }

    /// Whether dropping the guard records `Dropped` (`true`, the default) or nothing.
    pub(crate) fn set_used(&mut self, used: bool) {
        self.drop_outcome = used.then_some(Outcome::Dropped);
    }

    /// Dropping the guard records `Failed`: it guards a locked body, and a body dropped before
    /// it ended was cancelled.
    pub(crate) fn fail_on_drop(&mut self) {
        self.drop_outcome = Some(Outcome::Failed);
    }

    /// The hold record, shared with renewal and the locked body's `current()`.
    #[allow(dead_code)]
    pub(crate) fn hold(&self) -> &Arc<Hold> {
        &self.hold
    }

    /// What `dblock::current()` reports of this lock inside a locked body.
    pub(crate) fn held_lock(&self) -> HeldLock {
        self.hold
            .held_lock(&self.shared.table, self.shared.simple_statements())
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
        if self.renewal.is_none() {
            if let Ok(backend) = self.shared.backend() {
                self.renewal = Some(self.shared.renewer.register(backend, &self.hold));
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
        self.hold.is_lost()
    }

    /// Resolves when `Locker::shutdown` takes the lock away or the hold reaches its `max_hold`
    /// cap (never otherwise): what ends a locked body that does not renew.
    pub(crate) async fn revoked_or_capped(&self) -> LockError {
        tokio::select! {
            () = self.hold.revoked() => {}
            () = self.hold.cap_reached() => {}
        }
        LockError::Lost {
            key: self.hold.name().to_owned(),
        }
    }

    /// Resolves with [`LockError::Lost`] when the lock is lost: when renewal (see
    /// [`auto_renew`](Self::auto_renew)) finds it gone, or, without renewal, when the ttl runs
    /// out, or when [`Locker::shutdown`](crate::Locker::shutdown) takes it away. Use it to stop
    /// work that must not continue unprotected. Polled outside a tokio runtime, it cannot
    /// watch the clock: it resolves at once, with `Lost` if the lock is lost, else with
    /// [`LockError::NoRuntime`].
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guard = locker.lock("k").ttl(std::time::Duration::from_millis(100)).await?;
    /// let lost = guard.lost().await; // the ttl ran out
    /// assert!(lost.is_lost());
    /// # Ok(()) }
    /// ```
    pub async fn lost(&self) -> LockError {
        if let Err(e) = LockError::require_runtime() {
            if !self.hold.is_lost() {
                return e;
            }
        } else {
            self.hold.lost().await;
        }
        LockError::Lost {
            key: self.hold.name().to_owned(),
        }
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
        self.hold.name()
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
        self.hold.fencing_token
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
        self.hold.hold_count
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
        &self.hold.owner
    }

    /// How long the lease is sure to last still, by this process's monotonic clock: the time
    /// until the acquire's (or the last extension's) send time plus its ttl, zero once that has
    /// passed. The lease ends no sooner on the database clock, so work that must finish under
    /// the lock can budget with it without comparing clocks with the database (unlike
    /// [`expires_at`](Self::expires_at)). Renewal and [`extend`](Self::extend) move it on.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// use std::time::Duration;
    /// let guard = locker.lock("k").ttl(Duration::from_secs(30)).await?;
    /// assert!(guard.remaining() <= Duration::from_secs(30));
    /// if guard.remaining() < Duration::from_secs(5) {
    ///     // too little left to start the next step under this lease
    /// }
    /// # Ok(()) }
    /// ```
    pub fn remaining(&self) -> Duration {
        self.hold
            .deadline()
            .saturating_duration_since(Instant::now())
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
        time_from_micros(self.hold.expires_at_us())
    }

    /// Makes the lease end no earlier than `ttl` from now (database clock). Never shortens it.
    ///
    /// Fails with [`LockError::Lost`] when the lock was taken while its lease ran (an
    /// operator's `force_release` or `steal`) and with [`LockError::NotHeld`] when the lease
    /// already ended: either way the guard no longer protects anything.
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
        self.shared.extend(&self.hold, ttl).await
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
    pub async fn release(self) -> Result<(), LockError> {
        self.give_back(Some(Outcome::Succeeded)).await
    }

    /// Releases now, recording that the work under the lock failed ([`Outcome::Failed`]): a
    /// [`once`](crate::LockRequest::once) key stays runnable. Otherwise as
    /// [`release`](Self::release). (A guard simply dropped records [`Outcome::Dropped`], neutral;
    /// dropped while its thread panics, `Failed`.)
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guard = locker.lock("payout:7").once().await?;
    /// // ... the payment provider said no ...
    /// guard.release_failed().await?;
    /// assert!(locker.lock("payout:7").once().await.is_ok()); // runnable again
    /// # Ok(()) }
    /// ```
    pub async fn release_failed(self) -> Result<(), LockError> {
        self.give_back(Some(Outcome::Failed)).await
    }

    /// Gives the hold back unused: nothing ran under it, so no outcome is recorded (a partial
    /// multi-key acquisition undone).
    pub(crate) async fn give_back_unused(self) -> Result<(), LockError> {
        self.give_back(None).await
    }

    /// Gives back a guard that no caller received (its `lock()` call was dropped, or gave up
    /// while the attempt settled an unknown outcome), under the owner's serialisation of the key
    /// that the attempt still holds: no other statement of the owner on the key runs first, so
    /// a new call of the same owner never builds on this hold. Nothing ran under it: no outcome
    /// is recorded.
    pub(crate) async fn give_back_unreceived(mut self, serial: &mut Serial) {
        self.armed = false;
        let _releasing = self.end();
        if self.hold.is_revoked() {
            return; // Locker::shutdown released it already
        }
        drop(self.renewal.take());
        let until = self.hold.deadline().max(Instant::now()) + self.shared.statement_timeout;
        if let Err(e) = self
            .shared
            .release_serialised(&self.hold, serial, None, until)
            .await
        {
            tracing::warn!(key = %crate::Escaped(&self.hold.key), error = %e,
                "giving back an unreceived grant failed; the lease will expire on its own");
        }
    }

    async fn give_back(mut self, outcome: Option<Outcome>) -> Result<(), LockError> {
        // Outside a runtime the guard is dropped as it is (its Drop says the lease will expire).
        LockError::require_runtime()?;
        self.armed = false;
        let releasing = self.end();
        if self.hold.is_revoked() {
            // Locker::shutdown releases it: the caller hears once that is over.
            self.hold.settled().await;
            return Err(LockError::ShutDown);
        }
        drop(self.renewal.take()); // no renewal from here on
        let bound = self.shared.statement_timeout;
        // Detached: dropping this future half-way cannot leave the release unsent (or queued on
        // a pooled connection until it is next used), and a release the database does not
        // answer goes on after this call has returned, in a task of its own.
        let (hold, shared) = (self.hold.clone(), self.shared.clone());
        let release = Detached::new(async move {
            let _releasing = releasing;
            release(hold, shared, outcome).await
        });
        let outcome = match tokio::time::timeout(bound, release).await {
            Ok(released) => released,
            Err(_) => Err(LockError::database(
                sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "no answer within {bound:?}; still being sent in the background until the lease has ended"
                    ),
                )),
                true,
                &format!("release of `{}`", crate::Escaped(&self.hold.key)),
            )),
        };
        match outcome? {
            Released::NotHeld => Err(LockError::NotHeld {
                key: self.hold.name().to_owned(),
            }),
            outcome => {
                tracing::debug!(key = %crate::Escaped(&self.hold.key), ?outcome, "released");
                Ok(())
            }
        }
    }
}

/// A grant that arrived after `Locker::shutdown`: not handed out, to be given back.
pub(crate) struct Refused(LockGuard);

impl Refused {
    /// Gives the hold back (recording a failure: the call never received it) under the owner's
    /// serialisation of the key when the caller holds it, for at most one statement time-out,
    /// and returns the error for the call: `ShutDown`, heard only once the release is over.
    pub(crate) async fn give_back(self, serial: Option<&mut Serial>) -> LockError {
        let mut guard = self.0;
        guard.armed = false;
        let _releasing = guard.end();
        drop(guard.renewal.take());
        let (hold, shared) = (&guard.hold, &guard.shared);
        let until = Instant::now() + shared.statement_timeout;
        let released = match serial {
            Some(serial) => {
                shared
                    .release_serialised(hold, serial, Some(Outcome::Failed), until)
                    .await
            }
            None => shared.release(hold, Some(Outcome::Failed), until).await,
        };
        match released {
            Ok(_) => {
                tracing::debug!(key = %crate::Escaped(&hold.key), "granted after shutdown: given back")
            }
            Err(e) => tracing::warn!(key = %crate::Escaped(&hold.key), error = %e,
                "giving back a grant that arrived after shutdown failed; the lease will expire on its own"),
        }
        LockError::ShutDown
    }
}

impl LockGuard {
    /// The guard is done with its hold (given back, or dropped): once.
    /// After `release_in`: the guard is done, and its hold is checked a moment later, when the
    /// caller's transaction has most likely ended (`RELEASE_IN_CHECK`). Committed, the release
    /// statement then finds nothing to release and writes nothing; rolled back, it gives the
    /// hold back, recording `Dropped`. Many such checks travel in one coalesced statement. Not
    /// at once: sent while the transaction is open, it would wait on the row it locked, and cost
    /// a statement (and a connection) per request.
    pub(crate) fn release_later(mut self) {
        drop(self.renewal.take());
        self.armed = false;
        let releasing = self.end();
        let (hold, shared) = (self.hold.clone(), self.shared.clone());
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _releasing = releasing;
                tokio::time::sleep(RELEASE_IN_CHECK).await;
                match release(hold.clone(), shared, Some(Outcome::Dropped)).await {
                    Ok(Released::NotHeld) => {}
                    Ok(outcome) => tracing::debug!(key = %crate::Escaped(&hold.key), ?outcome,
                        "a release in a rolled-back transaction: given back"),
                    Err(e) => tracing::warn!(key = %crate::Escaped(&hold.key), error = %e,
                        "release after release_in failed; the lease will expire on its own"),
                }
            });
        }
    }

    /// Untracks the hold; the token counts its release as on its way until dropped.
    fn end(&self) -> Releasing {
        let releasing = self.shared.untrack(&self.hold);
        meter::released(&self.hold.meter, self.hold.granted.elapsed());
        releasing
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        drop(self.renewal.take()); // no renewal from here on
        if !self.armed {
            return;
        }
        let releasing = self.end();
        if self.hold.is_revoked() {
            return; // Locker::shutdown released it already
        }
        let outcome = match self.drop_outcome {
            // Dropped while unwinding: whatever the work was doing, it did not finish.
            Some(_) if std::thread::panicking() => Some(Outcome::Failed),
            outcome => outcome,
        };
        let (hold, shared) = (self.hold.clone(), self.shared.clone());
        // Not lazily on the next use of a connection: a task of its own, right now.
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    let _releasing = releasing;
                    match release(hold.clone(), shared, outcome).await {
                        Ok(outcome) => {
                            tracing::debug!(key = %crate::Escaped(&hold.key), ?outcome, "released on drop")
                        }
                        Err(e) => tracing::warn!(key = %crate::Escaped(&hold.key), error = %e,
                            "release on drop failed; the lease will expire on its own"),
                    }
                });
            }
            Err(_) => tracing::warn!(key = %crate::Escaped(&hold.key),
                "LockGuard dropped outside a tokio runtime; the lease will expire on its own"),
        }
    }
}

/// How long after `release_in` a guard's hold is checked (and given back if the caller's
/// transaction rolled back).
const RELEASE_IN_CHECK: Duration = Duration::from_millis(500);

/// Gives the hold back, trying until its lease has surely ended (past that, the database has
/// freed it anyway).
async fn release(
    hold: Arc<Hold>,
    shared: Arc<Shared>,
    outcome: Option<Outcome>,
) -> Result<Released, LockError> {
    let until = hold.deadline().max(Instant::now()) + shared.statement_timeout;
    shared.release(&hold, outcome, until).await
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.hold.key)
            .field("owner", &self.hold.owner)
            .field("fencing_token", &self.hold.fencing_token)
            .field("hold_count", &self.hold.hold_count)
            .field("expires_at", &self.expires_at())
            .finish()
    }
}

/// A release nobody waits for any more has done all it had to: its answer is only logged.
impl Unreceived for Result<Released, LockError> {
    async fn unreceived(self) {
        if let Err(e) = self {
            tracing::warn!(error = %e, "release failed after its caller stopped waiting; the lease will expire on its own");
        }
    }
}
