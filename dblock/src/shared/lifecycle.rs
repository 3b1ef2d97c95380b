//! A locker's life: the holds its guards have (tracked so that re-entry, an operator's
//! release and `shutdown` find them), the releases still on their way, `drain` and `shutdown`.

use super::*;

/// What a locker and all its `table()` copies share: whether `shutdown` ran, every copy (to stop
/// its renewal and listener), and the holds of their live guards, with the copy each belongs to.
#[derive(Default)]
pub(super) struct Lifecycle {
    /// Set by `Locker::shutdown`: no more locks.
    pub(super) closed: AtomicBool,
    /// Set by `Locker::drain`: no new holds (re-entries still), the holds taken go on.
    draining: AtomicBool,
    /// Releases of holds no longer tracked (a guard given back or dropped) still being sent:
    /// `drain` waits for them too.
    releasing: std::sync::atomic::AtomicUsize,
    copies: Mutex<Vec<Weak<Shared>>>,
    live: Mutex<Live>,
    /// The tables a background purge runs for, each with its task (`purging.rs`).
    pub(super) purging: Mutex<HashMap<String, tokio::task::AbortHandle>>,
}

impl Lifecycle {
    /// `copy` (a new locker or `table()` copy) shares this life: shut down together.
    pub(super) fn join(&self, copy: &Arc<Shared>) {
        let mut copies = lock(&self.copies);
        copies.retain(|c| c.strong_count() > 0);
        copies.push(Arc::downgrade(copy));
    }

    /// A live copy that purges by itself (on `table` if there is one), if any is left: the
    /// locker, or a `table()` copy of it, is still in use.
    pub(super) fn purging_copy(&self, table: &str) -> Option<Arc<Shared>> {
        let copies: Vec<Arc<Shared>> = lock(&self.copies)
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|c| c.auto_purge.is_some())
            .collect();
        let on_table = copies.iter().position(|c| c.table == table);
        copies.into_iter().nth(on_table.unwrap_or(0))
    }
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
    /// `Err(ShutDown)` once `Locker::shutdown` ran (on this locker or any `table()` copy).
    pub(crate) fn check_open(&self) -> Result<(), LockError> {
        if self.lifecycle.closed.load(Ordering::SeqCst) {
            Err(LockError::ShutDown)
        } else {
            Ok(())
        }
    }

    /// What every call on a key checks before it sends anything: a tokio runtime to run in
    /// (`Config`), a locker not shut down (`ShutDown`), a valid key (`InvalidKey`).
    pub(crate) fn admit(&self, key: &str) -> Result<(), LockError> {
        LockError::require_runtime()?;
        self.check_open()?;
        crate::validate::key(key)
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

    pub(super) fn live(&self) -> std::sync::MutexGuard<'_, Live> {
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
        drop(live);
        self.purge_in_background();
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
        let mut holds = self.tracked_holds_of(key);
        holds.retain(|h| !h.is_lost());
        holds
    }

    /// Whether the live guards of this locker and its copies have holds of `key` by `owner`, all
    /// of them lost (the lease ran out, or it was taken): the process still tracks them until
    /// the guards give them back, but they hold nothing a `reentrant(false)` call must wait for.
    pub(crate) fn only_lost_holds(&self, key: &str, owner: &Owner) -> bool {
        let mut holds = self.tracked_holds_of(key);
        holds.retain(|h| h.owner == *owner);
        !holds.is_empty() && holds.iter().all(|h| h.is_lost())
    }

    /// Every hold of `key` that a live guard in this locker's table has (any of its lockers),
    /// lost or not.
    fn tracked_holds_of(&self, key: &str) -> Vec<Arc<Hold>> {
        self.live()
            .values()
            .filter(|(_, of)| of.upgrade().is_some_and(|of| of.space == self.space))
            .filter_map(|(h, _)| h.upgrade())
            .filter(|h| h.key == key)
            .collect()
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
}

/// Settles a revoked hold when dropped: when its shutdown release is over, however it ends.
struct Settle(Arc<Hold>);

impl Drop for Settle {
    fn drop(&mut self) {
        self.0.settle();
    }
}
