//! The record of one hold, shared by its guard, the renewal task and the locked body's
//! [`HeldLock`]: who holds which key in which tenure, and how long the lease can still be alive.
//!
//! Two clocks, never mixed: `expires_at_us` is the database's answer (for display and
//! `LockInfo`), `deadline` is local and conservative (tokio's monotonic clock at the moment the
//! statement was *sent*, plus the ttl). Whether the lease may still be alive is only ever judged
//! by the deadline: a reply that took long cannot make a lease look longer than it is.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::backend::{Backend, Grant, HoldRef, Outcome, Released};
use crate::error::LockError;
use crate::info::time_from_micros;
use crate::meter;
use crate::owner::{HeldLock, Owner};
use crate::retry::Policy;
use crate::sync::lock;

/// One hold of one key by one owner (one `lock()` call that succeeded).
pub(crate) struct Hold {
    /// The row's key.
    pub(crate) key: String,
    /// What kind of hold it is: a lock (a leadership is one), a read, or a semaphore's permit.
    pub(crate) kind: HoldKind,
    pub(crate) owner: Owner,
    /// The tenure's fencing token.
    pub(crate) fencing_token: u64,
    /// The owner's count right after this acquisition (its nesting level).
    pub(crate) hold_count: u32,
    /// Lease length asked for.
    pub(crate) ttl: Duration,
    lease: Mutex<Lease>,
    lost: AtomicBool,
    lost_signal: Notify,
    /// Taken away by `Locker::shutdown`, which released it: nothing left for the guard to do.
    revoked: AtomicBool,
    /// The shutdown's release of a revoked hold is over (done, or failed and logged).
    settled: AtomicBool,
    /// Who asked for it (to tell a task that is about to wait for itself).
    pub(crate) caller: Caller,
    /// What its metrics are labelled with.
    pub(crate) meter: meter::Label,
    /// When the grant arrived (for the hold time).
    pub(crate) granted: Instant,
    /// When its acquire statement was sent: no later than the database's `acquired_at`.
    sent: Instant,
    /// Lock-delay: every extension asks the database for this much more than the lease, so the
    /// key stays unavailable that long after a lease that ends without a release.
    lock_delay: std::sync::atomic::AtomicU64,
    /// Released in the caller's transaction (`release_in`): the release that follows finding
    /// it gone is expected.
    pub(crate) released_in: crate::owner::ReleasedIn,
}

/// What kind of hold a [`Hold`] is.
#[derive(Clone, Debug, Default)]
pub(crate) enum HoldKind {
    /// An exclusive lock of its key.
    #[default]
    Lock,
    /// One of several holds that share the key's row (a read hold, `read.rs`): the row's
    /// owner ([`Hold::owner`]) is the kind's marker, the member knows its own owner, and its
    /// kind gives it back with a statement of its own.
    Member(std::sync::Arc<dyn Member>),
    /// A permit of the semaphore of this key (the key users know; the row is one of its slots,
    /// `semaphore.rs`).
    Permit(std::sync::Arc<str>),
}

impl HoldKind {
    /// Whether `release_in`'s one `UPDATE` of the hold's row releases it: an exclusive lock's
    /// or a permit's, not a member's (the members share the row; a member's release is its
    /// kind's own statement).
    pub(crate) fn releases_in_tx(&self) -> bool {
        !matches!(self, HoldKind::Member(_))
    }
}

/// A hold that shares its key's row with others of its kind ([`HoldKind::Member`]),
/// implemented by the kind (`read.rs`): the core tracks, renews and releases it as any hold,
/// and asks the kind only what differs.
pub(crate) trait Member: std::fmt::Debug + Send + Sync {
    /// The owner that holds it (the row's owner is the kind's marker).
    fn owner(&self) -> &Owner;

    /// Gives the hold back with the kind's own statement; the same answers as a lock's
    /// release.
    fn release<'a>(&'a self, giving: Giving<'a>) -> Releasing<'a>;
}

/// What a [`Member`]'s release is given: its hold, the outcome to record, and the core's
/// resends and deadline (`policy`).
pub(crate) struct Giving<'a> {
    pub(crate) backend: &'a Backend,
    pub(crate) hold: &'a Hold,
    pub(crate) outcome: Option<Outcome>,
    pub(crate) policy: Policy,
    /// The locker's statement time-out: the bound of a check after a lost reply.
    pub(crate) statement_timeout: Duration,
}

/// A [`Member`]'s release under way.
pub(crate) type Releasing<'a> =
    Pin<Box<dyn Future<Output = Result<Released, LockError>> + Send + 'a>>;

/// The code that called `lock()`: its tokio task, or — for the future a runtime's `block_on`
/// drives, which is no task — its thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Caller {
    Task(tokio::task::Id),
    Thread(std::thread::ThreadId),
}

impl Caller {
    pub(crate) fn current() -> Self {
        match tokio::task::try_id() {
            Some(id) => Caller::Task(id),
            None => Caller::Thread(std::thread::current().id()),
        }
    }
}

/// What changes while the hold lives.
struct Lease {
    /// Lease end on the database clock, as of the last acquire or extend (µs since the epoch).
    expires_at_us: i64,
    /// Past this the lease may have ended: send time of the acquire (or of the last successful
    /// extension) plus the ttl, on the local monotonic clock.
    deadline: Instant,
    /// Renewal: when the next extension is due.
    due: Instant,
    /// Renewal: statements in a row that failed for it.
    failures: u32,
    /// `max_hold`, and the local instant it ends at (the acquire's send time plus `max_hold`,
    /// never later than `acquired_at + max_hold` on the database clock): renewal stops there,
    /// and every extension statement caps the lease at `acquired_at + max_hold` itself.
    cap: Option<(Duration, Instant)>,
}

impl Hold {
    /// A hold granted by an acquire statement sent at `sent`.
    pub(crate) fn new(
        key: String,
        owner: Owner,
        grant: Grant,
        ttl: Duration,
        sent: Instant,
        meter: meter::Label,
    ) -> Self {
        Hold {
            key,
            kind: HoldKind::Lock,
            owner,
            fencing_token: grant.fencing_token,
            hold_count: grant.hold_count,
            ttl,
            lease: Mutex::new(Lease {
                expires_at_us: grant.expires_at_us,
                deadline: sent + ttl,
                due: sent + ttl / 3,
                failures: 0,
                cap: None,
            }),
            lost: AtomicBool::new(false),
            lost_signal: Notify::new(),
            revoked: AtomicBool::new(false),
            settled: AtomicBool::new(false),
            caller: Caller::current(),
            meter,
            granted: Instant::now(),
            sent,
            lock_delay: std::sync::atomic::AtomicU64::new(0),
            released_in: Default::default(),
        }
    }

    /// Sets the hold's lock-delay (see [`lock_delay`](Self::lock_delay)).
    pub(crate) fn delay(&self, lock_delay: Duration) {
        let us = lock_delay.as_micros().min(u64::MAX as u128) as u64;
        self.lock_delay.store(us, Ordering::Relaxed);
    }

    /// What every extension of the hold adds to the lease it asks the database for.
    pub(crate) fn lock_delay(&self) -> Duration {
        Duration::from_micros(self.lock_delay.load(Ordering::Relaxed))
    }

    /// Caps the hold at `max_hold` after its acquisition: renewal and `extend` never make its
    /// lease outlive that.
    pub(crate) fn cap(&self, max_hold: Option<Duration>) {
        if let Some(max_hold) = max_hold {
            self.lease().cap = Some((max_hold, crate::timing::after(self.sent, max_hold)));
        }
    }

    /// The hold's `max_hold` in µs for an extension statement ([`NO_CAP_US`] for none).
    ///
    /// [`NO_CAP_US`]: crate::backend::NO_CAP_US
    pub(crate) fn max_hold_us(&self) -> i64 {
        if matches!(self.kind, HoldKind::Member(_)) {
            // The row's `acquired_at` is the shared phase's, not this member's: a cap counted
            // from it would cut a member that joined late short. The member's own cap holds
            // anyway: no extension asks past it ([`extension`](Self::extension)).
            return crate::backend::NO_CAP_US;
        }
        // The key stays unavailable `lock_delay` past the cap too.
        let cap = self.lease().cap;
        cap.map_or(crate::backend::NO_CAP_US, |(d, _)| {
            d.saturating_add(self.lock_delay())
                .as_micros()
                .min(crate::backend::NO_CAP_US as u128) as i64
        })
    }

    /// The longest extension sent at `now` may ask for, up to `ttl`: what is left before the
    /// cap, or `None` once nothing is (the lease then simply ends, and the hold is lost).
    pub(crate) fn extension(&self, now: Instant, ttl: Duration) -> Option<Duration> {
        match self.lease().cap {
            None => Some(ttl),
            Some((_, cap)) => {
                let left = cap.saturating_duration_since(now);
                (left >= Duration::from_millis(1)).then(|| ttl.min(left))
            }
        }
    }

    /// Renewal reached the cap: nothing more to extend; the lease ends at its deadline.
    pub(crate) fn capped_out(&self) {
        self.lease().due = Instant::now() + Duration::from_secs(3600);
        meter::max_hold_reached(&self.meter);
    }

    /// The same grant as a hold of another kind.
    pub(crate) fn of_kind(mut self, kind: HoldKind) -> Self {
        self.kind = kind;
        self
    }

    /// The member, for a hold that shares its row ([`HoldKind::Member`]).
    pub(crate) fn member(&self) -> Option<&dyn Member> {
        match &self.kind {
            HoldKind::Member(member) => Some(&**member),
            _ => None,
        }
    }

    fn lease(&self) -> MutexGuard<'_, Lease> {
        lock(&self.lease)
    }

    /// The parameters of an owner-checked statement on this hold.
    pub(crate) fn as_ref(&self) -> HoldRef<'_> {
        HoldRef {
            key: &self.key,
            owner: self.owner.id(),
            fencing_token: self.fencing_token,
        }
    }

    /// What `dblock::current()` reports inside a locked body; `table` is the lock table's,
    /// `simple` whether its fence goes as a simple query (PostgreSQL behind a pooler).
    pub(crate) fn held_lock(&self, table: &str, simple: bool) -> HeldLock {
        HeldLock {
            key: self.name().to_owned(),
            row_key: self.key.as_str().into(),
            fencing_token: self.fencing_token,
            hold_count: self.hold_count,
            expires_at: time_from_micros(self.expires_at_us()),
            table: table.into(),
            owner: self.owner.shared_id(),
            simple,
            exclusive: matches!(self.kind, HoldKind::Lock),
            in_tx: false,
            releasable: self.hold_count == 1 && self.kind.releases_in_tx(),
            released_in: self.released_in.clone(),
        }
    }

    /// The key users know the hold by: a permit's semaphore key, else the row's.
    pub(crate) fn name(&self) -> &str {
        match &self.kind {
            HoldKind::Permit(semaphore) => semaphore,
            _ => &self.key,
        }
    }

    pub(crate) fn expires_at_us(&self) -> i64 {
        self.lease().expires_at_us
    }

    pub(crate) fn deadline(&self) -> Instant {
        self.lease().deadline
    }

    /// When renewal should next extend it.
    pub(crate) fn due(&self) -> Instant {
        self.lease().due
    }

    /// An extension for `ttl` sent at `sent` succeeded (with the database's new lease end when
    /// the statement reports it): the deadline moves, never back.
    pub(crate) fn extended(&self, sent: Instant, ttl: Duration, expires_at_us: Option<i64>) {
        let mut lease = self.lease();
        lease.deadline = lease.deadline.max(sent + ttl);
        lease.due = sent + ttl / 3;
        lease.failures = 0;
        if let Some(us) = expires_at_us {
            lease.expires_at_us = us;
        }
    }

    /// A renewal statement failed at `now`: once the lease may have ended the hold is lost;
    /// until then it is due again after a pause that leaves a few tries in the lease.
    pub(crate) fn renewal_failed(&self, now: Instant) {
        let mut lease = self.lease();
        lease.failures += 1;
        if now >= lease.deadline {
            lease.due = now + Duration::from_secs(3600);
            drop(lease);
            self.mark_lost();
            return;
        }
        let left = lease.deadline - now;
        let pause = Duration::from_millis(50 * u64::from(lease.failures.min(20))).min(left / 3);
        lease.due = now + pause.max(Duration::from_millis(10));
    }

    /// Renewal found the row no longer this tenure's: a definite answer.
    pub(crate) fn renewal_refused(&self, now: Instant) {
        self.lease().due = now + Duration::from_secs(3600);
        self.mark_lost();
    }

    /// An operator freed the hold's row (`force_release`, `steal`) in this process: it is lost
    /// now, not at its next renewal or the end of its lease.
    pub(crate) fn taken_away(&self) {
        self.renewal_refused(Instant::now());
    }

    /// `Locker::shutdown` takes the hold away (and releases it): it is lost, and whoever holds
    /// the guard has nothing left to release. `false` if it was already revoked.
    pub(crate) fn revoke(&self) -> bool {
        let first = !self.revoked.swap(true, Ordering::SeqCst);
        self.mark_lost();
        first
    }

    pub(crate) fn is_revoked(&self) -> bool {
        self.revoked.load(Ordering::SeqCst)
    }

    /// Resolves when `Locker::shutdown` has taken the hold away and its release is over (never
    /// otherwise): whoever hears of it may exit the process at once.
    pub(crate) async fn revoked(&self) {
        loop {
            let signal = self.lost_signal.notified();
            if self.is_revoked() {
                return self.settled().await;
            }
            signal.await;
        }
    }

    /// Resolves at the hold's `max_hold` cap (the local instant above), counted as renewal
    /// counts it ([`capped_out`](Self::capped_out)); never for a hold without one.
    pub(crate) async fn cap_reached(&self) {
        let cap = self.lease().cap;
        match cap {
            Some((_, at)) => {
                tokio::time::sleep_until(at).await;
                meter::max_hold_reached(&self.meter);
            }
            None => std::future::pending().await,
        }
    }

    /// The shutdown's release of this (revoked) hold is over: done, or failed and logged.
    pub(crate) fn settle(&self) {
        self.settled.store(true, Ordering::SeqCst);
        self.lost_signal.notify_waiters();
    }

    /// Resolves once [`settle`](Self::settle) was called.
    pub(crate) async fn settled(&self) {
        loop {
            let signal = self.lost_signal.notified();
            if self.settled.load(Ordering::SeqCst) {
                return;
            }
            signal.await;
        }
    }

    fn mark_lost(&self) {
        if !self.lost.swap(true, Ordering::SeqCst) {
            tracing::warn!(key = %crate::Escaped(self.name()), fencing_token = self.fencing_token, "lease lost");
            meter::lost(&self.meter);
        }
        self.lost_signal.notify_waiters();
    }

    /// The holder gave the hold up (a resigned or dropped leadership): lost from now on,
    /// without the warning of a lease lost by surprise.
    pub(crate) fn give_up(&self) {
        self.lost.store(true, Ordering::SeqCst);
        self.lost_signal.notify_waiters();
    }

    /// Whether the hold is marked lost or its lease may end within `margin` (by the local
    /// deadline): a leadership's end (`leader.rs`), which must come before the key can be free.
    pub(crate) fn lost_within(&self, margin: Duration) -> bool {
        self.lost.load(Ordering::SeqCst) || Instant::now() + margin >= self.deadline()
    }

    /// The end of a leadership (`leader.rs`): resolves as soon as the hold is marked lost
    /// (taken, revoked by a shutdown, given up) or its lease may end within `margin`, so never
    /// after the lease could have ended on the database clock. Unlike [`lost`](Self::lost) it
    /// does not wait for a shutdown's release: the leader must stop before the key is free.
    pub(crate) async fn ending(&self, margin: Duration) {
        loop {
            let signal = self.lost_signal.notified();
            if self.lost_within(margin) {
                return;
            }
            let until = self
                .deadline()
                .checked_sub(margin)
                .unwrap_or_else(Instant::now);
            tokio::select! {
                () = signal => {}
                () = tokio::time::sleep_until(until) => {}
            }
        }
    }

    /// `true` once the lock is known lost (renewal found it gone) or its lease may have ended.
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst) || Instant::now() >= self.deadline()
    }

    /// Resolves when the lock is lost: renewal finds it gone, or the deadline (which renewal
    /// and `extend` keep moving) passes, or a shutdown took it (once its release is over).
    pub(crate) async fn lost(&self) {
        loop {
            let signal = self.lost_signal.notified();
            if self.lost.load(Ordering::SeqCst) {
                if self.is_revoked() {
                    self.settled().await;
                }
                return;
            }
            let deadline = self.deadline();
            tokio::select! {
                () = signal => {}
                () = tokio::time::sleep_until(deadline) => {
                    if Instant::now() >= self.deadline() {
                        self.mark_lost();
                        return;
                    }
                }
            }
        }
    }
}
