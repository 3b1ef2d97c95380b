//! The private core a [`Locker`](crate::Locker) shares with its guards and its renewal task: the
//! backend, the renewal set, the holder label, and the owner-checked operations (acquire
//! statement, release, extend) run under the retry policy and the per-(owner, key)
//! serialisation that makes those retries exact.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::coalesce::Coalescer;
use crate::backend::{Acquire, Attempt, Backend, Failed, LastWrite, Outcome, Released};
use crate::connect::ConnectOptions;
use crate::error::LockError;
use crate::hold::{Caller, Hold};
use crate::owner::Owner;
use crate::registry::{serialise, Serial, Tracked};
use crate::renew::Renewer;
use crate::retry::{self, Policy, Tried};
use crate::sync::lock;
use crate::validate;

mod release;

pub(crate) struct Shared {
    /// `Err` when `table()` was given a bad name: every call then reports it.
    backend: Result<Backend, String>,
    /// The leases this locker keeps alive, and its one renewal task.
    pub(crate) renewer: Arc<Renewer>,
    pub(crate) table: String,
    /// The database and table: where an owner's holds of a key are tracked (two lockers of one
    /// table share it; the same key in two tables or databases is two locks).
    space: Arc<str>,
    /// `host/pid`: the start of every `holder` value this locker writes (shared by every
    /// lock taken without a label).
    pub(crate) holder: Arc<str>,
    /// Longest time one statement may take (`ConnectOptions::statement_timeout`).
    pub(crate) statement_timeout: Duration,
    /// The default lock-delay of its requests (`ConnectOptions::lock_delay`).
    pub(crate) lock_delay: Duration,
    /// Whether concurrent statements share a round trip (`ConnectOptions::coalesce`).
    coalesce: bool,
    /// Where they do (`backend/coalesce/`): one per table copy, since a statement writes one
    /// table.
    pub(crate) coalescer: Coalescer,
    /// Shared with every `table()` copy: shut down together.
    lifecycle: Arc<Lifecycle>,
    /// The copy on this table's semaphore permits (`backend::permits_table`), made on first
    /// use: one per locker, so that the holds of its guards are found again (re-entry).
    permits: std::sync::OnceLock<Arc<Shared>>,
}

/// What a locker's core is built with, from its `ConnectOptions`.
#[derive(Clone, Copy)]
struct Tuning {
    statement_timeout: Duration,
    coalesce: bool,
    lock_delay: Duration,
}

/// What a locker and all its `table()` copies share: whether `shutdown` ran, every copy (to stop
/// its renewal and listener), and the holds of their live guards, with the copy each belongs to.
#[derive(Default)]
struct Lifecycle {
    /// Set by `Locker::shutdown`: no more locks.
    closed: AtomicBool,
    /// Set by `Locker::drain`: no new holds (re-entries still), the holds taken go on.
    draining: AtomicBool,
    /// Releases of holds no longer tracked (a guard given back or dropped) still being sent:
    /// `drain` waits for them too.
    releasing: std::sync::atomic::AtomicUsize,
    copies: Mutex<Vec<Weak<Shared>>>,
    live: Mutex<Live>,
}

/// A release on its way, counted for `Locker::drain` until dropped.
pub(crate) struct Releasing(Arc<Lifecycle>);

impl Drop for Releasing {
    fn drop(&mut self) {
        self.0.releasing.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The holds of live guards by the hold's address, each with the copy it belongs to.
type Live = HashMap<usize, (Weak<Hold>, Weak<Shared>), foldhash::fast::RandomState>;

impl Shared {
    pub(crate) fn new(backend: Result<Backend, String>, table: &str, holder: String) -> Arc<Self> {
        Self::with_options(backend, table, holder, &ConnectOptions::default())
    }

    /// A locker's core as `options` say (statement time-out, coalescing).
    pub(crate) fn with_options(
        backend: Result<Backend, String>,
        table: &str,
        holder: String,
        options: &ConnectOptions,
    ) -> Arc<Self> {
        let tuning = Tuning {
            statement_timeout: options.statement_timeout,
            coalesce: options.coalesce,
            lock_delay: options.lock_delay,
        };
        Self::in_lifecycle(backend, table, holder, tuning, Arc::default())
    }

    fn in_lifecycle(
        backend: Result<Backend, String>,
        table: &str,
        holder: String,
        tuning: Tuning,
        lifecycle: Arc<Lifecycle>,
    ) -> Arc<Self> {
        let Tuning {
            statement_timeout,
            coalesce,
            lock_delay,
        } = tuning;
        let coalescer = Coalescer::new(backend.as_ref().ok().cloned(), coalesce);
        let space = match &backend {
            Ok(b) => format!("{}|{table}", b.database()),
            Err(_) => String::new(),
        };
        let shared = Arc::new(Shared {
            backend,
            renewer: Arc::default(),
            table: table.to_owned(),
            space: space.into(),
            holder: holder.into(),
            statement_timeout,
            lock_delay,
            coalesce,
            coalescer,
            lifecycle,
            permits: std::sync::OnceLock::new(),
        });
        let mut copies = lock(&shared.lifecycle.copies);
        copies.retain(|c| c.strong_count() > 0);
        copies.push(Arc::downgrade(&shared));
        drop(copies);
        shared
    }

    /// `Err(ShutDown)` once `Locker::shutdown` ran (on this locker or any `table()` copy).
    pub(crate) fn check_open(&self) -> Result<(), LockError> {
        if self.lifecycle.closed.load(Ordering::SeqCst) {
            Err(LockError::ShutDown)
        } else {
            Ok(())
        }
    }

    /// `Err(ShutDown)` once `Locker::drain` (or `shutdown`) ran: what a call that would take a
    /// new hold (not a re-entry of one the owner holds) checks before each attempt.
    pub(crate) fn check_taking(&self) -> Result<(), LockError> {
        if self.lifecycle.draining.load(Ordering::SeqCst) {
            return Err(LockError::ShutDown);
        }
        self.check_open()
    }

    /// Stops new holds, waits until every hold of this locker and its `table()` copies has
    /// ended or `grace` has passed, then shuts down (`Locker::drain`). How many holds were still
    /// live at the end, released by the shutdown.
    pub(crate) async fn drain(self: &Arc<Self>, grace: Duration) -> usize {
        self.lifecycle.draining.store(true, Ordering::SeqCst);
        let until = crate::timing::after(Instant::now(), grace);
        // The holds still tracked, and the releases of those already given back still on
        // their way (a drain that returned before them would let the process exit with the
        // keys held until their leases end).
        let live = |me: &Self| {
            let holds = me
                .live()
                .values()
                .filter(|(h, _)| h.upgrade().is_some_and(|h| !h.is_lost()))
                .count();
            holds + me.lifecycle.releasing.load(Ordering::SeqCst)
        };
        tracing::info!(holds = live(self), ?grace, table = %self.table, "draining: no new holds");
        if LockError::require_runtime().is_ok() {
            while live(self) > 0 && Instant::now() < until {
                tokio::time::sleep(crate::timing::DRAIN_POLL.min(until - Instant::now())).await;
            }
        }
        let cut = live(self);
        if cut > 0 {
            tracing::warn!(
                holds = cut,
                "drained for its grace time: the holds left are released"
            );
        }
        self.shutdown().await;
        cut
    }

    /// The database and table: where one owner's holds of a key are tracked, and where the
    /// waiters of a key line up (`line.rs`).
    pub(crate) fn space(&self) -> &Arc<str> {
        &self.space
    }

    fn live(&self) -> std::sync::MutexGuard<'_, Live> {
        lock(&self.lifecycle.live)
    }

    /// A guard of this locker now has `hold`; `false` (not tracked) if the locker was shut
    /// down meanwhile: the caller gives the hold back. Checked under the same lock `shutdown`
    /// takes to collect the holds, so a grant that arrives while it runs is either among them
    /// or refused here, never left behind.
    #[must_use]
    pub(crate) fn track(self: &Arc<Self>, hold: &Arc<Hold>) -> bool {
        let mut live = self.live();
        if self.lifecycle.closed.load(Ordering::SeqCst) {
            return false;
        }
        live.insert(
            Arc::as_ptr(hold) as usize,
            (Arc::downgrade(hold), Arc::downgrade(self)),
        );
        true
    }

    /// Whether a live guard of this locker, taken by `caller` as another owner than `owner`,
    /// holds `key`: then a wait of `caller` for `key` ends only at its deadline, unless another
    /// future of the same task releases it.
    pub(crate) fn held_by_caller(&self, key: &str, caller: Caller, owner: &Owner) -> bool {
        self.holds_any(|h| h.key == key && h.caller == caller && h.owner != *owner)
    }

    /// Whether a live guard of this locker holds `key` as `owner`: a new call of that owner is
    /// a re-entry, which never waits in the fair queue (it would wait for its own waiters).
    pub(crate) fn held_by_owner(&self, key: &str, owner: &Owner) -> bool {
        self.holds_any(|h| h.key == key && h.owner == *owner)
    }

    /// Whether a live guard of this locker has a hold, not lost, for which `matches` is true.
    fn holds_any(&self, matches: impl Fn(&Hold) -> bool) -> bool {
        self.live()
            .values()
            .filter(|(_, of)| std::ptr::eq(of.as_ptr(), self))
            .filter_map(|(h, _)| h.upgrade())
            .any(|h| !h.is_lost() && matches(&h))
    }

    /// The tenure in which `owner` holds `key` as a member of its row (a live read hold of this
    /// locker's table that this process tracks): a new read of the owner is then a re-entry.
    pub(crate) fn member_tenure(&self, key: &str, owner: &Owner) -> Option<u64> {
        self.holds_of(key)
            .into_iter()
            .find(|h| h.member().is_some_and(|m| m.owner() == owner))
            .map(|h| h.fencing_token)
    }

    /// The live holds of `key` that this process tracks in this locker's table (any of its
    /// lockers): a read's re-entry looks among them, and an operator freeing the key's row
    /// ([`Locker::force_release`], [`Locker::steal`]) takes them first, so that they learn at
    /// once that they lost it.
    ///
    /// [`Locker::force_release`]: crate::Locker::force_release
    /// [`Locker::steal`]: crate::Locker::steal
    pub(crate) fn holds_of(&self, key: &str) -> Vec<Arc<Hold>> {
        self.live()
            .values()
            .filter(|(_, of)| of.upgrade().is_some_and(|of| of.space == self.space))
            .filter_map(|(h, _)| h.upgrade())
            .filter(|h| h.key == key && !h.is_lost())
            .collect()
    }

    /// Frees `key`'s row of this table now if `owner` holds it (`""`: whoever holds it; an
    /// operator's force-release, a steal; `what` names it in errors): whether a row was freed.
    /// The holds this process has of the key (of that owner), known before the statement,
    /// learn at once that they are lost (a hold taken after it is a new tenure).
    pub(crate) async fn free(&self, what: &str, key: &str, owner: &str) -> Result<bool, LockError> {
        let mut holds = self.holds_of(key);
        if !owner.is_empty() {
            holds.retain(|h| h.owner.id() == owner);
        }
        let backend = self.backend()?;
        let statement = crate::backend::ForceRelease { key, owner };
        let freed = self
            .run_bounded(what, |limit| backend.run(&statement, limit))
            .await?;
        if freed {
            holds.iter().for_each(|h| h.taken_away());
        }
        Ok(freed)
    }

    /// The guard of `hold` is giving it back (or dropped): counted as a release on its way
    /// (for `drain`) until the returned token is dropped, when the release is over.
    pub(crate) fn untrack(&self, hold: &Arc<Hold>) -> Releasing {
        self.lifecycle.releasing.fetch_add(1, Ordering::SeqCst);
        let releasing = Releasing(self.lifecycle.clone());
        self.live().remove(&(Arc::as_ptr(hold) as usize));
        releasing
    }

    /// Stops taking locks, releases every hold of this locker's guards and those of its
    /// `table()` copies (recording failures; their locked bodies end with `Lost`), stops their
    /// renewal and listeners. Idempotent.
    pub(crate) async fn shutdown(self: &Arc<Self>) {
        let holds: Vec<(Arc<Hold>, Arc<Shared>)> = {
            let mut live = self.live();
            if self.lifecycle.closed.swap(true, Ordering::SeqCst) {
                return;
            }
            live.drain()
                .filter_map(|(_, (h, of))| Some((h.upgrade()?, of.upgrade()?)))
                .collect()
        };
        let copies: Vec<Arc<Shared>> = lock(&self.lifecycle.copies)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for copy in &copies {
            copy.renewer.stop();
            if let Ok(backend) = copy.backend() {
                backend.stop_listening();
            }
        }
        tracing::info!(holds = holds.len(), table = %self.table, "shutting down: releasing every hold");
        // Every hold is revoked before any release starts, so a body that hears one of its
        // holds settled finds all the others revoked too (and waits for them).
        let revoked: Vec<_> = holds.into_iter().filter(|(h, _)| h.revoke()).collect();
        if LockError::require_runtime().is_err() {
            // No runtime to send the releases on: each hold is over here and its lease left to
            // run out on the database (the renewal is stopped above).
            for (h, _) in revoked {
                tracing::warn!(key = %crate::Escaped(&h.key), "shutdown outside a tokio runtime: the hold is left to expire");
                h.settle();
            }
            return;
        }
        let mut releases = tokio::task::JoinSet::new();
        for (h, shared) in revoked {
            releases.spawn(async move {
                // Whoever waits on the hold (its locked body, `lost()`) hears only once this
                // release is over, even if it is cut short by dropping `shutdown()`.
                let settle = Settle(h.clone());
                let until = Instant::now() + shared.statement_timeout;
                if let Err(e) = shared.release(&h, Some(Outcome::Failed), until).await {
                    tracing::warn!(key = %crate::Escaped(&h.key), error = %e, "release at shutdown failed; the lease will expire on its own");
                }
                drop(settle);
            });
        }
        while releases.join_next().await.is_some() {}
    }

    /// A core of its own on `backend`, with this one's table, holder and tuning (test hooks
    /// that change how the backend talks).
    #[cfg(feature = "_test-util")]
    pub(crate) fn on_backend(&self, backend: Backend) -> Arc<Self> {
        let tuning = Tuning {
            statement_timeout: self.statement_timeout,
            coalesce: self.coalesce,
            lock_delay: self.lock_delay,
        };
        Self::in_lifecycle(
            Ok(backend),
            &self.table,
            self.holder.to_string(),
            tuning,
            Arc::default(),
        )
    }

    /// The same database and holder, another table (checked here: a bad name makes every call
    /// on the result fail with `Config`).
    pub(crate) fn with_table(&self, name: &str) -> Arc<Self> {
        let backend = validate::table(name).and_then(|()| match &self.backend {
            Ok(b) => Ok(b.with_table(name)),
            Err(e) => Err(e.clone()),
        });
        let tuning = Tuning {
            statement_timeout: self.statement_timeout,
            coalesce: self.coalesce,
            lock_delay: self.lock_delay,
        };
        Self::in_lifecycle(
            backend,
            name,
            self.holder.to_string(),
            tuning,
            self.lifecycle.clone(),
        )
    }

    /// The copy of this locker on its semaphore permits' table (same database, lifecycle and
    /// holder; `backend::permits_table`).
    pub(crate) fn permits(&self) -> &Arc<Self> {
        self.permits
            .get_or_init(|| self.with_table(&crate::backend::permits_table(&self.table)))
    }

    /// The key of a live hold of this locker's guards, as `owner`, whose key starts with
    /// `prefix` (a semaphore's permit: re-entry takes the same one again).
    pub(crate) fn held_with_prefix(&self, prefix: &str, owner: &Owner) -> Option<String> {
        self.live()
            .values()
            .filter(|(_, of)| std::ptr::eq(of.as_ptr(), self))
            .filter_map(|(h, _)| h.upgrade())
            .find(|h| !h.is_lost() && h.owner == *owner && h.key.starts_with(prefix))
            .map(|h| h.key.clone())
    }

    pub(crate) fn backend(&self) -> Result<&Backend, LockError> {
        self.backend
            .as_ref()
            .map_err(|e| LockError::Config(e.clone()))
    }

    /// The longest the locker's lock statements wait for a row lock (`Backend::row_lock_wait`);
    /// zero without a backend.
    pub(crate) fn row_lock_wait(&self) -> Duration {
        self.backend
            .as_ref()
            .map_or(Duration::ZERO, |b| b.row_lock_wait(self.statement_timeout))
    }

    /// Whether a failed statement was rolled back for a row lock not had within the lock wait
    /// ([`Failure::Locked`](crate::retry::Failure::Locked)).
    pub(crate) fn locked(&self, failed: &crate::retry::Failed) -> bool {
        self.backend
            .as_ref()
            .is_ok_and(|b| b.classify(failed) == crate::retry::Failure::Locked)
    }

    /// Whether statements on the caller's connections (`fence`) must go as simple queries with
    /// inlined values: PostgreSQL behind a transaction pooler.
    pub(crate) fn simple_statements(&self) -> bool {
        self.backend.as_ref().is_ok_and(Backend::pooler)
    }

    pub(crate) fn backend_name(&self) -> &'static str {
        self.backend.as_ref().map_or("invalid", Backend::name)
    }

    /// The holder text for a lock taken with `label` (`host/pid/label`; an empty label is no
    /// label); a label longer than 255 bytes or with a NUL byte is refused.
    pub(crate) fn holder_for(&self, label: Option<&str>) -> Result<Arc<str>, LockError> {
        Ok(match label.filter(|l| !l.is_empty()) {
            Some(label) => {
                validate::label(label)?;
                validate::holder(format!("{}/{label}", self.holder)).into()
            }
            None => self.holder.clone(),
        })
    }

    /// Runs a statement that nothing depends on resolving (a read, an operator action, an
    /// extension) for at most one statement time-out, resending within it.
    pub(crate) async fn run_bounded<T, Op, Fut>(&self, what: &str, op: Op) -> Result<T, LockError>
    where
        Op: FnMut(Instant) -> Fut,
        Fut: Future<Output = Result<T, Failed>>,
    {
        let backend = self.backend()?;
        let tried = retry::run(
            Policy::within(self.statement_timeout),
            |f| backend.classify(f),
            op,
        )
        .await;
        tried
            .result
            .map_err(|f| LockError::database(f.error, tried.after_unknown, what))
    }

    /// Sends one acquire statement for `a` under `policy`: again after rollbacks, and after an
    /// unknown outcome with the same attempt id (so an earlier, unacknowledged success is
    /// recognised, not counted twice) until the outcome is known or `policy.resolve_until`.
    /// Serialised with the owner's other statements on the key; re-entry counts only the holds
    /// this process tracks. A grant is recorded as tracked before it is returned.
    ///
    /// The owner's serialisation comes back with the result: a grant that must be given back
    /// (it arrived too late) is released under it, so no other statement of the owner on the key
    /// can come between.
    pub(crate) async fn acquire(
        &self,
        owner: &Owner,
        mut a: Acquire<'_>,
        policy: Policy,
    ) -> (Tried<Attempt>, Option<Serial>) {
        let backend = match self.backend() {
            Ok(b) => b,
            Err(e) => {
                let tried = Tried {
                    result: Err(Failed {
                        error: sqlx::Error::Configuration(e.to_string().into()),
                        sent: false,
                        class: None,
                    }),
                    after_unknown: false,
                };
                return (tried, None);
            }
        };
        let mut tracked = serialise(&self.space, owner, a.key).await;
        tracked.fill(&mut a);
        let tried = retry::run(
            policy,
            |f| backend.classify(f),
            |limit| self.coalescer.acquire(backend, &a, limit),
        )
        .await;
        if let Ok(attempt) = &tried.result {
            tracked.note(attempt);
        }
        (tried, Some(tracked))
    }

    /// [`acquire`](Self::acquire) for several keys of one owner in one statement
    /// ([`Backend::acquire_many`]): `all` sorted by key, distinct. The owner's serialisations of
    /// every key are taken in that order (so two such calls of one owner cannot deadlock in the
    /// process) and come back with the answer, one per key. `Ok(None)`: the dialect has no such
    /// statement.
    pub(crate) async fn acquire_all(
        &self,
        owner: &Owner,
        mut all: Vec<Acquire<'_>>,
        policy: Policy,
    ) -> Result<(Tried<Option<Vec<Attempt>>>, Vec<Serial>), LockError> {
        let backend = self.backend()?;
        let mut serials = Vec::with_capacity(all.len());
        for a in &mut all {
            let tracked = serialise(&self.space, owner, a.key).await;
            tracked.fill(a);
            serials.push(tracked);
        }
        let Some(statement) = crate::backend::AcquireMany::of(&all) else {
            let none = Tried {
                result: Ok(Some(Vec::new())),
                after_unknown: false,
            };
            return Ok((none, serials));
        };
        let tried = backend.retried(&statement, policy).await;
        if let Ok(Some(attempts)) = &tried.result {
            for (tracked, attempt) in serials.iter_mut().zip(attempts) {
                tracked.note(attempt);
            }
        }
        Ok((tried, serials))
    }

    /// Makes the lease end no earlier than `ttl` from now (database clock); `NotHeld` when it
    /// is no longer this tenure's. An extension only moves the end, so any resend is harmless.
    pub(crate) async fn extend(&self, hold: &Hold, ttl: Duration) -> Result<(), LockError> {
        validate::ttl_micros(ttl)?;
        let backend = self.backend()?;
        let sent = Instant::now();
        // Never past the hold's `max_hold`: at the cap there is nothing left to extend.
        let Some(ttl) = hold.extension(sent, ttl) else {
            return Err(LockError::Lost {
                key: hold.name().to_owned(),
            });
        };
        let ttl_us = validate::lease_micros(ttl, hold.lock_delay())?;
        let statement = crate::backend::Extend {
            hold: hold.as_ref(),
            ttl_us,
            max_hold_us: hold.max_hold_us(),
        };
        let extended = self
            .run_bounded("extend", |limit| {
                self.coalescer.extend(backend, &statement, limit)
            })
            .await?;
        match extended {
            Some(expires_at_us) => {
                hold.extended(sent, ttl, expires_at_us);
                tracing::trace!(key = %crate::Escaped(&hold.key), "lease extended");
                Ok(())
            }
            None if hold.deadline() > sent => {
                // The lease was still running: it was taken (stolen, force-released).
                tracing::debug!(key = %crate::Escaped(&hold.key), "extend refused: lease taken");
                hold.renewal_refused(Instant::now());
                Err(LockError::Lost {
                    key: hold.name().to_owned(),
                })
            }
            None => {
                tracing::debug!(key = %crate::Escaped(&hold.key), "extend refused: lease no longer ours");
                Err(LockError::NotHeld {
                    key: hold.name().to_owned(),
                })
            }
        }
    }
}

/// Settles a revoked hold when dropped: when its shutdown release is over, however it ends.
struct Settle(Arc<Hold>);

impl Drop for Settle {
    fn drop(&mut self) {
        self.0.settle();
    }
}

/// `host/pid`, for the `holder` column.
pub(crate) fn default_holder() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".into());
    validate::holder(format!("{host}/{}", std::process::id()))
}
