//! Coalescing: concurrent statements of one kind on distinct keys share a round trip.
//!
//! The dispatcher sits between the callers of one statement (an attempt's retry policy, a
//! release, an extension) and the backend that runs it. Nothing above it knows whether its row
//! travelled alone; nothing below it knows who asked.
//!
//! - **A lone caller goes at once, alone**: while fewer statements of its kind are in flight
//!   than the lane has slots for lone calls ([`Backend::coalesce_slots`], [`Slots`]) and
//!   nobody is queued, a call takes a slot and sends its usual one-row statement inline, in
//!   its own task. No timer, no hand-off, no copy of its values.
//! - **Under load, calls woken together go together**: once the lane's batches are large (8 rows
//!   on average), a call that finds a slot free does not go alone: it queues, and its slot's
//!   statement leaves from a task of its own a few turns of the scheduler later
//!   ([`GATHER_YIELDS`], no timer), carrying the calls that were woken with it.
//! - **Group commit, no timer**: a call that finds every slot taken queues its row (an owned
//!   copy) and waits. When a statement ends, what queued meanwhile goes out together as the
//!   next one (at most [`MAX_ROWS`](policy::MAX_ROWS) rows, one row per key), sent by a task of
//!   its own so that no caller's cancellation can strand the others' rows.
//! - **Stragglers wait for the next calls**: while batches are large, a few rows left queued
//!   when a statement ends (the calls that just missed it) go with the calls that arrive next,
//!   or when the locker's other statement in flight ends, rather than in a statement of their
//!   own that those calls would queue behind ([`Inner::send_queued`]).
//! - **Per-row answers**: each row gets its own result. A batch that fails fails each of its
//!   rows with the same class of failure ([`copy`]): every caller's own retry policy then
//!   resends its own row with its own attempt or release id, so an unknown outcome is settled
//!   row by row and nothing is counted twice.
//! - **Per-row deadlines**: a caller waits for its row at most its own send limit. A row still
//!   queued by then is taken out and reported as not sent (nothing was); a row in flight gets
//!   [`IN_FLIGHT_GRACE`] more for its statement's own answer (within the wait loop's own grace
//!   for an attempt's answer), then is reported as an unknown outcome, which the caller's policy
//!   resolves like any other (its attempt id recognises a grant the batch made, and a grant
//!   nobody waits for is given back by the attempt's detached task, as for a single statement).
//! - Rows go into a statement sorted by key (the canonical order in which every batch of every
//!   process takes its row locks, so two batches cannot deadlock), and never two rows of one
//!   key: a second row of a key waits for the next statement.
//!
//! The parts: [`lane`] (the scheduler of one kind's statements), [`policy`] (how many go at
//! once, and the tuning rules), [`rows`] (the kinds of row and their statements),
//! [`failure`] (a batch's failure, for each of its rows).

mod failure;
mod lane;
mod policy;
mod queue;
mod rows;
#[cfg(test)]
mod tests;

use std::future::Future;

use tokio::time::Instant;

use super::{
    Acquire, Attempt, Backend, Extend, Extended, Extension, HoldRef, Release, Released, RenewItem,
};
use crate::retry::{Failed, Failure};

pub(crate) use lane::{Entered, Lane};
#[cfg(feature = "sqlite")]
pub(crate) use policy::MAX_ROWS;
pub(crate) use policy::{Budget, Slots};
pub(crate) use rows::{
    AcquireBatch, AcquireRow, ExtendRow, ReleaseBatch, ReleaseRow, WriteOut, WriteRow,
};

/// One row of a kind of statement that can travel with others.
pub(crate) trait Row: Send + Sync + Sized + 'static {
    /// What the row's caller gets back.
    type Out: Send + 'static;

    /// What sends the statement: the locker's backend.
    type To: Classify + Clone + Send + Sync + std::fmt::Debug + 'static;

    /// The key the row writes: no two rows of one key share a statement.
    fn key(&self) -> &str;

    /// Whether the row goes ahead of the others: when the oldest queued row is such a row, the
    /// next statement carries only rows like it ([`take_batch`]), because it is cheaper
    /// without the others. SQLite's lazily durable releases ([`WriteRow::leads`]).
    fn leads(&self, _to: &Self::To) -> bool {
        false
    }

    /// Sends `rows` (sorted by key, distinct keys, at least one) as one statement; one answer
    /// per row, in their order.
    fn send(
        to: &Self::To,
        rows: &[Self],
        deadline: Instant,
    ) -> impl Future<Output = Result<Vec<Self::Out>, Failed>> + Send;
}

/// How a failed statement is classed: the backend's mapping.
pub(crate) trait Classify {
    fn classify(&self, failed: &Failed) -> Failure;
}

impl Classify for Backend {
    fn classify(&self, failed: &Failed) -> Failure {
        Backend::classify(self, failed)
    }
}

/// The statements of one locker (on one table) that may be coalesced: one lane per kind.
#[derive(Debug)]
pub(crate) struct Coalescer {
    pub(crate) acquire: Lane<AcquireRow>,
    pub(crate) release: Lane<ReleaseRow>,
    pub(crate) extend: Lane<ExtendRow>,
    /// Where a backend whose statements of every kind share one transaction sends them all
    /// ([`Backend::coalesce_kinds_together`]: SQLite); the kinds' own lanes are then unused,
    /// and have no backend.
    pub(crate) write: Option<Lane<WriteRow>>,
}

impl Coalescer {
    /// Lanes over `backend`; `on = false` (`ConnectOptions::coalesce(false)`): every call goes
    /// alone, as if nothing else were in flight.
    pub(crate) fn new(backend: Option<Backend>, on: bool) -> Self {
        let backend = backend.filter(|_| on);
        let slots = backend
            .as_ref()
            .map_or(Slots { most: 1, least: 1 }, Backend::coalesce_slots);
        let (most, large_most) = backend.as_ref().map_or((1, 1), Backend::coalesce_budget);
        let budget = Budget::moving(most, large_most);
        let together = backend
            .as_ref()
            .is_some_and(Backend::coalesce_kinds_together);
        // With one lane for every kind, the kinds' own lanes are never entered: they are
        // built without a backend.
        let (write, own) = if together {
            (Some(Lane::build(backend, slots, &budget, true)), None)
        } else {
            (None, backend)
        };
        Coalescer {
            write,
            acquire: Lane::with_budget(own.clone(), slots, &budget),
            release: Lane::with_budget(own.clone(), slots, &budget),
            extend: Lane::with_budget(own, slots, &budget),
        }
    }

    /// Statements of more than one row sent so far, and the rows in them, over every lane.
    #[cfg_attr(not(feature = "_test-util"), allow(dead_code))]
    pub(crate) fn coalesced(&self) -> (u64, u64) {
        let lanes = [
            self.acquire.coalesced(),
            self.release.coalesced(),
            self.extend.coalesced(),
            self.write.as_ref().map_or((0, 0), Lane::coalesced),
        ];
        lanes
            .iter()
            .fold((0, 0), |(s, r), (s2, r2)| (s + s2, r + r2))
    }

    /// One acquire statement for `a`, alone or with others.
    pub(crate) async fn acquire(
        &self,
        backend: &Backend,
        a: &Acquire<'_>,
        deadline: Instant,
    ) -> Result<Attempt, Failed> {
        // A waiter's attempt that asks for a NOTIFY (PostgreSQL) carries a statement of its own.
        if a.waiting {
            return Box::pin(backend.run(a, deadline)).await;
        }
        let alone = || backend.run(a, deadline);
        match &self.write {
            Some(write) => {
                let row = || WriteRow::Acquire(AcquireRow::from(a));
                through(write, row, deadline, alone, WriteOut::attempt).await
            }
            None => through(&self.acquire, || AcquireRow::from(a), deadline, alone, Ok).await,
        }
    }

    /// One release statement, alone or with others.
    pub(crate) async fn release(
        &self,
        backend: &Backend,
        r: &Release<'_>,
        deadline: Instant,
    ) -> Result<Released, Failed> {
        let row = || ReleaseRow::new(&r.hold, r.remaining, r.outcome, r.release_id);
        let alone = || backend.run(r, deadline);
        match &self.write {
            Some(write) => {
                let row = || WriteRow::Release(row());
                through(write, row, deadline, alone, WriteOut::released).await
            }
            None => through(&self.release, row, deadline, alone, Ok).await,
        }
    }

    /// One extension, alone or with others.
    pub(crate) async fn extend(
        &self,
        backend: &Backend,
        e: &Extend<'_>,
        deadline: Instant,
    ) -> Result<Extension, Failed> {
        let row = || ExtendRow::new(e);
        let alone = async || Ok(Extension::of(backend.run(e, deadline).await?));
        match &self.write {
            Some(write) => {
                let row = || WriteRow::Extend(row());
                through(write, row, deadline, alone, WriteOut::extended).await
            }
            None => through(&self.extend, row, deadline, alone, Ok).await,
        }
    }
}

/// One call through `lane`: alone (the caller's own one-row statement, `alone()`, made and
/// sent only if it gets a slot, so that the call's future holds it only in that arm) or
/// queued (`row()` travels with others, and `answer` takes the caller's answer out of the
/// lane's).
async fn through<R: Row, T, F: Future<Output = Result<T, Failed>>>(
    lane: &Lane<R>,
    row: impl FnOnce() -> R,
    deadline: Instant,
    alone: impl FnOnce() -> F,
    answer: impl FnOnce(R::Out) -> Result<T, Failed>,
) -> Result<T, Failed> {
    match lane.enter(row, deadline) {
        // Boxed: the one-row statement's future is large, and a caller's future (boxed itself,
        // in `Detached`) would otherwise be that large on the queued path too.
        Entered::Alone(slot) => slot.noted(Box::pin(alone()).await),
        Entered::Queued(turn) => answer(turn.wait().await?),
    }
}
