//! Leader election on a lease: [`Locker::leader`](crate::Locker::leader), [`LeaderRequest`],
//! [`Leadership`] and [`Observe`].
//!
//! A leadership is an exclusive lock on the election's key, taken by an owner of its own and kept
//! alive by the locker's one renewal task. It needs no statement of its own: the lock's acquire,
//! extend and release statements, with their guarantees (one statement each, unknown outcomes
//! never counted twice, a grant only returned live), are the election's. What this module adds
//! is the end of a leadership as the leader must see it: [`Leadership::lost`] resolves *before*
//! the lease can end on the database clock, so a leader that stops when told never acts beside
//! its successor.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use tracing::Instrument;

use crate::error::LockError;
use crate::guard::LockGuard;
use crate::hold::Hold;
use crate::info::LockInfo;
use crate::options::Options;
use crate::owner::Owner;
use crate::request::LockRequest;
use crate::shared::Shared;
use crate::validate;

/// A leadership's metrics label (`kind="leader"`).
const METRIC: crate::meter::Kind = crate::meter::Kind::named("leader");

/// This kind's entry point.
impl crate::Locker {
    /// An election on `key` (leader election on a lease, as etcd's): `.campaign()` waits until
    /// this instance leads, `.current()` names the leader, `.observe()` follows the changes.
    /// The election is the lock on `key` in this table. See [`LeaderRequest`].
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let leadership = locker.leader("scheduler").holder("node-a").campaign().await?;
    /// tokio::select! {
    ///     _ = leadership.lost() => {}                      // stop leading
    ///     () = std::future::pending::<()>() => {}          // ... run the scheduler ...
    /// }
    /// # Ok(()) }
    /// ```
    pub fn leader(&self, key: impl Into<String>) -> LeaderRequest {
        LeaderRequest::new(self.shared().clone(), key.into())
    }
}

/// An election on one key: [`campaign`](Self::campaign) to lead, [`current`](Self::current) to
/// ask who leads, [`observe`](Self::observe) to follow the changes. Made by
/// [`Locker::leader`](crate::Locker::leader).
///
/// The election *is* the lock on `key` in the locker's table: while an instance leads, the key
/// is held by the campaign's own owner (a fresh one per campaign, so two campaigns in one
/// process exclude each other), and `locker.lock(key)` elsewhere finds it busy.
///
#[cfg_attr(feature = "sqlite", doc = "```")]
#[cfg_attr(not(feature = "sqlite"), doc = "```no_run")]
/// # async fn demo() -> Result<(), dblock::LockError> {
/// use std::time::Duration;
/// let locker = dblock::Locker::connect("sqlite::memory:").await?;
/// locker.migrate().await?;
///
/// let election = locker.leader("scheduler").holder("node-a").ttl(Duration::from_secs(10));
/// let leadership = election.campaign().await?; // waits until this instance leads
/// let token = leadership.fencing_token();       // hand it to what the leader writes to
/// tokio::select! {
///     lost = leadership.lost() => eprintln!("no longer the leader: {lost}"),
///     () = tokio::time::sleep(Duration::from_millis(50)) => {} // ... the leader's work ...
/// }
/// assert_eq!(election.current().await?.and_then(|l| l.holder).as_deref().map(|h| h.ends_with("node-a")), Some(true));
/// leadership.resign().await?;                   // hands over at once
/// # let _ = token; Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
/// ```
#[derive(Clone)]
#[must_use = "an election does nothing until it campaigns, is asked or observed"]
pub struct LeaderRequest {
    shared: Arc<Shared>,
    key: String,
    /// Its `ttl` and `holder` (the rest of the options core does not apply: a campaign waits as
    /// long as it takes, as a fresh owner).
    options: Options,
}

impl fmt::Debug for LeaderRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderRequest")
            .field("key", &self.key)
            .field("ttl", &self.options.ttl)
            .field("holder", &self.options.label)
            .finish()
    }
}

crate::options::setters!(LeaderRequest, "locker.leader(\"scheduler\")": ttl, holder);

impl LeaderRequest {
    pub(crate) fn new(shared: Arc<Shared>, key: String) -> Self {
        LeaderRequest {
            shared,
            key,
            options: Options::default(),
        }
    }

    /// The key of the election.
    ///
    /// ```
    /// # fn demo(locker: dblock::Locker) {
    /// assert_eq!(locker.leader("scheduler").key(), "scheduler");
    /// # }
    /// ```
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Waits until this instance leads, then keeps the lease renewed (the locker's one renewal
    /// task) until the [`Leadership`] is resigned, dropped or the locker shuts down.
    ///
    /// It waits as long as it takes: wrap it in `tokio::time::timeout` to bound it (dropping
    /// the future is safe: a grant nobody received is given back). While it waits, a release
    /// by the leader wakes it at once on PostgreSQL (NOTIFY), within 250 ms elsewhere; a
    /// leader that died is replaced when its lease ends. A failure to reach the database does
    /// not end the campaign: it is logged at `warn` and the campaign asks again. It ends with
    /// an error only for what asking again cannot fix: [`LockError::ShutDown`], a bad key or
    /// ttl, no tokio runtime.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let leadership = locker.leader("scheduler").campaign().await?;
    /// // ... lead until leadership.lost() resolves ...
    /// # Ok(()) }
    /// ```
    ///
    /// The future owns what it needs (`'static`): it can be spawned, and the request used
    /// again.
    pub fn campaign(&self) -> impl Future<Output = Result<Leadership, LockError>> + Send + 'static {
        self.clone().campaign_owned()
    }

    /// What a campaign and a steal refuse before they send anything: no tokio runtime, a bad
    /// key or ttl.
    fn check(&self) -> Result<(), LockError> {
        LockError::require_runtime()?;
        validate::key(&self.key)?;
        validate::ttl_micros(self.options.ttl).map(drop)
    }

    async fn campaign_owned(self) -> Result<Leadership, LockError> {
        self.check()?;
        let owner = Owner::new();
        let span = tracing::info_span!("dblock.campaign", key = %crate::Escaped(&self.key), owner = %owner);
        async move { loop {
            let options = Options {
                wait: crate::timing::FOREVER,
                owner: Some(owner.clone()),
                ..self.options.clone()
            };
            let request = LockRequest::with(self.shared.clone(), self.key.clone(), options, Default::default());
            match request.labelled(METRIC).await {
                Ok(guard) => {
                    let leadership = Leadership::new(guard.auto_renew(), self.options.ttl);
                    tracing::info!(
                        key = %crate::Escaped(&self.key),
                        fencing_token = leadership.fencing_token(),
                        "leading"
                    );
                    return Ok(leadership);
                }
                Err(e @ (LockError::Database(_) | LockError::Busy { .. } | LockError::Lost { .. })) => {
                    tracing::warn!(key = %crate::Escaped(&self.key), error = %e, "campaign attempt failed; asking again");
                    tokio::time::sleep(crate::timing::CAMPAIGN_RETRY).await;
                }
                Err(e) => return Err(e),
            }
        } }
        .instrument(span)
        .await
    }

    /// Takes the leadership now, from whoever leads (preemption: a leader that is stuck, or one
    /// a newer deployment supersedes), as [`Locker::steal`](crate::Locker::steal) does for a
    /// lock: the old leader's lease ends at once, this instance leads with the next fencing
    /// token, and the old leader's [`lost`](Leadership::lost) resolves (at once in this process,
    /// at its next renewal in another; its `fence` and `succeed_in` fail with `Lost` at once). Then
    /// as [`campaign`](Self::campaign).
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let stuck = locker.leader("scheduler").campaign().await?;
    /// let newer = locker.leader("scheduler").steal().await?;
    /// assert!(newer.fencing_token() > stuck.fencing_token());
    /// # Ok(()) }
    /// ```
    pub fn steal(&self) -> impl Future<Output = Result<Leadership, LockError>> + Send + 'static {
        self.clone().steal_owned()
    }

    async fn steal_owned(self) -> Result<Leadership, LockError> {
        self.check()?;
        let options = Options {
            owner: Some(Owner::new()),
            ..self.options.clone()
        };
        let guard = LockRequest::with(
            self.shared.clone(),
            self.key.clone(),
            options,
            Default::default(),
        )
        .labelled(METRIC)
        .stealing()
        .await?;
        let leadership = Leadership::new(guard.auto_renew(), self.options.ttl);
        tracing::info!(
            key = %crate::Escaped(&self.key),
            fencing_token = leadership.fencing_token(),
            "leading (stolen)"
        );
        Ok(leadership)
    }

    /// Who leads now: the key's row while its lease is live (its
    /// [`holder`](LockInfo::holder) names the leader, its fencing token the term), `None` when
    /// nobody leads. One read.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// match locker.leader("scheduler").current().await? {
    ///     Some(leader) => println!("led by {:?} since term {}", leader.holder, leader.fencing_token),
    ///     None => println!("no leader"),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn current(
        &self,
    ) -> impl Future<Output = Result<Option<LockInfo>, LockError>> + Send + 'static {
        let (shared, key) = (self.shared.clone(), self.key.clone());
        async move { current(&shared, &key).await }
    }

    /// Follows the election: a [`Stream`](futures_core::Stream) that yields the leader first
    /// as it is now, then each time it changes — a new term (another leader, or the same
    /// instance elected again) or `None` when nobody leads. It reads the key's row every
    /// ttl/10 (at least every second, at most every 50 ms), so a change is seen within that
    /// long; a failed read is yielded as an error and the stream goes on. It ends after one
    /// [`LockError::ShutDown`] once the locker shuts down, and after one
    /// [`LockError::NoRuntime`] when polled outside a tokio runtime. With `futures` or
    /// `tokio-stream`, `StreamExt::next` reads it; the example below needs only `futures-core`.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// use std::future::poll_fn;
    /// use std::pin::Pin;
    /// use futures_core::Stream;
    /// let mut changes = locker.leader("scheduler").observe();
    /// while let Some(leader) = poll_fn(|cx| Pin::new(&mut changes).poll_next(cx)).await {
    ///     println!("leader now: {:?}", leader?.and_then(|l| l.holder));
    ///     # break;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn observe(&self) -> Observe {
        let every =
            (self.options.ttl / 10).clamp(Duration::from_millis(50), Duration::from_secs(1));
        Observe {
            shared: self.shared.clone(),
            key: self.key.clone(),
            every,
            last: Yielded::Nothing,
            first: true,
            pending: None,
            ended: false,
        }
    }
}

async fn current(shared: &Arc<Shared>, key: &str) -> Result<Option<LockInfo>, LockError> {
    shared.admit(key)?;
    let backend = shared.backend()?;
    let info = shared
        .run_bounded("inspect", |limit| async move {
            backend.run(&crate::backend::Inspect(key), limit).await
        })
        .await?;
    Ok(info.filter(|info| info.held))
}

/// This instance leads: made by [`LeaderRequest::campaign`]. The lease is renewed until the
/// leadership is [resigned](Self::resign) or dropped (both hand over at once) or the locker
/// [shuts down](crate::Locker::shutdown).
///
/// Leadership can also end without this instance asking: renewal finds the key taken (an
/// operator's `force_release`, a lease that ran out while the process was stopped), or renewal
/// fails until the lease may have ended. [`lost`](Self::lost) resolves in every case, and
/// always *before* the lease can end by the database clock (a margin of a tenth of the ttl, at
/// most a second, before the end the local clock allows): stop acting as the leader when it
/// does, and no two instances ever act as leaders at once. Pass
/// [`fencing_token`](Self::fencing_token) to what the leader writes to, and a write of an old
/// term can be refused even if a paused leader wakes up late.
#[must_use = "dropping a leadership resigns it"]
pub struct Leadership {
    guard: Option<LockGuard>,
    hold: Arc<Hold>,
    margin: Duration,
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("key", &self.hold.key)
            .field("fencing_token", &self.hold.fencing_token)
            .finish()
    }
}

impl Leadership {
    fn new(guard: LockGuard, ttl: Duration) -> Self {
        Leadership {
            hold: guard.hold().clone(),
            guard: Some(guard),
            margin: (ttl / 10).min(Duration::from_secs(1)),
        }
    }

    /// The election's key.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let leadership = locker.leader("scheduler").campaign().await?;
    /// assert_eq!(leadership.key(), "scheduler");
    /// # Ok(()) }
    /// ```
    pub fn key(&self) -> &str {
        &self.hold.key
    }

    /// The term: the lease's fencing token, larger than every earlier leader's.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let first = locker.leader("scheduler").campaign().await?;
    /// let term = first.fencing_token();
    /// first.resign().await?;
    /// let second = locker.leader("scheduler").campaign().await?;
    /// assert!(second.fencing_token() > term);
    /// # Ok(()) }
    /// ```
    pub fn fencing_token(&self) -> u64 {
        self.hold.fencing_token
    }

    /// A proof that this instance leads ([`Held`](crate::Held), an exclusive hold), borrowing
    /// the leadership: pass it to what only the leader may do.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// fn schedule(held: dblock::Held<'_>) -> u64 { held.fencing_token() }
    /// let leadership = locker.leader("scheduler").campaign().await?;
    /// assert_eq!(schedule(leadership.held()), leadership.fencing_token());
    /// leadership.resign().await
    /// # }
    /// ```
    pub fn held(&self) -> crate::Held<'_> {
        self.held_as()
    }

    /// Fences a write with the leadership, as [`LockGuard::fence`](crate::LockGuard::fence):
    /// in the caller's transaction on the lock's database, checks this term is still the
    /// leader's and keeps it so until the commit; `Err(Lost)` once another leads.
    ///
    /// ```
    /// # async fn demo<C: dblock::FenceConnection>(locker: dblock::Locker, tx: &mut C) -> Result<(), dblock::LockError> {
    /// let leadership = locker.leader("scheduler").campaign().await?;
    /// // ... the leader's writes in `tx` ...
    /// leadership.fence(&mut *tx).await?; // still the leader until the commit
    /// # Ok(()) }
    /// ```
    pub async fn fence<C: crate::FenceConnection>(&self, conn: &mut C) -> Result<(), LockError> {
        self.held().fence(conn).await
    }

    /// Records the term's success in the caller's transaction, as
    /// [`LockGuard::succeed_in`](crate::LockGuard::succeed_in): everything
    /// [`fence`](Self::fence) does, and the outcome `Succeeded`.
    pub async fn succeed_in<C: crate::FenceConnection>(
        &self,
        conn: &mut C,
    ) -> Result<(), LockError> {
        self.held().succeed_in(conn).await
    }

    /// [`held`](Self::held) as a typed proof (`Held<'_, K>`).
    pub fn held_as<K: crate::LockMarker>(&self) -> crate::Held<'_, K> {
        match &self.guard {
            Some(guard) => guard.held_as(),
            None => crate::Held::new(&[]),
        }
    }

    /// When the lease ends unless renewed (the database's clock, as of the last renewal).
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let leadership = locker.leader("scheduler").campaign().await?;
    /// assert!(leadership.expires_at() > std::time::SystemTime::UNIX_EPOCH);
    /// # Ok(()) }
    /// ```
    pub fn expires_at(&self) -> SystemTime {
        crate::info::time_from_micros(self.hold.expires_at_us())
    }

    /// `true` once leadership has ended (see [`lost`](Self::lost)).
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let leadership = locker.leader("scheduler").campaign().await?;
    /// assert!(!leadership.is_lost());
    /// # Ok(()) }
    /// ```
    pub fn is_lost(&self) -> bool {
        self.hold.lost_within(self.margin)
    }

    /// Resolves with [`LockError::Lost`] when leadership ends, for any reason: the key was
    /// taken (force-released, or the lease ran out while this process was stopped), renewal
    /// failed until the lease might end, the leadership was resigned or dropped, or the locker
    /// shut down. It resolves before the lease can end on the database clock, so before another
    /// instance can lead. The future owns what it needs: it outlives the `Leadership` (a task
    /// that watches it sees a resignation too). Polled outside a tokio runtime it resolves at
    /// once: `Lost` if leadership has ended, else [`LockError::NoRuntime`].
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let leadership = locker.leader("scheduler").campaign().await?;
    /// let lost = leadership.lost();
    /// let watcher = tokio::spawn(lost);
    /// leadership.resign().await?;
    /// assert!(watcher.await.unwrap().is_lost());
    /// # Ok(()) }
    /// ```
    pub fn lost(&self) -> impl Future<Output = LockError> + Send + 'static {
        let hold = self.hold.clone();
        let margin = self.margin;
        async move {
            if let Err(e) = LockError::require_runtime() {
                if !hold.lost_within(margin) {
                    return e;
                }
            } else {
                hold.ending(margin).await;
            }
            LockError::Lost {
                key: hold.key.clone(),
            }
        }
    }

    /// Gives leadership up: [`lost`](Self::lost) resolves first, then the key is released, and
    /// a waiting campaign takes it at once (on PostgreSQL woken by NOTIFY). `Err` if the lease
    /// had already ended or been taken ([`LockError::NotHeld`]), or the release failed (it then
    /// goes on in the background until the lease ends).
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let leadership = locker.leader("scheduler").campaign().await?;
    /// leadership.resign().await?;
    /// assert!(locker.leader("scheduler").current().await?.is_none());
    /// # Ok(()) }
    /// ```
    pub async fn resign(mut self) -> Result<(), LockError> {
        self.hold.give_up();
        match self.guard.take() {
            Some(guard) => {
                tracing::info!(key = %crate::Escaped(&self.hold.key), fencing_token = self.hold.fencing_token, "resigned");
                guard.release().await
            }
            None => Ok(()),
        }
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        // Over before the guard's own drop releases the key (in the background).
        self.hold.give_up();
    }
}

/// The changes of an election's leader: a [`Stream`](futures_core::Stream) made by
/// [`LeaderRequest::observe`]. Each item is the leader's row (`Some`) or `None` when nobody
/// leads; an item comes first as things are, then on every change of leader or term.
#[must_use = "streams do nothing unless polled"]
pub struct Observe {
    shared: Arc<Shared>,
    key: String,
    every: Duration,
    /// The last leader yielded.
    last: Yielded,
    first: bool,
    pending: Option<Read>,
    /// Shut down, or polled outside a tokio runtime: the error was yielded, the stream is over.
    ended: bool,
}

/// What an [`Observe`] yielded last: a change of leader or term is yielded, the same again is
/// not.
#[derive(PartialEq, Eq)]
enum Yielded {
    /// Nothing yet: the first read is yielded whatever it finds.
    Nothing,
    /// Nobody led.
    Nobody,
    /// This owner led, in this term (fencing token).
    Leader(Option<String>, u64),
}

/// One read of the leader, with the pause before it.
type Read = Pin<Box<dyn Future<Output = Result<Option<LockInfo>, LockError>> + Send>>;

impl fmt::Debug for Observe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Observe")
            .field("key", &self.key)
            .field("every", &self.every)
            .finish()
    }
}

impl futures_core::Stream for Observe {
    type Item = Result<Option<LockInfo>, LockError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        loop {
            let pending = this.pending.get_or_insert_with(|| {
                let (shared, key) = (this.shared.clone(), this.key.clone());
                let pause = if this.first {
                    Duration::ZERO
                } else {
                    this.every
                };
                Box::pin(async move {
                    LockError::require_runtime()?;
                    tokio::time::sleep(pause).await;
                    current(&shared, &key).await
                })
            });
            let read = std::task::ready!(pending.as_mut().poll(cx));
            this.pending = None;
            this.first = false;
            match read {
                Ok(leader) => {
                    let now = match &leader {
                        Some(l) => Yielded::Leader(l.owner.clone(), l.fencing_token),
                        None => Yielded::Nobody,
                    };
                    if this.last != now {
                        this.last = now;
                        return Poll::Ready(Some(Ok(leader)));
                    }
                }
                Err(e) => {
                    this.ended = matches!(e, LockError::NoRuntime | LockError::ShutDown);
                    return Poll::Ready(Some(Err(e)));
                }
            }
        }
    }
}
