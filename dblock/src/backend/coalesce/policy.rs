//! How many statements of one kind go at once, and for all kinds together; the tuning rules
//! of the coalescer, each with why it is what it is. (Measurements: `docs/coalescing.md` and
//! `docs/benchmarks.md`.)

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::sync::lock;

/// Rows in one statement, at most. A bound on what one failure takes down with it and on the
/// statement's size (its parameters, a pooler's literal text); past 64 rows the per-row cost
/// of the server dominates and larger batches only raise latency (`docs/coalescing.md`).
pub(crate) const MAX_ROWS: usize = 64;

/// How many statements of one kind a lane keeps in flight before calls queue
/// ([`Backend::coalesce_slots`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slots {
    /// At most; and the most a lone call may take while batches stay small.
    pub(crate) most: usize,
    /// The most a lone call may take once batches are large: lone calls take up to this
    /// once the batches' mean size reaches [`BIG`] rows, and up to `most` again once it falls
    /// below [`SMALL`]. Equal to `most`: no such change.
    pub(crate) least: usize,
}

/// Batches this large on average mean the server is kept busy by statements: fewer, larger
/// ones serve more rows ([`Slots::least`]).
pub(super) const BIG: usize = 8;

/// Batches this small on average mean there is room for lone calls again.
pub(super) const SMALL: usize = 4;

/// The statements every lane of one locker keeps in flight together, at most: one per pooled
/// connection ([`Backend::coalesce_budget`]). A statement that gets a slot then gets a
/// connection at once, instead of queueing a second time in the pool behind the other lanes'
/// statements (measured at 64 owners on PostgreSQL, pool of 10, 10 slots per lane: p99 54–98
/// ms, 1.1–1.7× `coalesce(false)`; the same slots with a pool of 20: p99 22 ms, 2.0×).
///
/// When a statement ends with the budget spent, the other lanes' queues get the freed slot
/// first, then its own: a lane whose queue never empties cannot keep every slot to itself.
pub(crate) struct Budget {
    most: usize,
    /// The bound while the lanes' batches are large ([`BIG`] rows on average, until they fall
    /// below [`SMALL`]): by then the server's CPU goes to rows, and fewer statements at once
    /// serve more of them ([`Backend::coalesce_budget`]).
    large_most: usize,
    /// Lanes whose batches are large now: the large-batch bound holds while any is.
    large_lanes: AtomicUsize,
    pub(super) in_flight: AtomicUsize,
    pub(super) lanes: Mutex<Vec<Weak<dyn Kick>>>,
}

/// A lane that sends what it has queued when a slot of the budget is given back.
pub(super) trait Kick: Send + Sync {
    fn kick(self: Arc<Self>);
    /// Sends a queue of stragglers held back ([`Inner::send_queued`]), gathered: another
    /// lane's statement ended.
    fn kick_held(self: Arc<Self>);
}

impl std::fmt::Debug for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Budget")
            .field("most", &self.most)
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

impl Budget {
    /// A budget of `most` statements in flight (`usize::MAX`: none beyond the lanes' own).
    #[cfg(test)]
    pub(crate) fn new(most: usize) -> Arc<Budget> {
        Budget::moving(most, most)
    }

    /// A budget of `most` statements in flight while batches are small, `large_most` once
    /// they are large.
    pub(crate) fn moving(most: usize, large_most: usize) -> Arc<Budget> {
        Arc::new(Budget {
            most: most.max(1),
            large_most: large_most.clamp(1, most.max(1)),
            large_lanes: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            lanes: Mutex::new(Vec::new()),
        })
    }

    /// Takes a slot if one is free.
    pub(super) fn take(&self) -> bool {
        let most = self.most();
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < most).then_some(n + 1)
            })
            .is_ok()
    }

    /// The bound now, as the batches' size says.
    pub(super) fn most(&self) -> usize {
        if self.large_lanes.load(Ordering::Relaxed) > 0 {
            self.large_most
        } else {
            self.most
        }
    }

    /// A lane's batches became large (`true`) or small again.
    pub(super) fn lane_large(&self, large: bool) {
        if large {
            self.large_lanes.fetch_add(1, Ordering::Relaxed);
        } else {
            self.large_lanes.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Takes a slot whether or not one is free (a queue sent beside statements that hang).
    pub(super) fn force(&self) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
    }

    /// Gives back a slot taken for a statement that was not sent after all (the lane's state
    /// still locked: nothing to kick, no slot of the budget having been used).
    pub(super) fn put_back(&self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    /// Gives back a slot of lane `from` and lets the lanes send what they have queued: if the
    /// budget was spent (other lanes' queues may wait for it), every lane but `from` first,
    /// then `from`; otherwise `from` alone (the others' queues wait for their own statements,
    /// as without a budget). Called with no lane's state locked.
    pub(super) fn give(&self, from: &Arc<dyn Kick>) {
        let spent = self.in_flight.fetch_sub(1, Ordering::AcqRel) >= self.most();
        let lanes: Vec<Arc<dyn Kick>> = lock(&self.lanes)
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|l| !Arc::ptr_eq(l, from))
            .collect();
        if spent {
            for lane in &lanes {
                lane.clone().kick();
            }
        }
        from.clone().kick();
        for lane in lanes {
            lane.kick_held();
        }
    }
}

/// Turns of the scheduler a regrouping lane's batch task gives its answered callers before the
/// next statement leaves ([`Inner::regroup`]). Measured on SQLite at 8 owners (mean rows a
/// statement, ratio to `coalesce(false)`): 1: 7.3–7.4 rows, 2.63–2.74×; 2: 8.0, 3.06–3.11×; 3:
/// 8.0, 3.57–4.12×; 4: 8.0, 3.05–3.86×; at 64 owners 3 gave 5.96–6.56×, 4 5.43–5.74×. A
/// yield only reorders ready tasks: no timer, and nothing waits when nobody is ready.
pub(super) const REGROUP_YIELDS: usize = 3;

/// Turns of the scheduler a lane whose batches are large (and that nothing else keeps busy)
/// gives the calls woken beside the one that found it idle, before their statement leaves
/// ([`Inner::gather`]). Under load callers are woken together, by the answers of one batch:
/// the first of them used to go alone, and the others queued behind its statement, one more
/// round trip before theirs. A yield only reorders ready tasks: no timer, and a call that finds
/// nothing else ready waits for nothing. Measured 2026-11-26, rounds alternating in one
/// process (`DBLOCK_PROFILE_OWNERS`, 11 rounds a side), median cycles/s against going alone:
/// PostgreSQL 64 owners +1 to +6 % (3 runs; rows that went alone in the benchmark: 4,700–5,200
/// before, 2,100–2,600 after), MariaDB 64 owners +4 %, SQLite 8 owners +11 %. 3 yields gave no
/// more than 2 (one run).
pub(super) const GATHER_YIELDS: usize = 2;

/// How long the statements in flight may all hang before the queue is sent beside them (far
/// above a batch's time on a working connection: a few milliseconds).
pub(crate) const STUCK: std::time::Duration = std::time::Duration::from_millis(100);

/// How long past its deadline a row in flight waits for the answer of the statement carrying
/// it, which ends by the latest of its rows' deadlines: a statement that fails at that deadline
/// (a pool that retried a refused connection until then) answers a few milliseconds after
/// it, and its failure names the cause. Well under the wait loop's own grace for an attempt's
/// answer (`wait::ANSWER_GRACE`, 50 ms), which then still hears it.
pub(super) const IN_FLIGHT_GRACE: std::time::Duration = std::time::Duration::from_millis(25);

/// How old a statement's failure may be, when a row queued, to be named as the reason it got
/// no turn.
pub(super) const RECENT: std::time::Duration = std::time::Duration::from_secs(1);
