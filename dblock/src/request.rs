//! [`LockRequest`], one `locker.lock(key)` call: the builder, and the wait loop behind its
//! `.await` (attempts, backoff, wake-ups, the deadline).
//!
//! Cancellation safety lives here: each acquire statement runs inline, in the caller's own
//! task (a [`Detached`] future). Only if the `lock()` future is dropped while a statement is in
//! flight does the rest of that statement finish in a task of its own, which then gives back a
//! grant nobody received; so a dropped `lock()` future never orphans a hold.

use std::borrow::Cow;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use crate::backend::shared::{Intent, Withdraw, INTENT_LEASE};
use crate::backend::{Acquire, Attempt, Interest};
use crate::detach::{Detached, Unreceived};
use crate::error::LockError;
use crate::fair::{Fair, Place};
use crate::guard::LockGuard;
use crate::hold::{Caller, Hold};
use crate::info::time_from_micros;
use crate::line;
use crate::meter;
use crate::owner::{Context, Owner};
use crate::retry::{self, LastFailure, Policy};
use crate::shared::{Serial, Shared};
use crate::validate;

/// The lease length when none is given.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// First and largest pause between attempts while waiting for a busy key.
const FIRST_BACKOFF: Duration = Duration::from_millis(5);
const MAX_BACKOFF: Duration = Duration::from_millis(250);
/// "As long as it takes": what `wait(Duration::MAX)` means (no `Instant` overflow).
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
/// An attempt that `wait` cannot cover (`wait` shorter than this) may still take this long: one
/// round trip needs some time, and `wait = 0` means "one attempt", not "none".
pub(crate) const ATTEMPT_FLOOR: Duration = Duration::from_secs(1);
/// A grant is returned only while its lease has at least this share of its ttl left (by the
/// local monotonic clock, counted from the send): at most [`MAX_MARGIN`].
const MARGIN_DIVISOR: u32 = 10;
const MAX_MARGIN: Duration = Duration::from_secs(1);
/// How often a waiting writer looks whether readers hold the key, and renews its intent
/// (`backend/shared.rs`) while they do: well within the intent's lease.
const INTENT_EVERY: Duration = Duration::from_millis(400);
/// How long past its deadline a call waits for its last attempt's own answer (an error that
/// names the cause), before it reports "no answer".
const ANSWER_GRACE: Duration = Duration::from_millis(50);

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
    shared: Arc<Shared>,
    key: String,
    ttl: Duration,
    wait: Duration,
    owner: Option<Owner>,
    label: Option<String>,
    min_hold: Duration,
    once: bool,
    fair: bool,
    metrics_key: Option<Cow<'static, str>>,
    /// `false` for one key of a `lock_all` call, which reports the call as a whole.
    record_call: bool,
    /// The `kind` label of its metrics: `"lock"`, or what the call is part of.
    kind: &'static str,
}

impl LockRequest {
    pub(crate) fn new(shared: Arc<Shared>, key: String) -> Self {
        LockRequest {
            shared,
            key,
            ttl: DEFAULT_TTL,
            wait: Duration::ZERO,
            owner: None,
            label: None,
            min_hold: Duration::ZERO,
            once: false,
            fair: false,
            metrics_key: None,
            record_call: true,
            kind: "lock",
        }
    }

    /// The `key` label of this call's metrics (feature `metrics`): a template such as
    /// `"order:{id}"` that names a family of keys, never the key itself unless the set of keys
    /// is small, so the number of metric series stays bounded. Default `(handle)`; the
    /// attribute passes its key template. Without the `metrics` feature it does nothing.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker, id: u64) -> Result<(), dblock::LockError> {
    /// let guard = locker.lock(format!("order:{id}")).metrics_key("order:{id}").await?;
    /// # Ok(()) }
    /// ```
    pub fn metrics_key(mut self, template: impl Into<Cow<'static, str>>) -> Self {
        self.metrics_key = Some(template.into());
        self
    }

    /// The attempt of another kind of hold built on the lock (`"permit"`, `"leader"`), as its
    /// metrics are labelled.
    pub(crate) fn kind(mut self, kind: &'static str) -> Self {
        self.kind = kind;
        self
    }

    /// One key of a `lock_all` call, labelled as the call; `alone`: the call's only key, which
    /// then reports the call (a call of several keys reports itself).
    pub(crate) fn part_of(mut self, metrics_key: Option<&Cow<'static, str>>, alone: bool) -> Self {
        self.metrics_key = metrics_key.cloned();
        self.record_call = alone;
        self
    }

    /// Keeps the key unavailable to every other owner until this long after it was acquired
    /// (database clock), even if it is released sooner: a job started on every instance each
    /// period runs once a period, not once per instance (ShedLock's "lock at least for"). The
    /// holder's own release still returns at once. The lease is at least this long, so a
    /// crashed holder's key waits for it too. Default: none.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// use std::time::Duration;
    /// // Every instance tries each minute; one runs the report, the others find it busy.
    /// if let Ok(guard) = locker.lock("report").min_hold(Duration::from_secs(50)).await {
    ///     // ... the report ...
    ///     guard.release().await?; // the key stays unavailable until 50 s after it was taken
    /// }
    /// # Ok(()) }
    /// ```
    pub fn min_hold(mut self, min_hold: Duration) -> Self {
        self.min_hold = min_hold;
        self
    }

    /// Runs the work until it succeeds once: a key whose last hold ended in success (released
    /// with [`LockGuard::release`]) is not acquired again; the call returns
    /// [`LockError::AlreadyDone`]. After a failure ([`LockGuard::release_failed`], a dropped
    /// guard, a lease that ran out) it can be acquired again. [`Locker::reset`](crate::Locker::reset)
    /// makes a done key runnable again, and [`Locker::purge`](crate::Locker::purge) never deletes
    /// a done key's record.
    ///
    /// The release records the success after the work: a crash in between runs the work again
    /// (at-least-once). For work in the lock's own database, record the success in the work's
    /// own transaction with [`LockGuard::succeed_in`]: then it is exactly-once.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// match locker.lock("payout:42").once().await {
    ///     Ok(guard) => guard.release().await?, // ... pay, then record the success ...
    ///     Err(dblock::LockError::AlreadyDone { .. }) => {} // paid before
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn once(mut self) -> Self {
        self.once = true;
        self
    }

    /// Waits in arrival order across processes: callers of one key that use `fair()` get it
    /// first come, first served, whichever process they run in (without it, arrival order
    /// holds among the waiters of one process, and across processes whoever asks first after
    /// a release wins).
    ///
    /// A fair caller first reads the key's queue (a table beside the lock table, created by
    /// [`Locker::migrate`](crate::Locker::migrate)): if nobody is queued it attempts at once;
    /// if the key is busy, or others are queued, it takes a ticket and attempts only once every
    /// earlier ticket is gone. The cost: one more read per call, and under contention a ticket
    /// written and deleted per waiter (the benchmark shows the hand-off figures). A ticket is a
    /// lease of 5 s, renewed while its caller waits: a waiter that dies holds the queue up for
    /// at most that long. With `wait` zero (one attempt), a fair call finds the key busy as
    /// long as others are queued for it.
    ///
    /// Fairness holds among callers that use it: a call without `fair()` does not read the
    /// queue and can take a free key ahead of it. A re-entry (the owner holds the key) never
    /// queues. Mutual exclusion never depends on the queue: it only orders the attempts.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// use std::time::Duration;
    /// let guard = locker.lock("printer").fair().wait(Duration::from_secs(30)).await?;
    /// # Ok(()) }
    /// ```
    pub fn fair(mut self) -> Self {
        self.fair = true;
        self
    }

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
        self.label = Some(label.into());
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
                .clone()
                .or_else(|| Context::get().map(|c| c.owner))
                .unwrap_or_default();
            let span = tracing::debug_span!(
                "dblock.lock",
                key = %self.key,
                backend = self.shared.backend_name(),
                owner = %owner,
                ttl_ms = self.ttl.as_millis() as u64,
                wait_ms = self.wait.as_millis() as u64,
            );
            async move {
                let (shared, request) = self.resolve(owner)?;
                request.acquire(shared).await
            }
            .instrument(span)
            .await
        })
    }
}

impl LockRequest {
    /// Checks the call (runtime, locker open, key, ttl, min_hold, backend) and resolves it into
    /// what every attempt sends.
    fn resolve(self, owner: Owner) -> Result<(Arc<Shared>, Request), LockError> {
        LockError::require_runtime()?;
        self.shared.check_open()?;
        validate::key(&self.key)?;
        let request = Request {
            meter: meter::Label::new(
                self.metrics_key.as_ref(),
                self.shared.backend_name(),
                self.kind,
            ),
            record_call: self.record_call,
            ttl_us: validate::ttl_micros(self.ttl)?,
            min_hold_us: validate::min_hold_micros(self.min_hold)?,
            min_hold: self.min_hold,
            once: self.once,
            fair: self.fair,
            caller: Caller::current(),
            holder: self.shared.holder_for(self.label.as_deref()).into(),
            key: self.key,
            ttl: self.ttl,
            wait: self.wait,
            owner,
        };
        self.shared.backend()?;
        Ok((self.shared, request))
    }
}

/// What one attempt at several keys in one statement ([`try_all`]) came to.
pub(crate) enum AllTry {
    /// The keys taken, live, from the first in order: all of them, or a prefix (the rest, from
    /// the first key not taken, were busy, raced, or arrived too late and were given back). A
    /// dialect without such a statement takes none.
    Prefix(Vec<LockGuard>),
    Failed(LockError),
}

/// One attempt at every key of `requests` (one owner, sorted by key, distinct) in one
/// statement, where the dialect has one: a lock cycle on n free keys costs one round trip.
///
/// Keeps the keys taken up to the first one not taken, as a wait in key order would, and gives
/// back the others (unused: no outcome recorded) before it answers, so that nothing taken out of
/// order stays behind. Like [`Request::try_once`], it runs to completion in a task of its own: a
/// caller that goes away leaves guards nobody receives, which dropping releases.
pub(crate) async fn try_all(
    requests: Vec<LockRequest>,
    owner: &Owner,
    call_until: Instant,
) -> AllTry {
    let mut resolved = Vec::with_capacity(requests.len());
    let mut shared = None;
    for r in requests {
        match r.resolve(owner.clone()) {
            Ok((s, req)) => {
                shared = Some(s);
                resolved.push(req);
            }
            Err(e) => return AllTry::Failed(e),
        }
    }
    let Some(shared) = shared else {
        return AllTry::Prefix(Vec::new());
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let owner = owner.clone();
    tokio::spawn(
        async move {
            let sent = Instant::now();
            let longest = resolved
                .iter()
                .map(Request::lease)
                .max()
                .unwrap_or_default();
            let policy = Policy {
                rolled_back: retry::ROLLBACK_RESENDS,
                per_send: shared.statement_timeout,
                send_until: call_until,
                resolve_until: sent + longest + shared.statement_timeout,
                report: None,
            };
            // One id per key of this attempt, the same in each resend (see `try_once`).
            let statements: Vec<Acquire<'_>> = resolved
                .iter()
                .map(|r| r.statement(false, fastrand::i64(1..i64::MAX)))
                .collect();
            let (tried, serials) = match shared.acquire_all(&owner, statements, policy).await {
                Ok(answer) => answer,
                Err(e) => {
                    let _ = tx.send(AllTry::Failed(e));
                    return;
                }
            };
            let attempts = match tried.result {
                Ok(Some(attempts)) => attempts,
                Ok(None) => {
                    let _ = tx.send(AllTry::Prefix(Vec::new()));
                    return;
                }
                Err(failed) => {
                    let _ = tx.send(AllTry::Failed(LockError::database(
                        failed.error,
                        tried.after_unknown,
                        "acquire of several keys",
                    )));
                    return;
                }
            };
            let mut kept = Vec::new();
            let mut give_back = Vec::new();
            // Set at the first key not taken (or taken too late): every key after it goes back.
            let mut gap = false;
            for ((req, attempt), serial) in resolved.into_iter().zip(attempts).zip(serials) {
                let Attempt::Acquired(grant) = attempt else {
                    gap = true;
                    continue;
                };
                let lease = req.lease();
                let mut hold = Hold::new(req.key, req.owner, grant, lease, sent, req.meter);
                hold.caller = req.caller;
                let margin = (lease / MARGIN_DIVISOR).min(MAX_MARGIN);
                if !gap && Instant::now() + margin < hold.deadline() {
                    kept.push((hold, serial));
                } else {
                    gap = true;
                    give_back.push((hold, serial));
                }
            }
            // Given back under the owner's serialisation of each key, before the caller goes on
            // to take the rest one by one.
            for (hold, mut serial) in give_back {
                let until = hold.deadline().max(Instant::now()) + shared.statement_timeout;
                let _ = shared
                    .release_serialised(&hold, &mut serial, None, until)
                    .await;
            }
            // Every hold becomes a guard. Shut down meanwhile: the holds refused are given back
            // here, those taken before it are `shutdown`'s to release (it waits for their
            // serialisations, so those go first); the call hears `ShutDown` once all are back.
            let (holds, mut serials): (Vec<Hold>, Vec<Serial>) = kept.into_iter().unzip();
            let mut guards = Vec::with_capacity(holds.len());
            let mut refused = false;
            for (hold, serial) in holds.into_iter().zip(serials.iter_mut()) {
                match LockGuard::new(hold, shared.clone()) {
                    Ok(guard) => guards.push(guard),
                    Err(r) => {
                        refused = true;
                        r.give_back(Some(serial)).await;
                    }
                }
            }
            if refused {
                drop(serials);
                for guard in &guards {
                    guard.shutdown_settled().await;
                }
                drop(guards);
                let _ = tx.send(AllTry::Failed(LockError::ShutDown));
                return;
            }
            // Handed over under the owner's serialisations (see `try_once`): if nobody receives
            // them, they are given back before any other statement of the owner on their keys.
            if let Err(AllTry::Prefix(guards)) = tx.send(AllTry::Prefix(guards)) {
                for (guard, serial) in guards.into_iter().zip(&mut serials) {
                    guard.give_back_unreceived(serial).await;
                }
            }
        }
        .in_current_span(),
    );
    rx.await
        .unwrap_or_else(|_| AllTry::Failed(LockError::Database(sqlx::Error::WorkerCrashed)))
}

/// A `lock()` call, resolved and validated: what every attempt of it sends.
#[derive(Clone)]
struct Request {
    key: String,
    ttl: Duration,
    ttl_us: i64,
    min_hold: Duration,
    min_hold_us: i64,
    once: bool,
    /// Wait in the key's queue across processes (`fair.rs`).
    fair: bool,
    /// The task (or `block_on` thread) that called `lock()`.
    caller: Caller,
    wait: Duration,
    owner: Owner,
    /// `host/pid[/label]`.
    holder: Arc<str>,
    meter: meter::Label,
    record_call: bool,
}

/// The outcome of one attempt, with the lock already inside a guard.
enum Try {
    Got(LockGuard),
    Busy(Option<Duration>),
    /// Granted, but the reply came when the lease could have ended already: given back.
    Stale,
    Failed(LockError),
}

/// What the attempts answered so far, for the error when the call's time runs out.
#[derive(Clone, Copy, PartialEq)]
enum Seen {
    Nothing,
    Busy,
    Stale,
}

impl Request {
    /// The statement's binds, borrowed from the request (the tracked holds are filled in under
    /// the owner's serialisation).
    fn statement(&self, waiting: bool, attempt: i64) -> Acquire<'_> {
        Acquire {
            key: &self.key,
            owner: self.owner.id(),
            ttl_us: self.ttl_us,
            holder: &self.holder,
            attempt,
            waiting,
            tenure: None,
            held: 0,
            min_hold_us: self.min_hold_us,
            once: self.once,
        }
    }

    /// The lease a grant gets: the ttl, or min_hold if that is longer.
    fn lease(&self) -> Duration {
        self.ttl.max(self.min_hold)
    }

    /// Takes the lock: attempts until granted or `wait` runs out. The call returns by
    /// `max(wait, one attempt's floor)` whatever the database does; an attempt still in flight
    /// then goes on in the background, and a lock it gets is given back at once.
    async fn acquire(self, shared: Arc<Shared>) -> Result<LockGuard, LockError> {
        let started = Instant::now();
        let mut first_busy = None;
        let (meter, record) = (self.meter.clone(), self.record_call);
        let (key, owner) = (self.key.clone(), self.owner.clone());
        let mut intent = false;
        let result = self
            .wait_for(shared.clone(), started, &mut first_busy, &mut intent)
            .await;
        if intent && result.is_err() {
            // A writer that gives up withdraws its intent: readers need not wait it out.
            if let Ok(backend) = shared.backend() {
                let (backend, timeout) = (backend.clone(), shared.statement_timeout);
                tokio::spawn(async move {
                    let withdraw = Withdraw {
                        key: &key,
                        owner: owner.id(),
                    };
                    let _ = backend.run(&withdraw, Instant::now() + timeout).await;
                });
            }
        }
        if record {
            meter::call_ended(
                &meter,
                meter::CallOutcome::of(&result),
                started.elapsed(),
                first_busy.map(|t: Instant| t.elapsed()),
            );
        }
        result
    }

    /// The wait loop of [`acquire`](Self::acquire); notes when the key was first found busy.
    async fn wait_for(
        self,
        shared: Arc<Shared>,
        started: Instant,
        first_busy: &mut Option<Instant>,
        intent: &mut bool,
    ) -> Result<LockGuard, LockError> {
        // When this writer last recorded (or looked to record) its intent on a read-held key,
        // and whether it holds it.
        let mut intent_at: Option<Instant> = None;
        let wait_until = started + self.wait.min(FOREVER);
        let call_until = wait_until.max(started + ATTEMPT_FLOOR.min(shared.statement_timeout));
        let mut backoff = FIRST_BACKOFF;
        let mut attempts = 0u32;
        let mut seen = Seen::Nothing;
        // The latest failure of an attempt, for an error at the deadline that names the cause.
        let report = LastFailure::default();
        // Set once this call waits where the backend can wake it (PostgreSQL LISTEN/NOTIFY).
        let mut interest: Option<Interest> = None;
        // This call's place at the head of the process's line for the key (`line.rs`), taken
        // once the key was found busy: only the head asks the database.
        let mut turn: Option<line::Turn> = None;
        // A fair call's place in the key's queue in the database (`fair.rs`); a re-entry never
        // queues. Fair callers keep to the queue's order instead of the process's line.
        let mut fair = (self.fair && !shared.held_by_owner(&self.key, &self.owner))
            .then(|| Fair::new(shared.clone(), &self.key, self.owner.id()));
        // The process's line for the key: looked up only when the key is busy, or when others
        // already wait in it (a lone caller never touches the lines' map).
        let mut line = if fair.is_none() {
            line::waiting(shared.space(), &self.key)
        } else {
            None
        };
        let mut last_place = Place::Behind(1);
        if let Some(l) = &line {
            if !shared.held_by_owner(&self.key, &self.owner) {
                // Earlier waiters of this process are in line: a newcomer goes behind them
                // rather than ahead with an attempt of its own (with no wait, the key is busy
                // for it).
                tracing::trace!("in line behind earlier waiters before the first attempt");
                match tokio::time::timeout_at(wait_until, l.turn()).await {
                    Ok(head) => turn = Some(head),
                    Err(_) => return Err(self.gave_up(Seen::Busy, started.elapsed())),
                }
            }
        }
        loop {
            // A locker shut down while this call waits: no further attempt.
            shared.check_open()?;
            // A fair caller attempts only when nobody live is queued ahead of it.
            let place = match &mut fair {
                None => Place::Head,
                Some(f) => match tokio::time::timeout_at(call_until, Box::pin(f.place())).await {
                    Ok(place) => place?,
                    Err(_) => {
                        return Err(self.gave_up_unanswered(seen, started.elapsed(), &report))
                    }
                },
            };
            match place {
                // Behind others in a fair queue: the pause is set by the place (see `Place`).
                Place::Behind(ahead) => {
                    backoff = (FIRST_BACKOFF * (1 << (ahead - 1))).min(MAX_BACKOFF)
                }
                // Just at the head of a fair queue: ask soon again from there.
                Place::Head if fair.is_some() && last_place != Place::Head => {
                    backoff = FIRST_BACKOFF
                }
                Place::Head => {}
            }
            last_place = place;
            let may_try = place == Place::Head;
            let outcome = if may_try {
                attempts += 1;
                let attempt = self.try_once(&shared, interest.is_some(), call_until, &report);
                // The attempt stops sending at `call_until`; a moment more lets it say why.
                match tokio::time::timeout_at(call_until + ANSWER_GRACE, attempt).await {
                    Ok(attempted) => attempted.received(),
                    Err(_) => {
                        let waited = started.elapsed();
                        tracing::debug!(?waited, attempts, "no answer within the call's time");
                        return Err(self.gave_up_unanswered(seen, waited, &report));
                    }
                }
            } else {
                Try::Busy(None)
            };
            match outcome {
                Try::Got(guard) => {
                    if let Some(f) = fair.take() {
                        // Out of the queue; the next fair waiters of this process look at once.
                        Box::pin(f.leave()).await;
                        line::freed(shared.space(), &self.key);
                    }
                    tracing::debug!(
                        fencing_token = guard.fencing_token(),
                        hold_count = guard.hold_count(),
                        attempts,
                        "acquired"
                    );
                    return Ok(guard);
                }
                Try::Failed(e) => {
                    tracing::warn!(error = %e, "acquire failed");
                    return Err(e);
                }
                Try::Stale => {
                    seen = Seen::Stale;
                    if Instant::now() >= wait_until {
                        return Err(self.gave_up(seen, started.elapsed()));
                    }
                }
                Try::Busy(retry_after) => {
                    if seen == Seen::Nothing
                        && self.wait > Duration::ZERO
                        && shared.held_by_caller(&self.key, self.caller, &self.owner)
                    {
                        // Most likely a wait that can only end at its deadline: for itself. A
                        // warning, not an error: a concurrent future of the same task (join!,
                        // select!) may well release it, and a timeout stays `Busy`.
                        tracing::warn!(
                            key = %self.key,
                            "this task already holds the key through another owner and now waits for it: \
                             unless another future of this task releases it, the wait ends only at its deadline; \
                             to re-enter, take both under one owner (dblock::Owner::scope or .owner(&owner))"
                        );
                    }
                    seen = Seen::Busy;
                    let now = Instant::now();
                    if first_busy.is_none() && shared.read_tenure(&self.key, &self.owner).is_some()
                    {
                        // The owner reads the key: the writer would wait for itself.
                        return Err(LockError::WouldWaitForItself {
                            key: self.key.clone(),
                        });
                    }
                    first_busy.get_or_insert(now);
                    if may_try
                        && now < wait_until
                        && intent_at.is_none_or(|at| now >= at + INTENT_EVERY)
                    {
                        // Held by readers? Then record this writer's intent (renewed while it
                        // waits), so that readers who come later wait behind it.
                        let statement = Intent {
                            key: &self.key,
                            owner: self.owner.id(),
                            lease_us: INTENT_LEASE.as_micros() as i64,
                        };
                        let limit = (now + shared.statement_timeout).min(wait_until);
                        *intent =
                            matches!(shared.backend()?.run(&statement, limit).await, Ok(true))
                                || *intent;
                        intent_at = Some(now);
                    }
                    if now >= wait_until {
                        let waited = now - started;
                        tracing::debug!(?waited, attempts, "busy: giving up");
                        return Err(self.gave_up(seen, waited));
                    }
                    let line = line
                        .get_or_insert_with(|| line::of(shared.space(), &self.key))
                        .clone();
                    if let Some(f) = &mut fair {
                        if may_try {
                            // Busy on its own attempt: a ticket at the back of the queue.
                            match tokio::time::timeout_at(wait_until, Box::pin(f.queue_up())).await
                            {
                                Ok(queued) => queued?,
                                Err(_) => return Err(self.gave_up(seen, started.elapsed())),
                            }
                        }
                    } else if turn.is_none() {
                        if let Some(head) = line.try_turn() {
                            turn = Some(head);
                        } else {
                            // Earlier waiters of this process go first, in arrival order.
                            tracing::trace!("busy: in line behind earlier waiters");
                            match tokio::time::timeout_at(wait_until, line.turn()).await {
                                Ok(head) => {
                                    turn = Some(head);
                                    backoff = FIRST_BACKOFF;
                                    continue; // at the head: ask at once
                                }
                                Err(_) => return Err(self.gave_up(seen, started.elapsed())),
                            }
                        }
                    }
                    if interest.is_none() {
                        // Setting LISTEN up may take a connect: never past the call's deadline.
                        interest = tokio::time::timeout_at(
                            wait_until,
                            shared.backend()?.interest(&self.key),
                        )
                        .await
                        .ok()
                        .flatten();
                        if interest.is_some() {
                            continue; // ask again, now asking the holder to notify
                        }
                    }
                    // Jitter over the upper half of the step, so waiters spread out instead of
                    // arriving together; never past the holder's lease end or our deadline.
                    let jittered = backoff / 2 + backoff.mul_f64(fastrand::f64() / 2.0);
                    let mut pause = jittered.min(wait_until.saturating_duration_since(now));
                    if let Some(left) = retry_after {
                        pause = pause.min(left + Duration::from_millis(1));
                    }
                    tracing::trace!(?pause, "busy: waiting");
                    // A release by this process wakes the head of its line (or every fair
                    // waiter of the key, who look at the queue) at once.
                    let freed = async {
                        if turn.is_some() || fair.is_some() {
                            line.freed().await
                        } else {
                            std::future::pending().await
                        }
                    };
                    match &interest {
                        // Polling stays the fallback: a lost notification costs one pause.
                        Some(i) => {
                            tokio::select! {
                                () = i.notified() => tracing::trace!("woken by release"),
                                () = freed => tracing::trace!("woken by a release of this process"),
                                () = tokio::time::sleep(pause) => {}
                            }
                        }
                        None => {
                            tokio::select! {
                                () = freed => tracing::trace!("woken by a release of this process"),
                                () = tokio::time::sleep(pause) => {}
                            }
                        }
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// The error for a call whose time ran out while an attempt was still settling: as
    /// [`gave_up`](Self::gave_up), naming the attempt's latest failure when nothing else was
    /// heard (a refused or broken connection, not just "no answer").
    fn gave_up_unanswered(&self, seen: Seen, waited: Duration, report: &LastFailure) -> LockError {
        match (seen, report.get()) {
            (Seen::Nothing, Some((kind, cause))) => LockError::database(
                sqlx::Error::Io(std::io::Error::new(
                    kind,
                    format!("no answer from the database within {waited:?}; last failure: {cause}"),
                )),
                true,
                &format!("acquire of `{}`", self.key),
            ),
            _ => self.gave_up(seen, waited),
        }
    }

    /// The error for a call whose time ran out: busy if that is what the database last said, the
    /// lease ended before its grant arrived, or no answer at all (outcome unknown).
    fn gave_up(&self, seen: Seen, waited: Duration) -> LockError {
        match seen {
            Seen::Busy => LockError::Busy {
                key: self.key.clone(),
                waited,
            },
            Seen::Stale => LockError::Lost {
                key: self.key.clone(),
            },
            Seen::Nothing => LockError::database(
                sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer from the database within {waited:?}"),
                )),
                true,
                &format!("acquire of `{}`", self.key),
            ),
        }
    }

    /// One acquire attempt, polled by the caller and run to completion even if the caller goes
    /// away ([`Detached`]).
    ///
    /// If the caller's future is dropped (or its time runs out) while the statement is in
    /// flight, the statement still finishes (it is not left half-sent on a pooled connection,
    /// to run whenever that connection is next used), an unknown outcome is still resolved, and
    /// a lock it took is given back at once, under the owner's serialisation of the key (so a
    /// new call of the same owner never builds on it). So a cancelled `lock()` never orphans a
    /// hold.
    fn try_once(
        &self,
        shared: &Arc<Shared>,
        waiting: bool,
        call_until: Instant,
        report: &LastFailure,
    ) -> Detached<impl Future<Output = Attempted> + Send + 'static> {
        let (shared, req, report) = (shared.clone(), self.clone(), report.clone());
        Detached::new(async move {
            let sent = Instant::now();
            // One id per attempt, the same in each of its resends: a resend after an unknown
            // outcome recognises its own earlier success instead of counting the hold twice.
            // A later attempt of the call is a new statement with a new id, so it can never
            // be mistaken for a grant this attempt gave back.
            let attempt = fastrand::i64(1..i64::MAX);
            let policy = Policy {
                rolled_back: retry::ROLLBACK_RESENDS,
                per_send: shared.statement_timeout,
                // Nothing in doubt: worth trying while the caller waits.
                send_until: call_until,
                // An unknown outcome: resolved until the lease it may have written has
                // surely ended (the process no longer counts it by then either).
                resolve_until: sent + req.lease() + shared.statement_timeout,
                report: Some(report),
            };
            let (tried, serial) = shared
                .acquire(&req.owner, req.statement(waiting, attempt), policy)
                .await;
            let lease = req.lease();
            let outcome = match tried.result {
                Ok(Attempt::Acquired(grant)) => {
                    let mut hold = Hold::new(req.key, req.owner, grant, lease, sent, req.meter);
                    hold.caller = req.caller;
                    let margin = (lease / MARGIN_DIVISOR).min(MAX_MARGIN);
                    if Instant::now() + margin < hold.deadline() {
                        let mut serial = serial;
                        match LockGuard::new(hold, shared) {
                            // Handed over with the owner's serialisation still held: see
                            // `Attempted`.
                            Ok(guard) => return Attempted::got(guard, serial),
                            // Shut down meanwhile: given back before the caller hears it.
                            Err(refused) => Try::Failed(refused.give_back(serial.as_mut()).await),
                        }
                    } else {
                        // Its lease could be over by the time the caller used it: given back
                        // under the owner's serialisation, before any next attempt can reach
                        // the row (the caller hears at once; see `Attempted`).
                        tracing::warn!(key = %hold.key, "grant arrived when its lease could have ended; given back");
                        return Attempted {
                            outcome: Try::Stale,
                            serial,
                            stale: Some((hold, shared)),
                        };
                    }
                }
                Ok(Attempt::Busy { retry_after }) => Try::Busy(retry_after),
                Ok(Attempt::Done { finished_at_us }) => Try::Failed(LockError::AlreadyDone {
                    key: req.key.clone(),
                    finished_at: finished_at_us.map(time_from_micros),
                }),
                Err(failed) => Try::Failed(LockError::database(
                    failed.error,
                    tried.after_unknown,
                    &format!("acquire of `{}`", req.key),
                )),
            };
            Attempted {
                outcome,
                serial: None,
                stale: None,
            }
        })
    }
}

/// What one attempt came to. A grant comes with the owner's serialisation of the key, which the
/// receiver drops at once; if nobody receives it (the call was dropped, or gave up while the
/// attempt settled an unknown outcome), the grant is given back under it, before any other
/// statement of the owner on the key, so a new call of the same owner never builds on it.
/// A grant that came too late to be used ([`Try::Stale`]) is given back the same way.
struct Attempted {
    outcome: Try,
    serial: Option<Serial>,
    /// A stale grant, to give back under `serial`.
    stale: Option<(Hold, Arc<Shared>)>,
}

impl Attempted {
    fn got(guard: LockGuard, serial: Option<Serial>) -> Self {
        Attempted {
            outcome: Try::Got(guard),
            serial,
            stale: None,
        }
    }

    /// The outcome for the caller, who received it: a grant's serialisation is no longer
    /// needed; a stale grant is given back in a task of its own under it, so the caller hears
    /// at once (and its next attempt, serialised behind it, reaches the row after it).
    fn received(self) -> Try {
        if let Some((hold, shared)) = self.stale {
            if let Some(serial) = self.serial {
                tokio::spawn(give_back_stale(hold, shared, serial));
            }
        }
        self.outcome
    }
}

impl Unreceived for Attempted {
    async fn unreceived(self) {
        if let Some((hold, shared)) = self.stale {
            if let Some(serial) = self.serial {
                give_back_stale(hold, shared, serial).await;
            }
        } else if let Try::Got(guard) = self.outcome {
            tracing::debug!(key = %guard.key(), "granted to a call that is gone; given back");
            match self.serial {
                Some(mut serial) => guard.give_back_unreceived(&mut serial).await,
                None => drop(guard),
            }
        }
    }
}

/// Gives back a grant that arrived when its lease could have ended, under the owner's
/// serialisation of the key (no outcome: nothing ran under it).
async fn give_back_stale(hold: Hold, shared: Arc<Shared>, mut serial: Serial) {
    let until = hold.deadline().max(Instant::now()) + shared.statement_timeout;
    let _ = shared
        .release_serialised(&hold, &mut serial, None, until)
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The statement futures (sqlx's, several KB) live in boxes of their own (`exec::run`), so
    /// that what is moved into a task per attempt or release stays small: before, every
    /// spawned attempt copied about 10 KB several times (75 % of the client's instructions per
    /// lock cycle on PostgreSQL, by callgrind).
    #[tokio::test]
    async fn lock_call_futures_stay_small() {
        let locker = crate::Locker::connect("sqlite::memory:").await.unwrap();
        let shared = locker.shared().clone();
        let (shared, req) = LockRequest::new(shared, "k".into())
            .resolve(Owner::new())
            .unwrap();
        let backend = shared.backend().unwrap();
        let a = req.statement(false, 1);
        let hold = Hold::new(
            "k".into(),
            Owner::new(),
            crate::backend::Grant {
                hold_count: 1,
                fencing_token: 1,
                expires_at_us: 0,
            },
            Duration::from_secs(1),
            Instant::now(),
            req.meter.clone(),
        );
        let sizes = [
            (
                "Backend::acquire",
                std::mem::size_of_val(&backend.acquire(&a, Instant::now())),
            ),
            (
                "Backend::release",
                std::mem::size_of_val(&backend.release(&hold.as_ref(), 0, None, 1, Instant::now())),
            ),
            (
                "Shared::release",
                std::mem::size_of_val(&shared.release(&hold, None, Instant::now())),
            ),
            (
                "Request::acquire",
                std::mem::size_of_val(&req.clone().acquire(shared.clone())),
            ),
        ];
        for (what, size) in sizes {
            assert!(size <= 2048, "{what}: {size} bytes");
        }
    }

    /// A grant that arrives after `shutdown` collected the locker's holds is not handed out as
    /// a guard: the call fails with `ShutDown` and the hold is given back at once (failed).
    #[tokio::test]
    async fn a_grant_arriving_after_shutdown_is_given_back() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("l.db").display());
        let locker = crate::Locker::connect(&url).await.unwrap();
        locker.migrate().await.unwrap();
        let (shared, req) = LockRequest::new(locker.shared().clone(), "k".into())
            .resolve(Owner::new())
            .unwrap();
        // The statement of an attempt in flight...
        let sent = Instant::now();
        let (tried, serial) = shared
            .acquire(
                &req.owner,
                req.statement(false, 7),
                Policy::within(Duration::from_secs(5)),
            )
            .await;
        drop(serial);
        let Ok(Attempt::Acquired(grant)) = tried.result else {
            panic!("not granted: {:?}", tried.result.map(|_| ()))
        };
        // ...whose grant arrives once the locker is shut down.
        locker.shutdown().await;
        let hold = Hold::new(
            req.key.clone(),
            req.owner.clone(),
            grant,
            req.lease(),
            sent,
            req.meter.clone(),
        );
        let Err(refused) = LockGuard::new(hold, shared) else {
            panic!("a grant after shutdown was handed out")
        };
        assert!(matches!(refused.give_back(None).await, LockError::ShutDown));
        let other = crate::Locker::connect(&url).await.unwrap();
        let free = tokio::time::timeout(Duration::from_secs(2), async {
            loop {
                let info = other.inspect("k").await.unwrap().unwrap();
                if !info.held {
                    return info;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the late grant was never given back");
        assert_eq!(free.last_outcome, Some(crate::Outcome::Failed));
    }
}
