//! [`LockRequest`], one `locker.lock(key)` call: the builder, and its resolution into one
//! [`Request`] whose wait loop (`wait.rs`) runs behind its `.await`; and [`try_all`], one
//! attempt at several keys in one statement (`lock_all`).
//!
//! Cancellation safety of a single key's attempts lives in `wait.rs`; [`try_all`] runs in a
//! task of its own and gives back what nobody received.

use std::borrow::Cow;
use std::sync::Arc;

use tokio::time::Instant;
use tracing::Instrument;

use crate::backend::{Acquire, Attempt};
use crate::error::LockError;
use crate::exclusive::Request;
use crate::guard::LockGuard;
use crate::hold::{Caller, Hold, HoldKind};
use crate::meter;
use crate::options::{LockOptions, Options};
use crate::owner::Owner;
use crate::registry::Serial;
use crate::retry::Policy;
use crate::shared::Shared;
use crate::validate;

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
    options: Options,
    lock: LockOptions,
    /// `false` for one key of a `lock_all` call, which reports the call as a whole.
    record_call: bool,
    /// The kind of hold the call takes, as its metrics say (a lock, or the kind of hold built
    /// on one: a leadership, a semaphore's permit).
    kind: meter::Kind,
    /// The hold it makes: a lock, or one permit of a semaphore.
    hold_kind: HoldKind,
    /// `Locker::steal`: take the key from whoever holds it.
    steal: bool,
}

impl LockRequest {
    pub(crate) fn new(shared: Arc<Shared>, key: String) -> Self {
        Self::with(shared, key, Options::default(), LockOptions::default())
    }

    /// A request with these options (one key of a `lock_all` call, a permit's slot).
    pub(crate) fn with(
        shared: Arc<Shared>,
        key: String,
        options: Options,
        lock: LockOptions,
    ) -> Self {
        LockRequest {
            shared,
            key,
            options,
            lock,
            record_call: true,
            kind: meter::Kind::LOCK,
            hold_kind: HoldKind::Lock,
            steal: false,
        }
    }

    /// `Locker::steal`: the key is taken from whoever holds it.
    pub(crate) fn stealing(mut self) -> Self {
        self.steal = true;
        self
    }

    /// The lock under another metrics kind (a leadership's).
    pub(crate) fn labelled(mut self, kind: meter::Kind) -> Self {
        self.kind = kind;
        self
    }

    /// A permit of the semaphore `semaphore`: the lock of one of its slot rows, labelled
    /// `kind`.
    pub(crate) fn permit_of(mut self, semaphore: &str, kind: meter::Kind) -> Self {
        self.kind = kind;
        self.hold_kind = HoldKind::Permit(semaphore.into());
        self
    }

    /// One key of a `lock_all` call, labelled as the call; `alone`: the call's only key, which
    /// then reports the call (a call of several keys reports itself).
    pub(crate) fn part_of(mut self, metrics_key: Option<&Cow<'static, str>>, alone: bool) -> Self {
        self.options.metrics_key = metrics_key.cloned();
        self.record_call = alone;
        self
    }
}

crate::options::setters!(LockRequest, "locker.lock(\"k\")": ttl, wait, owner, holder, metrics_key, max_hold, lock_delay, min_hold, once, fair, reentrant);

crate::options::into_future!(LockRequest => LockGuard);

impl LockRequest {
    async fn call(self, owner: Owner) -> Result<LockGuard, LockError> {
        let span = crate::options::call_span!("dblock.lock", self, owner);
        async move {
            let steal = self.steal;
            let (shared, request) = self.resolve(owner)?;
            if steal {
                return crate::exclusive::steal(shared, request).await;
            }
            request.acquire(shared).await
        }
        .instrument(span)
        .await
    }
}

impl LockRequest {
    /// Checks the call (runtime, locker open, key, ttl, min_hold, backend) and resolves it into
    /// what every attempt sends.
    pub(crate) fn resolve(self, owner: Owner) -> Result<(Arc<Shared>, Request), LockError> {
        self.shared.admit(&self.key)?;
        let terms = self.options.terms(&self.shared, self.lock.min_hold)?;
        let request = Request {
            meter: meter::Label::new(
                self.options.metrics_key.as_ref(),
                self.shared.backend_name(),
                self.kind,
            ),
            record_call: self.record_call,
            min_hold_us: validate::min_hold_micros(self.lock.min_hold)?,
            // A steal takes the key from whoever holds it, its own owner included: refusing
            // that owner's hold would only free the key for someone else (`steal` rounds).
            lock: LockOptions {
                no_reentry: self.lock.no_reentry && !self.steal,
                ..self.lock
            },
            caller: Caller::current(),
            terms,
            key: self.key,
            wait: self.options.wait,
            owner,
            hold_kind: self.hold_kind,
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
    /// The dialect has no statement for several keys (the MySQL 8 path): nothing was tried.
    NotTried,
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
    let asked = Instant::now();
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
            let policy = Policy::acquire(
                shared.statement_timeout,
                call_until,
                sent + longest + shared.statement_timeout,
            );
            // One id per key of this attempt, the same in each resend (see `try_once`).
            let statements: Vec<Acquire<'_>> = resolved
                .iter()
                .map(|r| r.statement(false, fastrand::i64(1..i64::MAX)))
                .collect();
            let no_reentry = resolved.iter().any(|r| r.lock.no_reentry);
            let tried = shared.acquire_all(&owner, statements, no_reentry, policy);
            let (tried, serials) = match tried.await {
                Ok(answer) => answer,
                Err(e) => {
                    let _ = tx.send(AllTry::Failed(e));
                    return;
                }
            };
            let attempts = match tried.result {
                Ok(Some(attempts)) => attempts,
                Ok(None) => {
                    let _ = tx.send(AllTry::NotTried);
                    return;
                }
                // A row held past the lock wait (a transaction holds a key): nothing taken;
                // the keys are then taken one by one, each waiting as a busy key does.
                Err(failed) if !tried.after_unknown && shared.locked(&failed) => {
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
                req.terms.keep(&hold);
                hold.caller = req.caller;
                if !gap && crate::timing::live(hold.deadline(), lease) {
                    kept.push((hold, serial));
                } else {
                    gap = true;
                    give_back.push((hold, serial));
                }
            }
            // Given back under the owner's serialisation of each key, before the caller goes on
            // to take the rest one by one.
            // All at once: the locker coalesces them into a few statements, instead of one round
            // trip per key.
            futures_util::future::join_all(give_back.into_iter().map(|(hold, mut serial)| {
                let shared = &shared;
                async move {
                    let until = hold.deadline().max(Instant::now()) + shared.statement_timeout;
                    let _ = shared
                        .release_serialised(&hold, &mut serial, None, until)
                        .await;
                }
            }))
            .await;
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
    // Bounded as one key's attempt is (`wait.rs`): past it, the outcome is unknown to the
    // caller; the task above goes on settling it, and gives back what nobody received.
    match tokio::time::timeout_at(call_until + crate::timing::ANSWER_GRACE, rx).await {
        Ok(answer) => answer
            .unwrap_or_else(|_| AllTry::Failed(LockError::Database(sqlx::Error::WorkerCrashed))),
        Err(_) => AllTry::Failed(LockError::no_answer(
            asked.elapsed(),
            "acquire of several keys",
        )),
    }
}
