//! Lease renewal: ONE background task per [`Locker`](crate::Locker) extends every lease that asked
//! for renewal, all due leases in one statement per tick.
//!
//! A lease is renewed about every ttl/3. When the statement shows a lease is no longer ours
//! (expired and taken, force-released), that hold is marked lost at once. A failed statement is
//! retried while the lease can still be alive; once its conservative local deadline (send time of
//! the last successful extension + ttl) has passed, it is lost too. Dropping a
//! [`Registration`] removes the hold from the set under a plain mutex, so renewal stops the
//! moment the work ends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::backend::{Backend, RenewItem};
use crate::hold::Hold;
use crate::retry::Failure;
use crate::sync::lock;

/// Leases due within this margin of now are sent with the one that woke the task: a twelfth of
/// their ttl (so a lease is renewed at most a quarter of its renewal interval early), between
/// these bounds. Fewer wake-ups and fuller statements for many locks; a little earlier renewal
/// costs nothing, since the statement is sent anyway.
const MIN_WINDOW: Duration = Duration::from_millis(50);
const MAX_WINDOW: Duration = Duration::from_secs(1);
/// At most this many leases per statement.
const MAX_BATCH: usize = 1000;
/// The task checks this often whether its locker is gone.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// The renewal set of one locker, shared with its background task (which holds it weakly).
#[derive(Default)]
pub(crate) struct Renewer {
    holds: Mutex<HashMap<u64, Arc<Hold>>>,
    next_id: AtomicU64,
    started: AtomicBool,
    stopped: AtomicBool,
    wake: Arc<Notify>,
    /// What renewal has cost so far (read by the benchmark through `test_util`).
    pub(crate) stats: RenewStats,
}

/// Counters of the renewal task's work.
#[derive(Default)]
pub(crate) struct RenewStats {
    /// Wake-ups that sent at least one statement.
    pub(crate) ticks: AtomicU64,
    pub(crate) statements: AtomicU64,
    /// Leases sent for extension, over all statements.
    pub(crate) leases: AtomicU64,
    /// Time spent waiting for renewal statements, in µs.
    pub(crate) busy_us: AtomicU64,
}

/// A hold being renewed; dropping it stops the renewal of that hold at once.
pub(crate) struct Registration {
    id: u64,
    renewer: Weak<Renewer>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(renewer) = self.renewer.upgrade() {
            renewer.holds().remove(&self.id);
        }
    }
}

impl Renewer {
    fn holds(&self) -> MutexGuard<'_, HashMap<u64, Arc<Hold>>> {
        lock(&self.holds)
    }

    /// Stops renewing for good (`Locker::shutdown`): the task ends at once.
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        self.holds().clear();
        self.wake.notify_one();
    }

    /// Stops renewing the holds of `key` (and of its semaphore permits, `key ␟ …`) for good:
    /// `dblock::testing::stop_renewal`. How many it stopped.
    #[cfg(feature = "testing")]
    pub(crate) fn forget(&self, key: &str) -> usize {
        let mut holds = self.holds();
        let before = holds.len();
        holds.retain(|_, h| {
            let slot = h
                .key
                .strip_prefix(key)
                .is_some_and(|rest| rest.starts_with('\u{1f}'));
            h.key != key && !slot
        });
        before - holds.len()
    }

    /// Starts renewing `hold` (the task starts with the first registration).
    pub(crate) fn register(self: &Arc<Self>, backend: &Backend, hold: &Arc<Hold>) -> Registration {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.holds().insert(id, hold.clone());
        if !self.started.swap(true, Ordering::SeqCst) {
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(run(
                        Arc::downgrade(self),
                        self.wake.clone(),
                        backend.clone(),
                    ));
                }
                Err(_) => {
                    // No runtime to renew on: the lease will simply end at its ttl.
                    self.started.store(false, Ordering::SeqCst);
                    tracing::warn!(
                        key = %crate::Escaped(&hold.key),
                        "auto_renew outside a tokio runtime; the lease will not be renewed"
                    );
                }
            }
        }
        self.wake.notify_one();
        Registration {
            id,
            renewer: Arc::downgrade(self),
        }
    }
}

/// The background task: sleeps until the earliest lease is due, extends every lease due by then.
async fn run(renewer: Weak<Renewer>, wake: Arc<Notify>, backend: Backend) {
    tracing::debug!(backend = backend.name(), "renewal task started");
    while let Some(shared) = renewer.upgrade() {
        if shared.stopped.load(Ordering::SeqCst) {
            break;
        }
        let next = shared
            .holds()
            .values()
            .filter(|h| !h.released_in.get())
            .map(|h| h.due())
            .min();
        let woken = wake.notified();
        drop(shared); // do not keep the locker alive while sleeping
        let until = next.unwrap_or_else(|| Instant::now() + IDLE_CHECK);
        tokio::select! {
            () = woken => continue,
            () = tokio::time::sleep_until(until) => {}
        }
        let Some(shared) = renewer.upgrade() else {
            break;
        };
        let now = Instant::now();
        let mut due: Vec<Arc<Hold>> = shared
            .holds()
            .values()
            .filter(|h| h.due() <= now + (h.ttl / 12).clamp(MIN_WINDOW, MAX_WINDOW))
            // Released in the caller's transaction: its row is locked until that transaction
            // ends, and committed it is free; either way not to be extended.
            .filter(|h| !h.released_in.get())
            .cloned()
            .collect();
        drop(shared);
        due.sort_by(|a, b| a.key.cmp(&b.key)); // one row order for every batch: no deadlocks
        let started = Instant::now();
        for batch in due.chunks(MAX_BATCH) {
            renew_batch(&backend, batch).await;
        }
        if let (Some(shared), false) = (renewer.upgrade(), due.is_empty()) {
            let stats = &shared.stats;
            stats.ticks.fetch_add(1, Ordering::Relaxed);
            stats
                .statements
                .fetch_add(due.len().div_ceil(MAX_BATCH) as u64, Ordering::Relaxed);
            stats.leases.fetch_add(due.len() as u64, Ordering::Relaxed);
            stats
                .busy_us
                .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        }
    }
    tracing::debug!("renewal task stopped");
}

async fn renew_batch(backend: &Backend, batch: &[Arc<Hold>]) {
    let sent = Instant::now();
    // What each hold may still be extended by (`max_hold`); a hold at its cap is left to end.
    let extensions: Vec<Option<Duration>> =
        batch.iter().map(|h| h.extension(sent, h.ttl)).collect();
    let batch: Vec<(&Arc<Hold>, Duration)> = batch
        .iter()
        .zip(extensions)
        .filter_map(|(h, ext)| match ext {
            Some(ext) => Some((h, ext)),
            None => {
                tracing::debug!(key = %crate::Escaped(h.name()), "max_hold reached: renewal stops, the lease ends");
                h.capped_out();
                None
            }
        })
        .collect();
    if batch.is_empty() {
        return;
    }
    // One row per distinct hold (re-entrant calls register the same tenure twice).
    let mut items: Vec<RenewItem<'_>> = Vec::with_capacity(batch.len());
    for &(h, ext) in &batch {
        let ttl_us = ext
            .saturating_add(h.lock_delay())
            .as_micros()
            .min(i64::MAX as u128) as i64;
        let max_hold_us = h.max_hold_us();
        let owner = h.owner.id();
        match items
            .iter_mut()
            .find(|i| i.key == h.key && i.owner == owner && i.fencing_token == h.fencing_token)
        {
            Some(i) => {
                i.ttl_us = i.ttl_us.max(ttl_us);
                i.max_hold_us = i.max_hold_us.max(max_hold_us);
            }
            None => items.push(RenewItem {
                key: &h.key,
                owner,
                fencing_token: h.fencing_token,
                ttl_us,
                max_hold_us,
            }),
        }
    }
    // Never wait on the statement past the point where a lease could have ended: a hung
    // statement must not keep a lost lease looking alive.
    let limit = batch
        .iter()
        .map(|(h, _)| h.deadline())
        .min()
        .unwrap_or(sent)
        .max(sent + Duration::from_millis(100));
    let result = match backend.extend_many(&items, limit).await {
        // One lease's row is held past the lock wait by a transaction (its holder's fenced
        // one, say): the others are not to fail with it. Each goes again alone.
        Err(failed) if items.len() > 1 && backend.classify(&failed) == Failure::Locked => {
            let alone = futures_util::future::join_all(
                items.chunks(1).map(|one| backend.extend_many(one, limit)),
            )
            .await;
            for (item, result) in items.iter().zip(alone) {
                let of_item: Vec<(&Arc<Hold>, Duration)> = batch
                    .iter()
                    .filter(|(h, _)| {
                        h.key == item.key
                            && h.owner.id() == item.owner
                            && h.fencing_token == item.fencing_token
                    })
                    .copied()
                    .collect();
                settle(backend, &of_item, sent, result);
            }
            return;
        }
        result => result,
    };
    settle(backend, &batch, sent, result);
}

/// Applies a renewal statement's answer to the holds it was for.
fn settle(
    backend: &Backend,
    batch: &[(&Arc<Hold>, Duration)],
    sent: Instant,
    result: Result<crate::backend::Extended, crate::retry::Failed>,
) {
    match result {
        Ok(extended) => {
            for &(h, ext) in batch {
                let owner = h.owner.id();
                let ok = extended
                    .iter()
                    .any(|(k, o, t)| *k == h.key && o == owner && *t == h.fencing_token);
                if ok {
                    h.extended(sent, ext, None);
                    if ext < h.ttl {
                        // The last extension before the cap.
                        h.capped_out();
                    }
                } else {
                    // A definite answer: the row is no longer this tenure's.
                    h.renewal_refused(sent);
                }
            }
            tracing::trace!(leases = batch.len(), "leases extended");
        }
        Err(failed) => {
            let transient = backend.classify(&failed) != Failure::Fatal;
            tracing::warn!(error = %failed.error, transient, "lease renewal failed; retrying while the leases last");
            crate::meter::renewal_failed(backend.name());
            let now = Instant::now();
            for (h, _) in batch {
                h.renewal_failed(now);
            }
        }
    }
}
