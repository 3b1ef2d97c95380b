//! Lease renewal: ONE background task per [`Locker`](crate::Locker) extends every lease that asked
//! for renewal, all due leases in one statement per tick.
//!
//! A lease is renewed about every ttl/3. When the statement shows a lease is no longer ours
//! (expired and taken, force-released), that lease is marked lost at once. A failed statement is
//! retried while the lease can still be alive; once its conservative local deadline (send time of
//! the last successful extension + ttl) has passed, it is lost too. Dropping a [`Lease`] removes
//! it from the set under a plain mutex, so renewal stops the moment the work ends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::backend::{self, Backend, RenewItem};

/// Leases due within this margin of the earliest one are sent in the same statement.
const BATCH_WINDOW: Duration = Duration::from_millis(50);
/// At most this many leases per statement.
const MAX_BATCH: usize = 200;
/// The task checks this often whether its locker is gone.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// The renewal set of one locker, shared with its background task (which holds it weakly).
#[derive(Default)]
pub(crate) struct Renewer {
    entries: Mutex<HashMap<u64, Arc<Entry>>>,
    next_id: std::sync::atomic::AtomicU64,
    started: AtomicBool,
    wake: Arc<Notify>,
}

/// One lease being kept alive.
pub(crate) struct Entry {
    pub(crate) key: String,
    pub(crate) owner: String,
    pub(crate) fencing_token: u64,
    ttl: Duration,
    times: Mutex<Times>,
    lost: AtomicBool,
    lost_signal: Notify,
}

struct Times {
    /// When the next extension should be sent.
    due: Instant,
    /// Past this the lease may have ended (send time of the last success + ttl).
    deadline: Instant,
    /// How many statements in a row failed for it.
    failures: u32,
}

impl Entry {
    fn mark_lost(&self) {
        if !self.lost.swap(true, Ordering::SeqCst) {
            tracing::warn!(key = %self.key, fencing_token = self.fencing_token, "lease lost");
        }
        self.lost_signal.notify_waiters();
    }
}

/// A registration; dropping it stops the renewal of this lease at once.
pub(crate) struct Lease {
    id: u64,
    entry: Arc<Entry>,
    renewer: Weak<Renewer>,
}

impl Lease {
    /// `true` once renewal found the lease gone, or no extension succeeded before the lease's
    /// conservative local deadline (a hung statement, a saturated pool, a stalled task).
    pub(crate) fn is_lost(&self) -> bool {
        self.entry.lost.load(Ordering::SeqCst) || Instant::now() >= times(&self.entry).deadline
    }

    /// Resolves when the lease is lost (see [`is_lost`](Self::is_lost)); never, while renewal
    /// keeps it alive.
    pub(crate) async fn lost(&self) {
        loop {
            let signal = self.entry.lost_signal.notified();
            if self.entry.lost.load(Ordering::SeqCst) {
                return;
            }
            let deadline = times(&self.entry).deadline;
            tokio::select! {
                () = signal => {}
                () = tokio::time::sleep_until(deadline) => {
                    if Instant::now() >= times(&self.entry).deadline {
                        self.entry.mark_lost();
                        return;
                    }
                }
            }
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(renewer) = self.renewer.upgrade() {
            renewer.lock_entries().remove(&self.id);
        }
    }
}

impl Renewer {
    fn lock_entries(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Entry>>> {
        self.entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Starts renewing a lease acquired at `sent` (the acquire's send time) for `ttl`.
    pub(crate) fn register(
        self: &Arc<Self>,
        backend: &Backend,
        key: &str,
        owner: &str,
        fencing_token: u64,
        ttl: Duration,
        sent: Instant,
    ) -> Lease {
        let entry = Arc::new(Entry {
            key: key.to_owned(),
            owner: owner.to_owned(),
            fencing_token,
            ttl,
            times: Mutex::new(Times {
                due: sent + ttl / 3,
                deadline: sent + ttl,
                failures: 0,
            }),
            lost: AtomicBool::new(false),
            lost_signal: Notify::new(),
        });
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.lock_entries().insert(id, entry.clone());
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
                        key,
                        "auto_renew outside a tokio runtime; the lease will not be renewed"
                    );
                }
            }
        }
        self.wake.notify_one();
        Lease {
            id,
            entry,
            renewer: Arc::downgrade(self),
        }
    }
}

fn times(entry: &Entry) -> std::sync::MutexGuard<'_, Times> {
    entry
        .times
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The background task: sleeps until the earliest lease is due, extends every lease due by then.
async fn run(renewer: Weak<Renewer>, wake: Arc<Notify>, backend: Backend) {
    tracing::debug!(backend = backend.name(), "renewal task started");
    while let Some(shared) = renewer.upgrade() {
        let next = shared.lock_entries().values().map(|e| times(e).due).min();
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
        let mut due: Vec<Arc<Entry>> = shared
            .lock_entries()
            .values()
            .filter(|e| times(e).due <= now + BATCH_WINDOW)
            .cloned()
            .collect();
        drop(shared);
        due.sort_by(|a, b| a.key.cmp(&b.key)); // one row order for every batch: no deadlocks
        for batch in due.chunks(MAX_BATCH) {
            renew_batch(&backend, batch).await;
        }
    }
    tracing::debug!("renewal task stopped: locker dropped");
}

async fn renew_batch(backend: &Backend, batch: &[Arc<Entry>]) {
    // One row per distinct hold (re-entrant calls register the same hold twice).
    let mut items: Vec<RenewItem<'_>> = Vec::with_capacity(batch.len());
    for e in batch {
        let ttl_us = e.ttl.as_micros().min(i64::MAX as u128) as i64;
        match items
            .iter_mut()
            .find(|i| i.key == e.key && i.owner == e.owner && i.fencing_token == e.fencing_token)
        {
            Some(i) => i.ttl_us = i.ttl_us.max(ttl_us),
            None => items.push(RenewItem {
                key: &e.key,
                owner: &e.owner,
                fencing_token: e.fencing_token,
                ttl_us,
            }),
        }
    }
    let sent = Instant::now();
    // Never wait on the statement past the point where a lease could have ended: a hung
    // statement must not keep a lost lease looking alive.
    let limit = batch
        .iter()
        .map(|e| times(e).deadline)
        .min()
        .unwrap_or(sent)
        .max(sent + Duration::from_millis(100));
    let outcome = tokio::time::timeout_at(limit, backend.extend_many(&items))
        .await
        .unwrap_or_else(|_| {
            Err(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "lease renewal statement timed out",
            )))
        });
    match outcome {
        Ok(extended) => {
            for e in batch {
                let ok = extended
                    .iter()
                    .any(|(k, o, t)| *k == e.key && *o == e.owner && *t == e.fencing_token);
                if ok {
                    let mut t = times(e);
                    t.due = sent + e.ttl / 3;
                    t.deadline = t.deadline.max(sent + e.ttl);
                    t.failures = 0;
                } else {
                    // A definite answer: the row is no longer this tenure's.
                    e.mark_lost();
                    times(e).due = sent + Duration::from_secs(3600);
                }
            }
            tracing::trace!(leases = items.len(), "leases extended");
        }
        Err(error) => {
            let transient = backend::classify(&error) != backend::Failure::Fatal;
            tracing::warn!(%error, transient, "lease renewal failed; retrying while the leases last");
            let now = Instant::now();
            for e in batch {
                let mut t = times(e);
                t.failures += 1;
                if now >= t.deadline {
                    drop(t);
                    e.mark_lost();
                    times(e).due = now + Duration::from_secs(3600);
                } else {
                    // Back off, but keep a few tries inside what is left of the lease.
                    let left = t.deadline - now;
                    let pause =
                        Duration::from_millis(50 * u64::from(t.failures.min(20))).min(left / 3);
                    t.due = now + pause.max(Duration::from_millis(10));
                }
            }
        }
    }
}
