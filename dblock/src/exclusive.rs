//! The exclusive lock as a kind of the wait loop (`wait.rs`): one `lock()` call's attempts and
//! the lock's own policies (a fair caller's queue, a writer's intent behind readers). Each
//! attempt runs inline in the caller's task as a [`Detached`] future: dropped before it
//! completes, it finishes in a task of its own and gives back a grant nobody received
//! ([`Attempted`]), so a dropped `lock()` future never orphans a hold.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::{Acquire, Attempt};
use crate::detach::{Detached, Unreceived};
use crate::error::LockError;
use crate::fair::{Fair, Place};
use crate::guard::LockGuard;
use crate::hold::{Caller, Hold, HoldKind};
use crate::info::time_from_micros;
use crate::line;
use crate::meter;
use crate::options::{LockOptions, Terms};
use crate::owner::Owner;
use crate::read::WriterIntent;
use crate::registry::Serial;
use crate::retry::{LastFailure, Policy};
use crate::shared::Shared;
use crate::timing;
use crate::wait::{self, Busy, Kind, Seen, Try};

/// A `lock()` call, resolved and validated: what every attempt of it sends.
#[derive(Clone)]
pub(crate) struct Request {
    pub(crate) key: String,
    /// ttl, holder, max_hold and lock-delay, resolved.
    pub(crate) terms: Terms,
    /// min_hold, once, and fair (wait in the key's queue across processes: `fair.rs`).
    pub(crate) lock: LockOptions,
    pub(crate) min_hold_us: i64,
    /// The task (or `block_on` thread) that called `lock()`.
    pub(crate) caller: Caller,
    pub(crate) wait: Duration,
    pub(crate) owner: Owner,
    pub(crate) meter: meter::Label,
    pub(crate) record_call: bool,
    /// The hold a grant makes: a lock, or a semaphore's permit.
    pub(crate) hold_kind: HoldKind,
}

impl Request {
    /// The statement's binds, borrowed from the request (the tracked holds are filled in under
    /// the owner's serialisation).
    pub(crate) fn statement(&self, waiting: bool, attempt: i64) -> Acquire<'_> {
        Acquire {
            key: &self.key,
            owner: self.owner.id(),
            ttl_us: self.terms.ttl_us,
            holder: &self.terms.holder,
            attempt,
            waiting,
            tenure: None,
            held: 0,
            min_hold_us: self.min_hold_us,
            once: self.lock.once,
        }
    }

    /// The lease a grant gets: the ttl, or min_hold if that is longer.
    pub(crate) fn lease(&self) -> Duration {
        self.lock.lease(self.terms.ttl)
    }

    /// Takes the lock: attempts until granted or `wait` runs out ([`wait::wait_for`]). The call
    /// returns by `max(wait, one attempt's floor)` whatever the database does; an attempt still
    /// in flight then goes on in the background, and a lock it gets is given back at once.
    pub(crate) async fn acquire(self, shared: Arc<Shared>) -> Result<LockGuard, LockError> {
        let started = Instant::now();
        let mut first_busy = None;
        let (meter, record) = (self.meter.clone(), self.record_call);
        let wait = self.wait;
        let mut lock = LockWait::new(self, shared.clone(), started);
        let result = if lock.waits_for_its_own_body() {
            // Before any wait (also before the process's line, where it would wait for the
            // head): the body's hold ends only after this call.
            Err(LockError::WouldWaitForItself {
                key: lock.req.key.clone(),
            })
        } else {
            wait::wait_for(&mut lock, &shared, started, wait, &mut first_busy).await
        };
        if result.is_err() {
            lock.intent
                .withdraw(&shared, &lock.req.key, &lock.req.owner);
        }
        if record {
            meter::call_ended(&meter, &result, started, first_busy);
        }
        result
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
                &format!("acquire of `{}`", crate::Escaped(&self.key)),
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
            Seen::Nothing => LockError::no_answer(
                waited,
                &format!("acquire of `{}`", crate::Escaped(&self.key)),
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
            // Nothing in doubt: worth trying while the caller waits. An unknown outcome:
            // resolved until the lease it may have written has surely ended (the process no
            // longer counts it by then either).
            let policy = Policy {
                report: Some(report),
                ..Policy::acquire(
                    shared.statement_timeout,
                    call_until,
                    sent + req.lease() + shared.statement_timeout,
                )
            };
            let (tried, serial) = shared
                .acquire(
                    &req.owner,
                    req.statement(waiting, attempt),
                    req.lock.no_reentry,
                    policy,
                )
                .await;
            let lease = req.lease();
            let outcome = match tried.result {
                Ok(Attempt::Acquired(grant)) => {
                    let mut hold = Hold::new(req.key, req.owner, grant, lease, sent, req.meter)
                        .of_kind(req.hold_kind);
                    req.terms.keep(&hold);
                    hold.caller = req.caller;
                    if timing::live(hold.deadline(), lease) {
                        let mut serial = serial;
                        match LockGuard::new(hold, shared) {
                            // Handed over with the owner's serialisation still held: see
                            // `Attempted`.
                            Ok(guard) => return Attempted::got(guard, serial),
                            // Shut down meanwhile: given back before the caller hears it.
                            Err(refused) => {
                                Try::Failed(Box::pin(refused.give_back(serial.as_mut())).await)
                            }
                        }
                    } else {
                        // Its lease could be over by the time the caller used it: given back
                        // under the owner's serialisation, before any next attempt can reach
                        // the row (the caller hears at once; see `Attempted`).
                        tracing::warn!(key = %crate::Escaped(&hold.key), "grant arrived when its lease could have ended; given back");
                        return Attempted {
                            outcome: Try::Stale,
                            serial,
                            stale: Some((hold, shared)),
                        };
                    }
                }
                Ok(Attempt::Busy { retry_after }) => Try::busy(retry_after),
                Ok(Attempt::Done { finished_at_us }) => Try::Failed(LockError::AlreadyDone {
                    key: req.key.clone(),
                    finished_at: finished_at_us.map(time_from_micros),
                }),
                // The row was held past the lock wait (a transaction holds the key): busy.
                Err(failed) if !tried.after_unknown && shared.locked(&failed) => Try::busy(None),
                Err(failed) => Try::Failed(LockError::database(
                    failed.error,
                    tried.after_unknown,
                    &format!("acquire of `{}`", crate::Escaped(&req.key)),
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
            tracing::debug!(key = %crate::Escaped(guard.key()), "granted to a call that is gone; given back");
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

/// One `lock()` call as the wait loop drives it: its attempts, and the lock's own policies —
/// a fair caller's place in the key's queue (`fair.rs`), a writer's intent behind readers
/// (`backend/read.rs`).
struct LockWait {
    req: Request,
    shared: Arc<Shared>,
    started: Instant,
    /// The latest failure of an attempt, for an error at the deadline that names the cause.
    report: LastFailure,
    /// A fair call's place in the key's queue in the database; a re-entry never queues.
    fair: Option<Fair>,
    last_place: Place,
    /// The owner holds the key already (a re-entry): it never waits in the process's line.
    reentry: bool,
    /// Its intent behind the key's readers, recorded while they hold it (`read.rs`).
    intent: WriterIntent,
    /// Just reached the head of a fair queue: the next pause starts from the first step.
    fresh: bool,
    attempts: u32,
}

impl LockWait {
    fn new(req: Request, shared: Arc<Shared>, started: Instant) -> Self {
        // `reentrant(false)`: a hold of its own owner is another owner's to it (the refusal
        // itself is made under the owner's serialisation, `Shared::acquire`).
        let reentry = !req.lock.no_reentry && shared.held_by_owner(&req.key, &req.owner);
        let fair = (req.lock.fair && !reentry)
            .then(|| Fair::new(shared.clone(), &req.key, req.owner.id()));
        LockWait {
            req,
            shared,
            started,
            report: LastFailure::default(),
            fair,
            last_place: Place::Behind(1),
            reentry,
            intent: WriterIntent::default(),
            fresh: false,
            attempts: 0,
        }
    }

    /// `reentrant(false)` inside a locked body (or one it is nested in) of its own owner whose
    /// lock of the key is a live hold of this locker's table (matched by its fencing token):
    /// that hold ends only after this call, so a wait could only end at its deadline.
    fn waits_for_its_own_body(&self) -> bool {
        let req = &self.req;
        if !req.lock.no_reentry {
            return false;
        }
        let Some(context) = crate::owner::Context::get() else {
            return false;
        };
        if context.owner != req.owner {
            return false;
        }
        let holds = self.shared.holds_of(&req.key);
        context.held.iter().any(|h| {
            h.exclusive
                && h.key == req.key
                && holds
                    .iter()
                    .any(|hold| hold.owner == req.owner && hold.fencing_token == h.fencing_token)
        })
    }
}

impl Kind for LockWait {
    type Grant = LockGuard;

    fn key(&self) -> &str {
        &self.req.key
    }

    fn lines_up(&self) -> bool {
        self.fair.is_none() && !self.reentry && !self.req.lock.jumps_line
    }

    fn reentry(&self) -> bool {
        self.reentry
    }

    fn woken_by_releases(&self) -> bool {
        self.fair.is_some()
    }

    async fn attempt(&mut self, waiting: bool, call_until: Instant) -> Try {
        // A fair caller attempts only when nobody live is queued ahead of it.
        if let Some(f) = &mut self.fair {
            match Box::pin(f.place()).await {
                Err(e) => return Try::Failed(e),
                Ok(Place::Behind(ahead)) => {
                    self.last_place = Place::Behind(ahead);
                    return Try::Busy {
                        retry_after: None,
                        behind: Some(ahead),
                    };
                }
                Ok(Place::Head) => {
                    // Just at the head of the queue: ask soon again from there.
                    self.fresh = self.last_place != Place::Head;
                    self.last_place = Place::Head;
                }
            }
        }
        self.attempts += 1;
        let attempt = self
            .req
            .try_once(&self.shared, waiting, call_until, &self.report);
        match attempt.await.received() {
            Try::Got(guard) => {
                if let Some(f) = self.fair.take() {
                    // Out of the queue; the next fair waiters of this process look at once.
                    Box::pin(f.leave()).await;
                    line::freed(self.shared.space(), &self.req.key);
                }
                tracing::debug!(
                    fencing_token = guard.fencing_token(),
                    hold_count = guard.hold_count(),
                    attempts = self.attempts,
                    "acquired"
                );
                Try::Got(guard)
            }
            Try::Failed(e) => {
                tracing::warn!(error = %e, "acquire failed");
                Try::Failed(e)
            }
            other => other,
        }
    }

    async fn busy(&mut self, busy: Busy) -> Result<(), LockError> {
        let (req, shared) = (&self.req, &self.shared);
        if busy.first {
            if req.wait > Duration::ZERO && shared.held_by_caller(&req.key, req.caller, &req.owner)
            {
                // Most likely a wait that can only end at its deadline: for itself. A
                // warning, not an error: a concurrent future of the same task (join!,
                // select!) may well release it, and a timeout stays `Busy`.
                tracing::warn!(
                    key = %crate::Escaped(&req.key),
                    "this task already holds the key through another owner and now waits for it: \
                     unless another future of this task releases it, the wait ends only at its deadline; \
                     to re-enter, take both under one owner (dblock::Owner::scope or .owner(&owner))"
                );
            }
            if shared.member_tenure(&req.key, &req.owner).is_some() {
                // The owner reads the key: the writer would wait for itself.
                return Err(LockError::WouldWaitForItself {
                    key: req.key.clone(),
                });
            }
        }
        let now = Instant::now();
        if !busy.attempted || now >= busy.wait_until {
            return Ok(());
        }
        self.intent
            .busy(shared, &req.key, &req.owner, busy.wait_until)
            .await?;
        if let Some(f) = &mut self.fair {
            // Busy on its own attempt: a ticket at the back of the queue.
            match tokio::time::timeout_at(busy.wait_until, Box::pin(f.queue_up())).await {
                Ok(queued) => queued?,
                Err(_) => return Err(self.req.gave_up(Seen::Busy, self.started.elapsed())),
            }
        }
        Ok(())
    }

    fn fresh(&mut self) -> bool {
        std::mem::take(&mut self.fresh)
    }

    fn gave_up(&self, seen: Seen, waited: Duration) -> LockError {
        self.req.gave_up(seen, waited)
    }

    fn unanswered(&self, seen: Seen, waited: Duration) -> LockError {
        self.req.gave_up_unanswered(seen, waited, &self.report)
    }
}

/// Rounds of "free the key, take it" a steal tries while other owners race it to the key.
const STEAL_ROUNDS: u32 = 5;

/// `Locker::steal`: takes the key now whoever holds it. One attempt first (a free key, or a
/// re-entry, needs nothing more); then the holder's lease is ended (`force_release`: its outcome
/// `Failed`, its fencing token kept) and the key taken with the next token, repeated while other
/// owners race in between. The old holder's renewal, `fence`, `succeed_in` and `extend` find
/// the row no longer theirs: `Lost`.
pub(crate) async fn steal(
    shared: Arc<Shared>,
    mut request: Request,
) -> Result<LockGuard, LockError> {
    // No queue to wait in, no line of this process's waiters, no waiting: the key is taken now.
    request.lock.fair = false;
    request.lock.jumps_line = true;
    request.wait = Duration::ZERO;
    // Busy, or a grant that came too late (given back): another round.
    let again = |e: &LockError| e.is_busy() || matches!(e, LockError::Lost { .. });
    let mut last = match request.clone().acquire(shared.clone()).await {
        Err(e) if again(&e) => e,
        done => return done,
    };
    for _ in 0..STEAL_ROUNDS {
        // The lock's row only (`Locker::force_release` also frees a semaphore of the same key).
        let freed = shared.free("steal", &request.key, "").await?;
        tracing::info!(key = %crate::Escaped(&request.key), freed, "steal: holder's lease ended");
        match request.clone().acquire(shared.clone()).await {
            Err(e) if again(&e) => last = e,
            done => return done,
        }
    }
    Err(last)
}

// On SQLite files: built with the `sqlite` feature only.
#[cfg(feature = "sqlite")]
#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::LockRequest;

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
                std::mem::size_of_val(&backend.run(&a, Instant::now())),
            ),
            (
                "Backend::release",
                std::mem::size_of_val(&backend.run(
                    &crate::backend::Release {
                        hold: hold.as_ref(),
                        remaining: 0,
                        outcome: None,
                        release_id: 1,
                    },
                    Instant::now(),
                )),
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
                false,
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
