//! Fair waiting across processes ([`LockRequest::fair`](crate::LockRequest::fair)): the callers
//! of one key take tickets in a queue table in the database and attempt the key in ticket order.
//!
//! The shape is Redisson's fair lock, on rows instead of a Redis list: a caller first asks
//! whether anyone live is queued for the key; if nobody is, it attempts at once (a free key costs
//! one read more than an unfair call), and only if that attempt finds the key busy does it take a
//! ticket. From then on it attempts only while no live ticket is ahead of its own; the others
//! just read the queue, so a release is followed by one attempt, not a herd. Once at the head it
//! stays there (tickets only rise) and attempts as an unfair waiter would, woken the same way.
//!
//! Each ticket is a short lease on the database clock
//! ([`WAITER_LEASE`](crate::timing::WAITER_LEASE)), renewed while its caller waits: a waiter that
//! dies, or stops, stops holding the queue up within that lease. A caller that gets the key, gives
//! up, fails or is dropped leaves the queue (a dropped one from a task of its own). The queue only
//! orders attempts: who holds the key is decided by the acquire statement alone, so nothing here
//! can let two owners hold it. What it can cost is time: a waiter that died at the head keeps the
//! key idle for at most [`WAITER_LEASE`](crate::timing::WAITER_LEASE).
//!
//! Owners that already hold the key (re-entry) never queue: they would wait behind waiters that
//! wait for them. Callers without `fair()` do not look at the queue and may take a free key
//! ahead of it.

use std::sync::Arc;

use tokio::time::Instant;

use crate::backend::QueueStep;
use crate::error::LockError;
use crate::shared::Shared;
use crate::timing::{TOUCH_AFTER, WAITER_LEASE};

/// Where a fair caller stands in the queue of its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    /// Nobody live is ahead: it attempts the key (and, busy, is woken as any waiter is).
    Head,
    /// This many waiters are ahead (counted up to 8). Nothing wakes a waiter when the one
    /// ahead of it takes the key and leaves the queue, so it looks again after a pause that
    /// doubles with each place between it and the head: the next in line looks every few
    /// milliseconds and is at the head as soon as the key changes hands, those far back
    /// rarely. The reads of a whole queue come to a few hundred a second, however long it is.
    Behind(u32),
}

/// One fair caller's place in the queue of its key.
pub(crate) struct Fair {
    shared: Arc<Shared>,
    key: String,
    owner: String,
    /// The ticket, once an attempt found the key busy; `None` before.
    ticket: Option<i64>,
    /// When the ticket's lease was last renewed (by the local monotonic clock, at the send).
    touched: Instant,
    /// Nobody live was ahead of the ticket at the last look: later tickets are all behind it.
    at_head: bool,
}

impl Fair {
    pub(crate) fn new(shared: Arc<Shared>, key: &str, owner: &str) -> Self {
        Fair {
            shared,
            key: key.to_owned(),
            owner: owner.to_owned(),
            ticket: None,
            touched: Instant::now(),
            at_head: false,
        }
    }

    /// Where this caller stands: it may attempt the key now (nobody live is queued ahead of
    /// it), it is next, or it is further back. Renews its ticket when due; a ticket that ran out
    /// meanwhile (a stall longer than its lease) is replaced by one at the back. A newcomer that
    /// finds others queued takes its ticket behind them.
    pub(crate) async fn place(&mut self) -> Result<Place, LockError> {
        if let Some(ticket) = self.ticket {
            if self.touched.elapsed() >= TOUCH_AFTER {
                let sent = Instant::now();
                let kept = self
                    .step(QueueStep::Touch {
                        key: &self.key,
                        owner: &self.owner,
                        ticket,
                        lease_us: lease_us(),
                    })
                    .await?;
                if kept == 0 {
                    tracing::debug!(ticket, "ticket ran out while waiting: back of the queue");
                    self.ticket = None;
                    self.at_head = false;
                    self.join().await?;
                } else {
                    self.touched = sent;
                }
            }
        }
        if self.at_head {
            return Ok(Place::Head);
        }
        let ahead = self
            .step(QueueStep::Ahead {
                key: &self.key,
                ticket: self.ticket.unwrap_or(i64::MAX),
            })
            .await?;
        if ahead == 0 {
            // Without a ticket, "nobody queued" holds only for this look.
            self.at_head = self.ticket.is_some();
            tracing::trace!(ticket = ?self.ticket, "fair: nobody ahead");
            return Ok(Place::Head);
        }
        if self.ticket.is_none() {
            self.join().await?;
        }
        Ok(Place::Behind(ahead.clamp(1, 8) as u32))
    }

    /// After an attempt found the key busy: a ticket at the back of the queue, unless this
    /// caller has one.
    pub(crate) async fn queue_up(&mut self) -> Result<(), LockError> {
        if self.ticket.is_none() {
            self.join().await?;
        }
        Ok(())
    }

    async fn join(&mut self) -> Result<(), LockError> {
        let sent = Instant::now();
        let ticket = self
            .step(QueueStep::Join {
                key: &self.key,
                owner: &self.owner,
                lease_us: lease_us(),
            })
            .await?;
        tracing::trace!(ticket, "fair: queued");
        self.ticket = Some(ticket);
        self.touched = sent;
        Ok(())
    }

    /// Leaves the queue now (the key was taken, or the call ends).
    pub(crate) async fn leave(mut self) {
        if let Some(ticket) = self.ticket.take() {
            leave(&self.shared, &self.key, &self.owner, ticket).await;
        }
    }

    async fn step(&self, step: QueueStep<'_>) -> Result<i64, LockError> {
        let backend = self.shared.backend()?;
        self.shared
            .run_bounded(
                &format!("fair queue of `{}`", crate::Escaped(&self.key)),
                |limit| backend.run(&step, limit),
            )
            .await
    }
}

impl Drop for Fair {
    /// A caller that goes away (its future dropped) leaves the queue from a task of its own;
    /// without a runtime, its ticket runs out by itself.
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                let (shared, key, owner) =
                    (self.shared.clone(), self.key.clone(), self.owner.clone());
                handle.spawn(async move { leave(&shared, &key, &owner, ticket).await });
            }
        }
    }
}

async fn leave(shared: &Shared, key: &str, owner: &str, ticket: i64) {
    let Ok(backend) = shared.backend() else {
        return;
    };
    let step = QueueStep::Leave { key, owner, ticket };
    if let Err(e) = shared
        .run_bounded("leaving the fair queue", |limit| backend.run(&step, limit))
        .await
    {
        tracing::debug!(error = %e, ticket, "could not leave the fair queue; the ticket runs out by itself");
    }
}

fn lease_us() -> i64 {
    WAITER_LEASE.as_micros() as i64
}
