//! Shared (read) locks: [`Locker::read`](crate::Locker::read) and [`ReadRequest`]. The
//! statements and the table model are in `backend/read.rs`; the writer is the plain
//! [`Locker::lock`](crate::Locker::lock), whose wait (`exclusive.rs`) records the writer's
//! intent with this kind's [`WriterIntent`].

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use crate::backend::read::{Intent, ReadAcquire, ReadAttempt, ReadRelease, ReadReleased, Withdraw};
use crate::backend::{Backend, Released};
use crate::detach::Detached;
use crate::error::LockError;
use crate::guard::LockGuard;
use crate::hold::{Giving, Hold, HoldKind, Member, Releasing};
use crate::meter;
use crate::options::{Options, Terms};
use crate::owner::Owner;
use crate::retry::{Failure, Policy};
use crate::shared::{settle_lost_reply, Shared};
use crate::timing::{self, INTENT_EVERY, INTENT_LEASE};
use crate::wait::{self, Busy, Kind, Seen, Try};

/// The read kind's metrics label (`kind="read"`).
const METRIC: meter::Kind = meter::Kind::named("read");

/// This kind's entry point.
impl crate::Locker {
    /// A shared (read) hold of `key`: any number of readers at once; [`lock`](Self::lock) of
    /// the same key is the writer, which excludes them and which they exclude. Once a writer
    /// waits, readers that arrive after it wait behind it (recorded in the database, so across
    /// processes), and the writer gets the key when the readers already in leave. The guard is
    /// a lease like a lock's (ttl, renewal, release, the read tenure's fencing token). See
    /// [`ReadRequest`](crate::ReadRequest).
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let snapshot = locker.read("config").wait(std::time::Duration::from_secs(5)).await?;
    /// // ... read the configuration; writers wait ...
    /// snapshot.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn read(&self, key: impl Into<String>) -> crate::ReadRequest {
        crate::ReadRequest::new(self.shared().clone(), key.into())
    }
}

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

crate::options::setters!(ReadRequest, "locker.read(\"config\")": ttl, wait, owner, holder, metrics_key, max_hold, lock_delay);

crate::options::into_future!(ReadRequest => LockGuard);

impl ReadRequest {
    async fn call(self, owner: Owner) -> Result<LockGuard, LockError> {
        let span = crate::options::call_span!("dblock.read", self, owner);
        let started = Instant::now();
        let meter = meter::Label::new(
            self.options.metrics_key.as_ref(),
            self.shared.backend_name(),
            METRIC,
        );
        let mut first_busy = None;
        let result = self
            .acquire(owner, meter.clone(), &mut first_busy)
            .instrument(span)
            .await;
        meter::call_ended(&meter, &result, started, first_busy);
        result
    }

    async fn acquire(
        self,
        owner: Owner,
        meter: meter::Label,
        first_busy: &mut Option<Instant>,
    ) -> Result<LockGuard, LockError> {
        self.shared.admit(&self.key)?;
        let shared = self.shared.clone();
        let mut kind = ReadWait {
            terms: self.options.terms(&shared, Duration::ZERO)?,
            backend: shared.backend()?.clone(),
            reentry: shared.member_tenure(&self.key, &owner),
            shared: shared.clone(),
            key: self.key,
            owner,
            meter,
            // This call's id: kept among the row's readers, the same in every resend.
            id: fastrand::i64(1..i64::MAX),
        };
        wait::wait_for(
            &mut kind,
            &shared,
            Instant::now(),
            self.options.wait,
            first_busy,
        )
        .await
    }
}

/// One `read()` call as the wait loop drives it.
struct ReadWait {
    shared: Arc<Shared>,
    backend: Backend,
    key: String,
    owner: Owner,
    meter: meter::Label,
    /// ttl, holder, max_hold and lock-delay, resolved.
    terms: Terms,
    id: i64,
    /// The read tenure this owner already reads in (as this process tracks it): a re-entry,
    /// which never waits in the process's line (it would wait for a writer that waits for it).
    reentry: Option<u64>,
}

impl Kind for ReadWait {
    type Grant = LockGuard;

    fn key(&self) -> &str {
        &self.key
    }

    fn lines_up(&self) -> bool {
        self.reentry.is_none()
    }

    fn reentry(&self) -> bool {
        self.reentry.is_some()
    }

    async fn attempt(&mut self, waiting: bool, call_until: Instant) -> Try {
        self.reentry = self.shared.member_tenure(&self.key, &self.owner);
        let (shared, backend, key, owner, meter) = (
            self.shared.clone(),
            self.backend.clone(),
            self.key.clone(),
            self.owner.clone(),
            self.meter.clone(),
        );
        let (terms, id, reentry) = (self.terms.clone(), self.id, self.reentry);
        let ttl = terms.ttl;
        Detached::new(async move {
            let sent = Instant::now();
            let statement = ReadAcquire {
                key: &key,
                holder: &terms.holder,
                ttl_us: terms.ttl_us,
                id,
                reentry: reentry.map(|t| t as i64),
                waiting,
            };
            let policy = Policy::acquire(
                shared.statement_timeout,
                call_until,
                sent + ttl + shared.statement_timeout,
            );
            let tried = backend.retried(&statement, policy).await;
            match tried.result {
                Ok(ReadAttempt::Granted(grant)) => {
                    let hold = Hold::new(key, Owner::marker(crate::info::READERS), grant, ttl, sent, meter)
                        .of_kind(HoldKind::Member(Arc::new(Reader { id, owner })));
                    terms.keep(&hold);
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
                Ok(ReadAttempt::Busy { retry_after }) => Try::busy(retry_after),
                Err(f) if !tried.after_unknown && backend.classify(&f) == Failure::Locked => {
                    Try::busy(None)
                }
                Err(f) => Try::Failed(LockError::database(
                    f.error,
                    tried.after_unknown,
                    &format!("read of `{}`", crate::Escaped(&key)),
                )),
            }
        })
        .await
    }

    async fn busy(&mut self, _: Busy) -> Result<(), LockError> {
        // The owner holds the key for writing: waiting would be for itself.
        if self.shared.held_by_owner(&self.key, &self.owner) {
            return Err(LockError::WouldWaitForItself {
                key: self.key.clone(),
            });
        }
        Ok(())
    }

    fn gave_up(&self, seen: Seen, waited: Duration) -> LockError {
        match seen {
            Seen::Nothing => {
                LockError::no_answer(waited, &format!("read of `{}`", crate::Escaped(&self.key)))
            }
            // A read whose grant came too late is still a busy key to its caller.
            Seen::Busy | Seen::Stale => LockError::Busy {
                key: self.key.clone(),
                waited,
            },
        }
    }
}

/// A read hold's part ([`HoldKind::Member`]): its id among the key's readers and the owner that
/// reads (the row's owner is the readers' marker, [`crate::info::READERS`]).
#[derive(Debug)]
struct Reader {
    id: i64,
    owner: Owner,
}

impl Member for Reader {
    fn owner(&self) -> &Owner {
        &self.owner
    }

    /// Gives one read hold back: its id leaves the key's readers (`backend/read.rs`). A resend
    /// after a lost reply finds the id gone and counts as done; nothing can be removed twice.
    fn release<'a>(&'a self, giving: Giving<'a>) -> Releasing<'a> {
        let Giving {
            backend,
            hold,
            outcome,
            policy,
            statement_timeout,
        } = giving;
        Box::pin(async move {
            let statement = ReadRelease {
                key: &hold.key,
                token: hold.fencing_token as i64,
                id: self.id,
                outcome,
            };
            let tried = backend.retried(&statement, policy).await;
            match tried.result {
                Ok(ReadReleased::Free) => Ok(Released::Free),
                Ok(ReadReleased::StillHeld(n)) => Ok(Released::StillHeld(n)),
                Ok(ReadReleased::Gone) => {
                    tracing::debug!(key = %crate::Escaped(&hold.key), "read release after a lost reply: the earlier send took effect");
                    Ok(Released::StillHeld(0))
                }
                // The last reader's earlier send may have freed the row (no readers' row is
                // left to find the id gone from): the row's last release says.
                Ok(ReadReleased::NotHeld) if tried.after_unknown => {
                    let took_effect = Released::StillHeld(0);
                    settle_lost_reply(backend, hold, self.id, took_effect, statement_timeout).await
                }
                Ok(ReadReleased::NotHeld) => Ok(Released::NotHeld),
                Err(f) => Err(LockError::database(f.error, tried.after_unknown, "release")),
            }
        })
    }
}

/// A waiting writer's intent behind the key's readers: the read kind's part of the exclusive
/// lock's wait (`exclusive.rs` composes it). While readers hold the key, the writer records its
/// intent in the row, renewed every [`INTENT_EVERY`] while it waits, so that readers who come
/// later wait behind it; a writer that gives up withdraws it.
#[derive(Debug, Default)]
pub(crate) struct WriterIntent {
    /// When this writer last recorded (or looked to record) its intent on a read-held key.
    at: Option<Instant>,
    /// Whether it holds an intent (withdrawn if the call gives up).
    held: bool,
}

impl WriterIntent {
    /// The writer's attempt found `key` busy: records or renews the intent of `owner` if
    /// readers hold the key (at most every [`INTENT_EVERY`]; the statement sent by
    /// `wait_until`).
    pub(crate) async fn busy(
        &mut self,
        shared: &Shared,
        key: &str,
        owner: &Owner,
        wait_until: Instant,
    ) -> Result<(), LockError> {
        let now = Instant::now();
        if self.at.is_some_and(|at| now < at + INTENT_EVERY) {
            return Ok(());
        }
        let statement = Intent {
            key,
            owner: owner.id(),
            lease_us: INTENT_LEASE.as_micros() as i64,
        };
        let limit = (now + shared.statement_timeout).min(wait_until);
        // Boxed: a rare statement, kept out of every call's future.
        let recorded = Box::pin(shared.backend()?.run(&statement, limit)).await;
        self.held = matches!(recorded, Ok(true)) || self.held;
        self.at = Some(now);
        Ok(())
    }

    /// The writer gave up: its intent, if it holds one, is withdrawn in the background, so
    /// readers need not wait it out.
    pub(crate) fn withdraw(&self, shared: &Shared, key: &str, owner: &Owner) {
        if !self.held {
            return;
        }
        let Ok(backend) = shared.backend() else {
            return;
        };
        let (backend, timeout) = (backend.clone(), shared.statement_timeout);
        let (key, owner) = (key.to_owned(), owner.clone());
        tokio::spawn(async move {
            let withdraw = Withdraw {
                key: &key,
                owner: owner.id(),
            };
            let _ = backend.run(&withdraw, Instant::now() + timeout).await;
        });
    }
}
