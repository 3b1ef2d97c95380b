//! [`LockRequest`], one `locker.lock(key)` call: the builder, and the wait loop behind its
//! `.await` (attempts, backoff, wake-ups, the deadline).
//!
//! Cancellation safety lives here: each acquire statement runs in a task of its own and its
//! result comes back as a guard, so a `lock()` future dropped while a statement is in flight
//! never orphans a hold (the unreceived guard is dropped, which releases it).

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use crate::backend::{Acquire, Attempt, Interest};
use crate::error::LockError;
use crate::guard::LockGuard;
use crate::hold::Hold;
use crate::owner::{Context, Owner};
use crate::shared::Shared;
use crate::validate;

/// The lease length when none is given.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// First and largest pause between attempts while waiting for a busy key.
const FIRST_BACKOFF: Duration = Duration::from_millis(5);
const MAX_BACKOFF: Duration = Duration::from_millis(250);
/// "As long as it takes": what `wait(Duration::MAX)` means (no `Instant` overflow).
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

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
        }
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
                LockError::require_runtime()?;
                validate::key(&self.key)?;
                let request = Request {
                    ttl_us: validate::ttl_micros(self.ttl)?,
                    holder: self.shared.holder_for(self.label.as_deref()).into(),
                    key: self.key,
                    ttl: self.ttl,
                    wait: self.wait,
                    owner,
                    attempt: fastrand::i64(1..i64::MAX),
                };
                self.shared.backend()?;
                request.acquire(self.shared).await
            }
            .instrument(span)
            .await
        })
    }
}

/// A `lock()` call, resolved and validated: what every attempt of it sends.
#[derive(Clone)]
struct Request {
    key: String,
    ttl: Duration,
    ttl_us: i64,
    wait: Duration,
    owner: Owner,
    /// `host/pid[/label]`.
    holder: Arc<str>,
    /// Random id of this call, the same in every statement it sends: a resend after an unknown
    /// outcome recognises its own earlier success instead of counting the hold twice.
    attempt: i64,
}

/// The outcome of one attempt, with the lock already inside a guard.
enum Try {
    Got(LockGuard),
    Busy(Option<Duration>),
}

impl Request {
    /// The statement's binds, borrowed from the request.
    fn statement(&self, waiting: bool) -> Acquire<'_> {
        Acquire {
            key: &self.key,
            owner: self.owner.id(),
            ttl_us: self.ttl_us,
            holder: &self.holder,
            attempt: self.attempt,
            waiting,
        }
    }

    /// Takes the lock: attempts until granted or `wait` runs out.
    async fn acquire(self, shared: Arc<Shared>) -> Result<LockGuard, LockError> {
        let started = Instant::now();
        let deadline = started + self.wait.min(FOREVER);
        let mut backoff = FIRST_BACKOFF;
        let mut attempts = 0u32;
        // Set once this call waits where the backend can wake it (PostgreSQL LISTEN/NOTIFY).
        let mut interest: Option<Interest> = None;
        loop {
            attempts += 1;
            match self.try_once(&shared, interest.is_some()).await {
                Ok(Try::Got(guard)) => {
                    tracing::debug!(
                        fencing_token = guard.fencing_token(),
                        hold_count = guard.hold_count(),
                        attempts,
                        "acquired"
                    );
                    return Ok(guard);
                }
                Ok(Try::Busy(retry_after)) => {
                    let now = Instant::now();
                    if now >= deadline {
                        let waited = now - started;
                        tracing::debug!(?waited, attempts, "busy: giving up");
                        return Err(LockError::Busy {
                            key: self.key,
                            waited,
                        });
                    }
                    if interest.is_none() {
                        interest = shared.backend()?.interest(&self.key).await;
                        if interest.is_some() {
                            continue; // ask again, now asking the holder to notify
                        }
                    }
                    // Jitter over the upper half of the step, so waiters spread out instead of
                    // arriving together; never past the holder's lease end or our deadline.
                    let jittered = backoff / 2 + backoff.mul_f64(fastrand::f64() / 2.0);
                    let mut pause = jittered.min(deadline - now);
                    if let Some(left) = retry_after {
                        pause = pause.min(left + Duration::from_millis(1));
                    }
                    tracing::trace!(?pause, "busy: waiting");
                    match &interest {
                        // Polling stays the fallback: a lost notification costs one pause.
                        Some(i) => {
                            tokio::select! {
                                () = i.notified() => tracing::trace!("woken by release"),
                                () = tokio::time::sleep(pause) => {}
                            }
                        }
                        None => tokio::time::sleep(pause).await,
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "acquire failed");
                    return Err(e);
                }
            }
        }
    }

    /// One acquire attempt, run to completion in a task of its own.
    ///
    /// If the caller's future is dropped while the statement is in flight, the statement still
    /// finishes (it is not left half-sent on a pooled connection, to run whenever that connection
    /// is next used), and a lock it took comes back as a guard nobody receives: dropping it
    /// releases it at once. So a cancelled `lock()` never orphans a hold.
    async fn try_once(&self, shared: &Arc<Shared>, waiting: bool) -> Result<Try, LockError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (shared, req) = (shared.clone(), self.clone());
        tokio::spawn(
            async move {
                let sent = Instant::now();
                let outcome = shared.acquire(&req.statement(waiting)).await;
                let outcome = outcome.map(|attempt| match attempt {
                    Attempt::Acquired(grant) => {
                        let hold = Hold::new(req.key, req.owner, grant, req.ttl, sent);
                        Try::Got(LockGuard::new(hold, shared))
                    }
                    Attempt::Busy { retry_after } => Try::Busy(retry_after),
                });
                // If the receiver is gone, the guard inside is dropped here: released.
                let _ = tx.send(outcome);
            }
            .in_current_span(),
        );
        rx.await
            .unwrap_or_else(|_| Err(LockError::Database(sqlx::Error::WorkerCrashed)))
    }
}
