//! Shared (read) locks: [`Locker::read`](crate::Locker::read) and [`ReadRequest`]. The
//! statements and the table model are in `backend/read.rs`; the writer is the plain
//! [`Locker::lock`](crate::Locker::lock), whose wait loop records the writer's intent
//! (`request.rs`).

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use crate::backend::read::{ReadAcquire, ReadAttempt};
use crate::backend::Interest;
use crate::detach::{Detached, Unreceived};
use crate::error::LockError;
use crate::guard::LockGuard;
use crate::hold::{Hold, HoldKind, Reader};
use crate::line;
use crate::meter;
use crate::options::Options;
use crate::owner::Owner;
use crate::retry::{self, Policy};
use crate::shared::Shared;
use crate::timing::{self, Backoff};
use crate::validate;

/// One `locker.read(key)` call being configured; `.await` it for a shared (read) hold of `key`.
/// Any number of readers hold a key at once; [`Locker::lock`](crate::Locker::lock) of the same
/// key is the writer, which excludes them and which they exclude. A writer that waits is not
/// starved: readers that arrive after it wait behind it.
///
#[cfg_attr(feature = "sqlite", doc = "```")]
#[cfg_attr(not(feature = "sqlite"), doc = "```no_run")]
/// # async fn demo() -> Result<(), dblock::LockError> {
/// use std::time::Duration;
/// let locker = dblock::Locker::connect("sqlite::memory:").await?;
/// locker.migrate().await?;
///
/// let a = locker.read("config").await?;           // readers share the key
/// let b = locker.read("config").await?;
/// assert!(locker.lock("config").await.is_err());  // the writer waits for them
/// a.release().await?;
/// b.release().await?;
/// let writer = locker.lock("config").wait(Duration::from_secs(1)).await?;
/// # Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
/// ```
#[must_use = "a read request does nothing until it is awaited"]
pub struct ReadRequest {
    shared: Arc<Shared>,
    key: String,
    options: Options,
}

impl ReadRequest {
    pub(crate) fn new(shared: Arc<Shared>, key: String) -> Self {
        ReadRequest {
            shared,
            key,
            options: Options::default(),
        }
    }
}

crate::options::setters!(ReadRequest, "locker.read(\"config\")": ttl, wait, owner, holder, metrics_key);

impl IntoFuture for ReadRequest {
    type Output = Result<LockGuard, LockError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 'static>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move {
            let owner = self.options.owner();
            let span = tracing::debug_span!(
                "dblock.read",
                key = %crate::Escaped(&self.key),
                backend = self.shared.backend_name(),
                owner = %owner,
                ttl_ms = self.options.ttl.as_millis() as u64,
                wait_ms = self.options.wait.as_millis() as u64,
            );
            let started = Instant::now();
            let meter = meter::Label::new(
                self.options.metrics_key.as_ref(),
                self.shared.backend_name(),
                meter::Kind::Read,
            );
            let mut first_busy = None;
            let result = self
                .acquire(owner, meter.clone(), &mut first_busy)
                .instrument(span)
                .await;
            meter::call_ended(
                &meter,
                meter::CallOutcome::of(&result),
                started.elapsed(),
                first_busy.map(|t: Instant| t.elapsed()),
            );
            result
        })
    }
}

/// What one reader's attempt came to, with the hold already inside a guard.
enum Try {
    Got(LockGuard),
    Busy(Option<Duration>),
    /// Granted when the lease could have ended: given back.
    Stale,
    Failed(LockError),
}

impl Unreceived for Try {
    async fn unreceived(self) {
        if let Try::Got(guard) = self {
            tracing::debug!(key = %crate::Escaped(guard.key()), "read granted to a call that is gone; given back");
            let _ = guard.give_back_unused().await;
        }
    }
}

impl ReadRequest {
    async fn acquire(
        self,
        owner: Owner,
        meter: meter::Label,
        first_busy: &mut Option<Instant>,
    ) -> Result<LockGuard, LockError> {
        LockError::require_runtime()?;
        self.shared.check_open()?;
        validate::key(&self.key)?;
        let ttl_us = validate::ttl_micros(self.options.ttl)?;
        let backend = self.shared.backend()?.clone();
        let shared = self.shared.clone();
        let holder: Arc<str> = self.options.holder(&shared)?;
        let started = Instant::now();
        let deadline = crate::timing::after(started, self.options.wait);
        // The call's whole time: its wait, or one attempt's floor.
        let call_until = timing::call_until(started, self.options.wait, shared.statement_timeout);
        // This call's id: kept among the row's readers, the same in every resend.
        let id = fastrand::i64(1..i64::MAX);
        let busy = |first: &Option<Instant>| LockError::Busy {
            key: self.key.clone(),
            waited: first.map_or(started.elapsed(), |_| started.elapsed()),
        };
        let mut backoff = Backoff::default();
        let line = line::of(shared.space(), &self.key);
        let mut turn = None;
        let mut interest: Option<Interest> = None;
        loop {
            shared.check_open()?;
            // A re-entry: this owner already reads the key (as this process tracks it).
            let reentry = shared.read_tenure(&self.key, &owner);
            let attempt = {
                let (shared, backend, key, holder, owner, meter) = (
                    shared.clone(),
                    backend.clone(),
                    self.key.clone(),
                    holder.clone(),
                    owner.clone(),
                    meter.clone(),
                );
                let (ttl, waiting) = (self.options.ttl, interest.is_some());
                Detached::new(async move {
                    let sent = Instant::now();
                    let statement = ReadAcquire {
                        key: &key,
                        holder: &holder,
                        ttl_us,
                        id,
                        reentry: reentry.map(|t| t as i64),
                        waiting,
                    };
                    let policy = Policy {
                        rolled_back: retry::ROLLBACK_RESENDS,
                        per_send: shared.statement_timeout,
                        send_until: call_until,
                        resolve_until: sent + ttl + shared.statement_timeout,
                        report: None,
                    };
                    let tried = retry::run(
                        policy,
                        |f| backend.classify(f),
                        |limit| backend.run(&statement, limit),
                    )
                    .await;
                    match tried.result {
                        Ok(ReadAttempt::Granted(grant)) => {
                            let hold = Hold::new(key, Owner::readers(), grant, ttl, sent, meter)
                                .of_kind(HoldKind::Read(Reader { id, owner }));
                            let live = timing::live(hold.deadline(), ttl);
                            match LockGuard::new(hold, shared) {
                                Ok(guard) if live => Try::Got(guard),
                                Ok(guard) => {
                                    tracing::warn!(key = %crate::Escaped(guard.key()), "read grant arrived when its lease could have ended; given back");
                                    let _ = guard.give_back_unused().await;
                                    Try::Stale
                                }
                                Err(refused) => Try::Failed(refused.give_back(None).await),
                            }
                        }
                        Ok(ReadAttempt::Busy { retry_after }) => Try::Busy(retry_after),
                        Err(f) => Try::Failed(LockError::database(
                            f.error,
                            tried.after_unknown,
                            &format!("read of `{}`", crate::Escaped(&key)),
                        )),
                    }
                })
            };
            let outcome =
                match tokio::time::timeout_at(call_until + timing::ANSWER_GRACE, attempt).await {
                    Ok(outcome) => outcome,
                    // No answer within the call's time: busy if a busy answer came before, else
                    // the outcome of the last attempt is unknown, as for a lock.
                    Err(_) if first_busy.is_some() => return Err(busy(first_busy)),
                    Err(_) => {
                        return Err(LockError::no_answer(
                            started.elapsed(),
                            &format!("read of `{}`", crate::Escaped(&self.key)),
                        ))
                    }
                };
            let retry_after = match outcome {
                Try::Got(guard) => return Ok(guard),
                Try::Failed(e) => return Err(e),
                Try::Stale | Try::Busy(None) => None,
                Try::Busy(Some(left)) => Some(left),
            };
            let now = Instant::now();
            first_busy.get_or_insert(now);
            // The owner holds the key for writing: waiting would be for itself.
            if shared.held_by_owner(&self.key, &owner) {
                return Err(LockError::WouldWaitForItself {
                    key: self.key.clone(),
                });
            }
            if now >= deadline {
                return Err(busy(first_busy));
            }
            // This process's waiters line up (re-entries do not: they would wait for a writer
            // that waits for them).
            if turn.is_none() && reentry.is_none() {
                match line.try_turn() {
                    Some(head) => turn = Some(head),
                    None => match tokio::time::timeout_at(deadline, line.turn()).await {
                        Ok(head) => {
                            turn = Some(head);
                            backoff.reset();
                            continue;
                        }
                        Err(_) => return Err(busy(first_busy)),
                    },
                }
            }
            if interest.is_none() {
                interest = tokio::time::timeout_at(deadline, backend.interest(&self.key))
                    .await
                    .ok()
                    .flatten();
                if interest.is_some() {
                    continue; // ask again, now asking the writer to notify
                }
            }
            let pause = backoff.next(deadline, retry_after);
            let freed = async {
                if turn.is_some() {
                    line.freed().await
                } else {
                    std::future::pending().await
                }
            };
            match &interest {
                Some(i) => tokio::select! {
                    () = i.notified() => {}
                    () = freed => {}
                    () = tokio::time::sleep(pause) => {}
                },
                None => tokio::select! {
                    () = freed => {}
                    () = tokio::time::sleep(pause) => {}
                },
            }
        }
    }
}
