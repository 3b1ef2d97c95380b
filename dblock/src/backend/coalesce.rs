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
//!   next one (at most [`MAX_ROWS`] rows, one row per key), sent by a task of its own so that
//!   no caller's cancellation can strand the others' rows.
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

use std::collections::VecDeque;
use std::future::Future;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::{Acquire, Attempt, Backend, Extended, HoldRef, Released, RenewItem};
use crate::info::Outcome;
use crate::retry::{Failed, Failure};
use crate::sync::lock;

/// Rows in one statement, at most. A bound on what one failure takes down with it and on the
/// statement's size (its parameters, a pooler's literal text); past 64 rows the per-row cost
/// of the server dominates and larger batches only raise latency (see the README).
pub(crate) const MAX_ROWS: usize = 64;

/// How many entries the statement of a batch of `n` rows lists, where a backend's statement
/// text grows with its rows (SQLite's `VALUES`, MySQL's derived tables): the next power of two,
/// at least 2, the rest padding that matches nothing. A connection then prepares seven texts
/// per statement rather than one per batch size, which would overflow sqlx's cache of 100
/// prepared statements per connection and prepare again and again (measured on MariaDB at 64
/// owners: p99 109 ms instead of 28 ms).
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) fn listed(n: usize) -> usize {
    n.max(2).next_power_of_two()
}

/// `q` with the padding of a list that holds `n` rows of `width` values: NULLs up to
/// [`listed`]`(n)` rows (a NULL key matches nothing; the real rows come first, so the list's
/// column types are theirs).
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) fn pad<DB: sqlx::Database>(
    mut q: sqlx::query::Query<'_, DB, DB::Arguments>,
    n: usize,
    width: usize,
) -> sqlx::query::Query<'_, DB, DB::Arguments>
where
    for<'t> Option<i64>: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    for _ in 0..(listed(n) - n) * width {
        q = q.bind(None::<i64>);
    }
    q
}

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
const BIG: usize = 8;

/// Batches this small on average mean there is room for lone calls again.
const SMALL: usize = 4;

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
    in_flight: AtomicUsize,
    lanes: Mutex<Vec<Weak<dyn Kick>>>,
}

/// A lane that sends what it has queued when a slot of the budget is given back.
trait Kick: Send + Sync {
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
    fn take(&self) -> bool {
        let most = self.most();
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < most).then_some(n + 1)
            })
            .is_ok()
    }

    /// The bound now, as the batches' size says.
    fn most(&self) -> usize {
        if self.large_lanes.load(Ordering::Relaxed) > 0 {
            self.large_most
        } else {
            self.most
        }
    }

    /// A lane's batches became large (`true`) or small again.
    fn lane_large(&self, large: bool) {
        if large {
            self.large_lanes.fetch_add(1, Ordering::Relaxed);
        } else {
            self.large_lanes.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Takes a slot whether or not one is free (a queue sent beside statements that hang).
    fn force(&self) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
    }

    /// Gives back a slot taken for a statement that was not sent after all (the lane's state
    /// still locked: nothing to kick, no slot of the budget having been used).
    fn put_back(&self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    /// Gives back a slot of lane `from` and lets the lanes send what they have queued: if the
    /// budget was spent (other lanes' queues may wait for it), every lane but `from` first,
    /// then `from`; otherwise `from` alone (the others' queues wait for their own statements,
    /// as without a budget). Called with no lane's state locked.
    fn give(&self, from: &Arc<dyn Kick>) {
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
const REGROUP_YIELDS: usize = 3;

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
const GATHER_YIELDS: usize = 2;

/// How long the statements in flight may all hang before the queue is sent beside them (far
/// above a batch's time on a working connection: a few milliseconds).
pub(crate) const STUCK: std::time::Duration = std::time::Duration::from_millis(100);

/// How long past its deadline a row in flight waits for the answer of the statement carrying
/// it, which ends by the latest of its rows' deadlines: a statement that fails at that deadline
/// (a pool that retried a refused connection until then) answers a few milliseconds after
/// it, and its failure names the cause. Well under the wait loop's own grace for an attempt's
/// answer (`wait::ANSWER_GRACE`, 50 ms), which then still hears it.
const IN_FLIGHT_GRACE: std::time::Duration = std::time::Duration::from_millis(25);

/// How old a statement's failure may be, when a row queued, to be named as the reason it got
/// no turn.
const RECENT: std::time::Duration = std::time::Duration::from_secs(1);

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
            return Box::pin(backend.acquire(a, deadline)).await;
        }
        let alone = || backend.acquire(a, deadline);
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
        h: &HoldRef<'_>,
        remaining: u32,
        outcome: Option<Outcome>,
        release_id: i64,
        deadline: Instant,
    ) -> Result<Released, Failed> {
        let row = || ReleaseRow::new(h, remaining, outcome, release_id);
        let alone = || backend.release(h, remaining, outcome, release_id, deadline);
        match &self.write {
            Some(write) => {
                let row = || WriteRow::Release(row());
                through(write, row, deadline, alone, WriteOut::released).await
            }
            None => through(&self.release, row, deadline, alone, Ok).await,
        }
    }

    /// One extension, alone or with others: the new lease end where the statement reads it,
    /// `Ok(None)` when the hold is no longer this tenure's.
    pub(crate) async fn extend(
        &self,
        backend: &Backend,
        h: &HoldRef<'_>,
        ttl_us: i64,
        deadline: Instant,
    ) -> Result<Option<Option<i64>>, Failed> {
        let row = || ExtendRow::new(h, ttl_us);
        let alone = async || Ok(backend.extend(h, ttl_us, deadline).await?.map(Some));
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

/// The lane of one kind of statement: how many are in flight, and the rows waiting for the
/// next one.
#[derive(Debug)]
pub(crate) struct Lane<R: Row> {
    inner: Arc<Inner<R>>,
}

#[derive(Debug)]
struct Inner<R: Row> {
    /// `None`: coalescing is off, every call goes alone.
    to: Option<R::To>,
    /// Statements of the lane in flight at once before calls queue.
    slots: Slots,
    /// Statements of every lane of the locker in flight at once, at most.
    budget: Arc<Budget>,
    /// Whether a batch's end lets its answered callers queue again before the next statement
    /// leaves ([`REGROUP_YIELDS`] `yield_now`s, no timer). For a lane of one slot whose callers
    /// go on at once (SQLite's lane of every kind, where a grant is followed by its release):
    /// the next statement would otherwise be made up the instant the last one ended, of the
    /// callers it did not carry, and each caller would ride every other statement. Measured at
    /// 8 owners: 8.0 rows a statement instead of 4.7–4.9, 3.57–4.12× `coalesce(false)` instead
    /// of 2.10–2.36×. On PostgreSQL, with ten slots, one yield cost (0.43–0.94× against
    /// 1.25–1.96×): not there.
    regroup: bool,
    state: Mutex<State<R>>,
    /// The latest failure of a statement of the lane: what a row that never got its turn
    /// reports as the cause.
    last_failure: Mutex<Option<(Instant, std::io::ErrorKind, String)>>,
    /// Statements of more than one row sent, and the rows in them.
    coalesced: [AtomicU64; 2],
}

struct State<R: Row> {
    in_flight: usize,
    /// Statements in flight below which a lone call goes at once (between `slots.least` and
    /// `slots.most`, as the batches' sizes say).
    alone: usize,
    /// The mean size of the lane's batches, in sixteenths of a row, each new batch weighing
    /// 1/8.
    mean_x16: usize,
    /// Whether the lane's batches count as large (from a mean of `BIG` rows until it falls
    /// below `SMALL`), as the budget counts it.
    large: bool,
    queue: VecDeque<Queued<R>>,
    next_id: u64,
    /// When a statement of the lane last started or ended.
    progress: Instant,
    /// Whether the queue is a few stragglers held back for the calls that come next
    /// ([`Inner::send_queued`]).
    held: bool,
}

impl<R: Row> std::fmt::Debug for State<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("in_flight", &self.in_flight)
            .field("queued", &self.queue.len())
            .finish()
    }
}

struct Queued<R: Row> {
    id: u64,
    row: R,
    deadline: Instant,
    answer: oneshot::Sender<Result<R::Out, Failed>>,
}

/// How a call entered its lane.
pub(crate) enum Entered<'a, R: Row> {
    /// Sends its own statement now; the slot is given back (and the queue sent) when dropped.
    Alone(Slot<'a, R>),
    /// Queued for the next statement.
    Queued(Turn<'a, R>),
}

/// A slot of a lane taken by a lone caller.
pub(crate) struct Slot<'a, R: Row> {
    lane: Option<&'a Arc<Inner<R>>>,
}

impl<R: Row> Slot<'_, R> {
    /// `result`, its failure noted for the rows queued behind it.
    fn noted<T>(self, result: Result<T, Failed>) -> Result<T, Failed> {
        if let (Err(failed), Some(lane)) = (&result, self.lane) {
            lane.note(failed);
        }
        result
    }
}

impl<R: Row> Drop for Slot<'_, R> {
    fn drop(&mut self) {
        if let Some(lane) = self.lane {
            lane.ended();
        }
    }
}

/// A queued row's wait for its answer.
pub(crate) struct Turn<'a, R: Row> {
    lane: &'a Arc<Inner<R>>,
    id: u64,
    queued_at: Instant,
    deadline: Instant,
    answer: oneshot::Receiver<Result<R::Out, Failed>>,
}

impl<R: Row> Turn<'_, R> {
    /// The row's answer, or by its deadline: "not sent" if it is still queued (it is taken
    /// out), "outcome unknown" if it is in flight.
    pub(crate) async fn wait(mut self) -> Result<R::Out, Failed> {
        // While queued: every `STUCK`, a lane whose statements have all hung that long (a
        // connection cut without a word, a demoted server) sends the queue anyway, on another
        // connection, rather than hold every caller behind them.
        loop {
            let look = (Instant::now() + STUCK).min(self.deadline);
            match tokio::time::timeout_at(look, &mut self.answer).await {
                Err(_) if look < self.deadline => self.lane.unstick(),
                Err(_) if !self.queued() => {
                    // In flight at its deadline: the statement carrying it ends by the latest
                    // of its rows' deadlines, which may be this one, and its own answer (a
                    // refused connection, say) names the cause where "no reply" would not.
                    let late = tokio::time::timeout(IN_FLIGHT_GRACE, &mut self.answer).await;
                    return self.answered(late);
                }
                answered => return self.answered(answered),
            }
        }
    }

    /// Whether the row is still queued (not sent).
    fn queued(&self) -> bool {
        lock(&self.lane.state).queue.iter().any(|q| q.id == self.id)
    }

    fn answered(
        mut self,
        answered: Result<
            Result<Result<R::Out, Failed>, oneshot::error::RecvError>,
            tokio::time::error::Elapsed,
        >,
    ) -> Result<R::Out, Failed> {
        match answered {
            Ok(Ok(answer)) => answer,
            // The batch's task was dropped with the runtime: the row may have been sent.
            Ok(Err(_)) => Err(Failed {
                error: sqlx::Error::Io(std::io::Error::other(
                    "the statement carrying this row was abandoned (runtime shut down)",
                )),
                sent: true,
            }),
            Err(_) => {
                let mut state = lock(&self.lane.state);
                let before = state.queue.len();
                state.queue.retain(|q| q.id != self.id);
                let queued = state.queue.len() < before;
                drop(state);
                if !queued {
                    // Sent with others: answered meanwhile, or truly unknown.
                    if let Ok(answer) = self.answer.try_recv() {
                        return answer;
                    }
                }
                let error = if queued {
                    // Never sent: the statements ahead of it took the time. Their latest
                    // failure, if any, is the cause (a refused server, say).
                    // (A failure up to a second before it queued counts: a caller's last
                    // resend, with little time left, queues behind the others' resends.)
                    let last = lock(&self.lane.last_failure).clone();
                    let recent = |at: &Instant| *at + RECENT >= self.queued_at;
                    match last.filter(|(at, ..)| recent(at)) {
                        Some((_, kind, cause)) => std::io::Error::new(
                            kind,
                            format!(
                                "no turn for the statement within its time limit: the \
                                 statements ahead of it failed: {cause}"
                            ),
                        ),
                        None => std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "no turn for the statement within its time limit",
                        ),
                    }
                } else {
                    std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "no reply from the database within the statement's time limit",
                    )
                };
                Err(Failed {
                    error: sqlx::Error::Io(error),
                    sent: !queued,
                })
            }
        }
    }
}

impl<R: Row> Lane<R> {
    /// A lane of `slots` statements in flight, however large its batches.
    #[cfg(test)]
    pub(crate) fn new(to: Option<R::To>, slots: usize) -> Self {
        Lane::with_slots(
            to,
            Slots {
                most: slots,
                least: slots,
            },
        )
    }

    /// A lane of `slots`, with no budget beyond its own.
    #[cfg(test)]
    pub(crate) fn with_slots(to: Option<R::To>, slots: Slots) -> Self {
        Lane::with_budget(to, slots, &Budget::new(usize::MAX))
    }

    /// A lane of `slots` that shares `budget` with the locker's other lanes.
    pub(crate) fn with_budget(to: Option<R::To>, slots: Slots, budget: &Arc<Budget>) -> Self {
        Lane::build(to, slots, budget, false)
    }

    /// A lane as [`with_budget`](Self::with_budget); `regroup`: a statement's end yields to the
    /// scheduler before the next statement leaves ([`Inner::regroup`]).
    fn build(to: Option<R::To>, slots: Slots, budget: &Arc<Budget>, regroup: bool) -> Self {
        let most = slots.most.max(1);
        let slots = Slots {
            most,
            least: slots.least.clamp(1, most),
        };
        let lane = Lane {
            inner: Arc::new(Inner {
                to,
                slots,
                regroup,
                budget: budget.clone(),
                coalesced: [AtomicU64::new(0), AtomicU64::new(0)],
                last_failure: Mutex::new(None),
                state: Mutex::new(State {
                    alone: most,
                    mean_x16: 0,
                    large: false,
                    in_flight: 0,
                    queue: VecDeque::new(),
                    next_id: 0,
                    progress: Instant::now(),
                    held: false,
                }),
            }),
        };
        let kick: Arc<dyn Kick> = lane.inner.clone();
        lock(&budget.lanes).push(Arc::downgrade(&kick));
        lane
    }

    /// Takes a slot if one is free and nobody waits; queues `row()` otherwise.
    pub(crate) fn enter(&self, row: impl FnOnce() -> R, deadline: Instant) -> Entered<'_, R> {
        if self.inner.to.is_none() {
            return Entered::Alone(Slot { lane: None });
        }
        let mut state = lock(&self.inner.state);
        // A slot for a call that finds the lane idle enough: its own statement at once, alone;
        // or, while the lane's batches are large, a statement made up a few turns of the
        // scheduler later with the calls woken beside it ([`GATHER_YIELDS`]).
        let slot =
            state.in_flight < state.alone && state.queue.is_empty() && self.inner.budget.take();
        if slot && !state.large {
            state.in_flight += 1;
            state.progress = Instant::now();
            return Entered::Alone(Slot {
                lane: Some(&self.inner),
            });
        }
        let (tx, rx) = oneshot::channel();
        state.next_id += 1;
        let id = state.next_id;
        state.queue.push_back(Queued {
            id,
            row: row(),
            deadline,
            answer: tx,
        });
        if slot {
            self.inner.gather(&mut state);
        } else if state.large && state.in_flight < state.alone {
            // Calls arriving at a lane whose stragglers wait for them ([`Inner::send_queued`]):
            // they all go in one statement, gathered.
            if self.inner.budget.take() {
                state.held = false;
                self.inner.gather(&mut state);
            } else {
                state.held = true;
            }
        } else {
            // Every slot may have been given back between the caller's look and now: the
            // queue must not wait for a statement that is not coming.
            let alone = state.alone;
            self.inner.send_batches(&mut state, alone, false);
        }
        Entered::Queued(Turn {
            lane: &self.inner,
            id,
            queued_at: Instant::now(),
            deadline,
            answer: rx,
        })
    }

    /// Statements of more than one row this lane sent, and the rows in them.
    #[cfg_attr(not(feature = "_test-util"), allow(dead_code))]
    pub(crate) fn coalesced(&self) -> (u64, u64) {
        let [statements, rows] = &self.inner.coalesced;
        (
            statements.load(Ordering::Relaxed),
            rows.load(Ordering::Relaxed),
        )
    }

    /// Rows queued now (for tests).
    #[cfg(test)]
    fn queued(&self) -> usize {
        lock(&self.inner.state).queue.len()
    }
}

impl<R: Row> Kick for Inner<R> {
    fn kick(self: Arc<Self>) {
        let mut state = lock(&self.state);
        self.send_queued(&mut state);
    }

    fn kick_held(self: Arc<Self>) {
        let mut state = lock(&self.state);
        // (The budget is taken last: only when there is a statement to start.)
        if state.held
            && state.in_flight < state.alone
            && !state.queue.is_empty()
            && self.budget.take()
        {
            state.held = false;
            self.gather(&mut state);
        }
    }
}

impl<R: Row> Inner<R> {
    fn note(&self, failed: &Failed) {
        let kind = match &failed.error {
            sqlx::Error::Io(io) => io.kind(),
            _ => std::io::ErrorKind::Other,
        };
        *lock(&self.last_failure) = Some((Instant::now(), kind, failed.error.to_string()));
    }

    /// Sends the queue beside statements that have hung for `STUCK` (no statement of the lane
    /// started or ended since): one more statement in flight, once per `STUCK`.
    fn unstick(self: &Arc<Self>) {
        let mut state = lock(&self.state);
        if state.queue.is_empty() || state.progress.elapsed() < STUCK {
            return;
        }
        tracing::debug!(
            in_flight = state.in_flight,
            queued = state.queue.len(),
            "coalesced statements hang; the queue goes beside them"
        );
        let limit = state.in_flight + 1;
        self.send_batches(&mut state, limit, true);
    }

    /// A statement of the lane ended: its slot goes back to the budget, which lets the lanes
    /// send what they have queued.
    fn ended(self: &Arc<Self>) {
        {
            let mut state = lock(&self.state);
            state.in_flight -= 1;
            state.progress = Instant::now();
        }
        let lane: Arc<dyn Kick> = self.clone();
        self.budget.give(&lane);
    }

    /// While a slot is free and rows wait: the next batch, in a task of its own.
    ///
    /// Except for a few stragglers while the lane's batches are large and another statement of
    /// the locker is in flight: fewer than [`SMALL`] rows left queued when a statement ends are
    /// the calls that just missed it, and sent at once they made a statement of one or two rows
    /// that the next calls (woken together by the other lane's answer) then queued behind, a
    /// round trip later. Held, they go with those calls (the first to arrive gathers them,
    /// [`Lane::enter`]) or, if none come, when that other statement ends
    /// ([`Kick::kick_held`]); a lane with nothing else in flight sends them at once, so
    /// nothing waits for a statement that is not coming. Measured 2026-11-26 at 64 owners
    /// (pairs of benchmark runs): rows sent alone 2,039–2,228 → 1,063–1,319 on PostgreSQL,
    /// 1,111–1,221 → 529–631 on MariaDB; throughput within the runs' noise (PostgreSQL
    /// coalesced dblock 0.62 → 0.63 of the raw coalesced statements).
    fn send_queued(self: &Arc<Self>, state: &mut State<R>) {
        if state.large
            && state.queue.len() < SMALL
            && self.budget.in_flight.load(Ordering::Acquire) > 0
        {
            state.held = true;
            return;
        }
        state.held = false;
        self.send_batches(state, self.slots.most, false);
    }

    /// Batches of the queue, each in a task of its own, while fewer than `limit` statements are
    /// in flight and the budget has a slot (`force`: whether or not it has).
    fn send_batches(self: &Arc<Self>, state: &mut State<R>, limit: usize, force: bool) {
        let Some(to) = &self.to else {
            return;
        };
        while state.in_flight < limit && !state.queue.is_empty() {
            if force {
                self.budget.force();
            } else if !self.budget.take() {
                return;
            }
            let batch = take_batch(state, to);
            if batch.is_empty() {
                self.budget.put_back();
                return;
            }
            if !self.start(state, Some(batch)) {
                return;
            }
        }
    }

    /// Starts one statement of the lane, in a task of its own, on a slot already taken from
    /// the budget: `batch`, or (`None`, [`gather`](Self::gather)) the queue as it stands
    /// [`GATHER_YIELDS`] turns of the scheduler later. `false` outside a runtime (a slot
    /// dropped there), the slot given back: the rows' callers time out and resend.
    fn start(self: &Arc<Self>, state: &mut State<R>, batch: Option<Vec<Queued<R>>>) -> bool {
        let (Some(to), Ok(runtime)) = (&self.to, tokio::runtime::Handle::try_current()) else {
            self.budget.put_back();
            return false;
        };
        state.in_flight += 1;
        state.progress = Instant::now();
        if let Some(batch) = &batch {
            self.sized(state, batch.len());
        }
        let (lane, to) = (self.clone(), to.clone());
        runtime.spawn(async move {
            let batch = match batch {
                Some(batch) => batch,
                None => {
                    for _ in 0..GATHER_YIELDS {
                        tokio::task::yield_now().await;
                    }
                    let mut state = lock(&lane.state);
                    let batch = take_batch(&mut state, &to);
                    lane.sized(&mut state, batch.len());
                    batch
                }
            };
            if !batch.is_empty() {
                send_batch(&lane, &to, batch).await;
            }
            if lane.regroup {
                // The callers just answered are woken; a few turns of the scheduler let those
                // that go on at once (a release after its grant) queue for the next statement,
                // which would otherwise leave without them.
                for _ in 0..REGROUP_YIELDS {
                    tokio::task::yield_now().await;
                }
            }
            lane.ended();
        });
        true
    }

    /// Records a batch of `n` rows leaving: the batches' mean size (in sixteenths, the latest
    /// weighing 1/8) moves lone calls' slots: all of them while batches stay small, the fewest
    /// once they are large.
    fn sized(&self, state: &mut State<R>, n: usize) {
        state.mean_x16 = state.mean_x16 - state.mean_x16 / 8 + 2 * n;
        let large = if state.mean_x16 >= 16 * BIG {
            true
        } else if state.mean_x16 < 16 * SMALL {
            false
        } else {
            state.large
        };
        if large != state.large {
            state.large = large;
            state.alone = if large {
                self.slots.least
            } else {
                self.slots.most
            };
            self.budget.lane_large(large);
        }
        if n > 1 {
            self.coalesced[0].fetch_add(1, Ordering::Relaxed);
            self.coalesced[1].fetch_add(n as u64, Ordering::Relaxed);
        }
    }

    /// The statement of a slot taken (from the budget too) for a row just queued while the
    /// lane's batches are large: sent by a task of its own after [`GATHER_YIELDS`] turns of
    /// the scheduler, with whatever queued meanwhile.
    fn gather(self: &Arc<Self>, state: &mut State<R>) {
        self.start(state, None);
    }
}

/// The next statement's rows out of `state`'s queue: at most [`MAX_ROWS`], one per key, in
/// the order they queued; rows whose callers went away are dropped. When the oldest row leads
/// ([`Row::leads`]), only rows that lead go, and the others wait for the next statement; when
/// it does not, every kind goes. A row that does not lead so waits for one statement at most
/// that it would have travelled in, however many rows that lead queue behind it.
/// Hashes a batch's keys ([`take_batch`]).
static KEYS: foldhash::fast::FixedState = foldhash::fast::FixedState::with_seed(0x6462_6c6f_636b);

fn take_batch<R: Row>(state: &mut State<R>, to: &R::To) -> Vec<Queued<R>> {
    let mut batch: Vec<Queued<R>> = Vec::with_capacity(state.queue.len().min(MAX_ROWS));
    // The keys taken, by hash: a row whose key's hash is taken waits for the next statement
    // (two distinct keys of one hash merely wait one statement more). No copy of a key.
    let mut keys: Vec<u64> = Vec::with_capacity(batch.capacity());
    let mut later = VecDeque::new();
    let leading = state
        .queue
        .iter()
        .find(|q| !q.answer.is_closed())
        .is_some_and(|q| q.row.leads(to));
    while let Some(q) = state.queue.pop_front() {
        if q.answer.is_closed() {
            // Its caller went away before it was sent: nothing to send.
            continue;
        }
        let hash = KEYS.hash_one(q.row.key());
        if batch.len() >= MAX_ROWS || keys.contains(&hash) || (leading && !q.row.leads(to)) {
            later.push_back(q);
            continue;
        }
        keys.push(hash);
        batch.push(q);
    }
    state.queue = later;
    batch
}

/// Sends one batch and answers each of its rows.
async fn send_batch<R: Row>(lane: &Inner<R>, to: &R::To, mut batch: Vec<Queued<R>>) {
    batch.sort_by(|a, b| a.row.key().as_bytes().cmp(b.row.key().as_bytes()));
    let deadline = batch
        .iter()
        .map(|q| q.deadline)
        .max()
        .unwrap_or_else(Instant::now);
    let (rows, answers): (Vec<R>, Vec<_>) = batch.into_iter().map(|q| (q.row, q.answer)).unzip();
    tracing::trace!(rows = rows.len(), "coalesced statement");
    match R::send(to, &rows, deadline).await {
        Ok(outs) if outs.len() == answers.len() => {
            for (answer, out) in answers.into_iter().zip(outs) {
                let _ = answer.send(Ok(out));
            }
        }
        Ok(outs) => {
            let failed = Failed {
                error: sqlx::Error::Protocol(format!(
                    "a coalesced statement of {} rows answered {}",
                    answers.len(),
                    outs.len()
                )),
                sent: true,
            };
            for answer in answers {
                let _ = answer.send(Err(copy(&failed, Failure::Unknown)));
            }
        }
        Err(failed) => {
            lane.note(&failed);
            let class = to.classify(&failed);
            for answer in answers {
                let _ = answer.send(Err(copy(&failed, class)));
            }
        }
    }
}

/// A failure of a batch, for one of its rows: same text, same `sent`, and classed as the
/// batch's failure was (`class`, by the backend's mapping), whatever the error's type.
pub(crate) fn copy(failed: &Failed, class: Failure) -> Failed {
    let error = match &failed.error {
        sqlx::Error::Io(io) => sqlx::Error::Io(std::io::Error::new(io.kind(), io.to_string())),
        sqlx::Error::PoolTimedOut => sqlx::Error::PoolTimedOut,
        other => sqlx::Error::Database(Box::new(Copied {
            message: other.to_string(),
            code: match other {
                sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
                _ => None,
            },
            class,
        })),
    };
    Failed {
        error,
        sent: failed.sent,
    }
}

/// A server (or other) error of a batch, as each of its rows reports it.
#[derive(Debug)]
pub(crate) struct Copied {
    message: String,
    code: Option<String>,
    /// How the batch's failure was classed: [`Backend::classify`] answers this for the copy.
    pub(crate) class: Failure,
}

impl std::fmt::Display for Copied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Copied {}

impl sqlx::error::DatabaseError for Copied {
    fn message(&self) -> &str {
        &self.message
    }

    fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
        self.code.as_deref().map(std::borrow::Cow::Borrowed)
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn kind(&self) -> sqlx::error::ErrorKind {
        sqlx::error::ErrorKind::Other
    }
}

/// A queued row's strings, copied in one allocation (a queued row outlives its caller's
/// borrow): `N` strings end to end, and where each ends.
#[derive(Debug, Clone)]
pub(crate) struct Texts<const N: usize> {
    all: Box<str>,
    ends: [usize; N],
}

impl<const N: usize> Texts<N> {
    pub(crate) fn new(parts: [&str; N]) -> Self {
        let mut all = String::with_capacity(parts.iter().map(|p| p.len()).sum());
        let mut ends = [0; N];
        for (end, part) in ends.iter_mut().zip(parts) {
            all.push_str(part);
            *end = all.len();
        }
        Texts {
            all: all.into_boxed_str(),
            ends,
        }
    }

    /// The `i`th string.
    fn get(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.all[start..self.ends[i]]
    }
}

/// An acquire's values, owned (a queued row outlives its caller's borrow).
#[derive(Debug, Clone)]
pub(crate) struct AcquireRow {
    /// Key, owner, holder.
    texts: Texts<3>,
    pub(crate) ttl_us: i64,
    pub(crate) attempt: i64,
    pub(crate) tenure: Option<i64>,
    pub(crate) held: u32,
    pub(crate) min_hold_us: i64,
    pub(crate) once: bool,
}

impl From<&Acquire<'_>> for AcquireRow {
    fn from(a: &Acquire<'_>) -> Self {
        AcquireRow {
            texts: Texts::new([a.key, a.owner, a.holder]),
            ttl_us: a.ttl_us,
            attempt: a.attempt,
            tenure: a.tenure,
            held: a.held,
            min_hold_us: a.min_hold_us,
            once: a.once,
        }
    }
}

impl AcquireRow {
    pub(crate) fn as_acquire(&self) -> Acquire<'_> {
        Acquire {
            key: self.texts.get(0),
            owner: self.texts.get(1),
            ttl_us: self.ttl_us,
            holder: self.texts.get(2),
            attempt: self.attempt,
            waiting: false,
            tenure: self.tenure,
            held: self.held,
            min_hold_us: self.min_hold_us,
            once: self.once,
        }
    }
}

impl Row for AcquireRow {
    type Out = Attempt;
    type To = Backend;

    fn key(&self) -> &str {
        self.texts.get(0)
    }

    async fn send(
        backend: &Backend,
        rows: &[Self],
        deadline: Instant,
    ) -> Result<Vec<Attempt>, Failed> {
        let all: Vec<Acquire<'_>> = rows.iter().map(AcquireRow::as_acquire).collect();
        backend.acquire_batch(&all, deadline).await
    }
}

/// A release's values, owned.
#[derive(Debug, Clone)]
pub(crate) struct ReleaseRow {
    /// Key, owner.
    texts: Texts<2>,
    pub(crate) fencing_token: u64,
    pub(crate) remaining: u32,
    pub(crate) outcome: Option<Outcome>,
    pub(crate) release_id: i64,
}

impl ReleaseRow {
    /// The release of `h` that leaves `remaining` holds, recording `outcome`, by `release_id`.
    pub(crate) fn new(
        h: &HoldRef<'_>,
        remaining: u32,
        outcome: Option<Outcome>,
        release_id: i64,
    ) -> Self {
        ReleaseRow {
            texts: Texts::new([h.key, h.owner]),
            fencing_token: h.fencing_token,
            remaining,
            outcome,
            release_id,
        }
    }

    pub(crate) fn key(&self) -> &str {
        self.texts.get(0)
    }

    pub(crate) fn owner(&self) -> &str {
        self.texts.get(1)
    }

    pub(crate) fn hold(&self) -> HoldRef<'_> {
        HoldRef {
            key: self.key(),
            owner: self.owner(),
            fencing_token: self.fencing_token,
        }
    }
}

impl Row for ReleaseRow {
    type Out = Released;
    type To = Backend;

    fn key(&self) -> &str {
        ReleaseRow::key(self)
    }

    async fn send(
        backend: &Backend,
        rows: &[Self],
        deadline: Instant,
    ) -> Result<Vec<Released>, Failed> {
        backend.release_batch(rows, deadline).await
    }
}

/// An extension's values, owned.
#[derive(Debug, Clone)]
pub(crate) struct ExtendRow {
    /// Key, owner.
    texts: Texts<2>,
    pub(crate) fencing_token: u64,
    pub(crate) ttl_us: i64,
}

impl ExtendRow {
    /// The extension of `h`'s lease to `ttl_us` from now.
    pub(crate) fn new(h: &HoldRef<'_>, ttl_us: i64) -> Self {
        ExtendRow {
            texts: Texts::new([h.key, h.owner]),
            fencing_token: h.fencing_token,
            ttl_us,
        }
    }

    pub(crate) fn key(&self) -> &str {
        self.texts.get(0)
    }

    pub(crate) fn owner(&self) -> &str {
        self.texts.get(1)
    }
}

impl Row for ExtendRow {
    /// `None`: not this tenure's any more; `Some(None)`: extended (the batch does not read
    /// the new end).
    type Out = Option<Option<i64>>;
    type To = Backend;

    fn key(&self) -> &str {
        ExtendRow::key(self)
    }

    async fn send(
        backend: &Backend,
        rows: &[Self],
        deadline: Instant,
    ) -> Result<Vec<Self::Out>, Failed> {
        if let [one] = rows {
            let h = HoldRef {
                key: one.key(),
                owner: one.owner(),
                fencing_token: one.fencing_token,
            };
            return Ok(vec![backend
                .extend(&h, one.ttl_us, deadline)
                .await?
                .map(Some)]);
        }
        let items: Vec<RenewItem<'_>> = rows.iter().map(ExtendRow::item).collect();
        let extended = backend.extend_many(&items, deadline).await?;
        Ok(ExtendRow::answers(rows.iter(), &extended))
    }
}

impl ExtendRow {
    pub(crate) fn item(&self) -> RenewItem<'_> {
        RenewItem {
            key: self.key(),
            owner: self.owner(),
            fencing_token: self.fencing_token,
            ttl_us: self.ttl_us,
        }
    }

    /// Each row's answer from the holds a statement `extended`.
    fn answers<'a>(
        rows: impl Iterator<Item = &'a ExtendRow>,
        extended: &Extended,
    ) -> Vec<Option<Option<i64>>> {
        let live: std::collections::HashSet<(&str, &str, u64)> = extended
            .iter()
            .map(|(k, o, t)| (k.as_str(), o.as_str(), *t))
            .collect();
        rows.map(|r| {
            live.contains(&(r.key(), r.owner(), r.fencing_token))
                .then_some(None)
        })
        .collect()
    }
}

/// A row of any kind, where statements of every kind share one transaction
/// ([`Backend::coalesce_kinds_together`]). Each kind is still one statement of its own rows; the
/// transaction gives them one commit (on SQLite, one WAL flush), and the lane one key per
/// statement across kinds.
#[derive(Debug)]
pub(crate) enum WriteRow {
    Acquire(AcquireRow),
    Release(ReleaseRow),
    Extend(ExtendRow),
}

/// A [`WriteRow`]'s answer: its kind's.
#[derive(Debug)]
pub(crate) enum WriteOut {
    Acquire(Attempt),
    Release(Released),
    Extend(Option<Option<i64>>),
}

impl WriteOut {
    fn attempt(self) -> Result<Attempt, Failed> {
        match self {
            WriteOut::Acquire(attempt) => Ok(attempt),
            _ => Err(mismatched()),
        }
    }

    fn released(self) -> Result<Released, Failed> {
        match self {
            WriteOut::Release(released) => Ok(released),
            _ => Err(mismatched()),
        }
    }

    fn extended(self) -> Result<Option<Option<i64>>, Failed> {
        match self {
            WriteOut::Extend(extended) => Ok(extended),
            _ => Err(mismatched()),
        }
    }
}

/// An answer of another kind than its row's: never (the answers follow the rows), and an error
/// of unknown outcome if it were.
fn mismatched() -> Failed {
    Failed {
        error: sqlx::Error::Protocol("a coalesced row got an answer of another kind".into()),
        sent: true,
    }
}

impl Row for WriteRow {
    type Out = WriteOut;
    type To = Backend;

    /// A lazily durable release leads ([`Backend::releases_lead`]): a statement of releases
    /// alone commits on connections that do not flush the log, where a transaction beside an
    /// acquire waits for the acquire's flush. Under load a lane of one slot then sends the
    /// releases of the holders a statement of acquires answered, and the acquires their
    /// callers send next travel together: the owners fall into step, and a flush serves every
    /// acquire rather than half of them.
    fn leads(&self, to: &Backend) -> bool {
        matches!(self, WriteRow::Release(_)) && to.releases_lead()
    }

    fn key(&self) -> &str {
        match self {
            WriteRow::Acquire(a) => a.key(),
            WriteRow::Release(r) => r.key(),
            WriteRow::Extend(e) => e.key(),
        }
    }

    async fn send(
        backend: &Backend,
        rows: &[Self],
        deadline: Instant,
    ) -> Result<Vec<WriteOut>, Failed> {
        let mut acquires = Vec::new();
        let mut releases = Vec::new();
        let mut extends = Vec::new();
        for row in rows {
            match row {
                WriteRow::Acquire(a) => acquires.push(a.as_acquire()),
                WriteRow::Release(r) => releases.push(r.clone()),
                WriteRow::Extend(e) => extends.push(e),
            }
        }
        let items: Vec<RenewItem<'_>> = extends.iter().map(|e| e.item()).collect();
        let (attempts, released, extended) = backend
            .write_batch(&acquires, &releases, &items, deadline)
            .await?;
        let mut attempts = attempts.into_iter();
        let mut released = released.into_iter();
        let mut extended = ExtendRow::answers(extends.into_iter(), &extended).into_iter();
        rows.iter()
            .map(|row| {
                let out = match row {
                    WriteRow::Acquire(_) => attempts.next().map(WriteOut::Acquire),
                    WriteRow::Release(_) => released.next().map(WriteOut::Release),
                    WriteRow::Extend(_) => extended.next().map(WriteOut::Extend),
                };
                out.ok_or_else(mismatched)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::time::Duration;

    /// A fake database: records each statement's keys, answers each row with its key's length
    /// after `delay`, or fails every row as `fail` says.
    #[derive(Clone, Debug, Default)]
    struct Db {
        sent: Arc<Mutex<Vec<Vec<String>>>>,
        delay: Duration,
        fail: Option<Failure>,
        /// Answers this long past the statement's deadline instead of after `delay` (a pool
        /// that retries a refused connection until the deadline, then fails).
        past_deadline: Option<Duration>,
    }

    #[derive(Debug)]
    struct Key(String);

    impl Row for Key {
        type Out = usize;
        type To = Db;

        fn key(&self) -> &str {
            &self.0
        }

        /// As SQLite's lazily durable releases: keys named `lazy:…`.
        fn leads(&self, _db: &Db) -> bool {
            self.0.starts_with("lazy:")
        }

        async fn send(db: &Db, rows: &[Self], deadline: Instant) -> Result<Vec<usize>, Failed> {
            lock(&db.sent).push(rows.iter().map(|r| r.0.clone()).collect());
            match db.past_deadline {
                Some(late) => tokio::time::sleep_until(deadline + late).await,
                None => tokio::time::sleep(db.delay).await,
            }
            match db.fail {
                Some(class) => Err(Failed {
                    error: sqlx::Error::Protocol(format!("{class:?}")),
                    sent: class != Failure::NotSent,
                }),
                None => Ok(rows.iter().map(|r| r.0.len()).collect()),
            }
        }
    }

    impl Classify for Db {
        fn classify(&self, failed: &Failed) -> Failure {
            match failed.error.to_string() {
                s if s.contains("Unknown") => Failure::Unknown,
                s if s.contains("NotCommitted") => Failure::NotCommitted,
                _ => Failure::Fatal,
            }
        }
    }

    /// Slots of the test lanes.
    const IN_FLIGHT: usize = 2;

    fn lane(db: &Db) -> Arc<Lane<Key>> {
        Arc::new(Lane::new(Some(db.clone()), IN_FLIGHT))
    }

    /// A call as the dispatcher's users make it: alone, it "sends" its own statement (held
    /// for `hold`); queued, it waits for its turn.
    async fn call(
        lane: Arc<Lane<Key>>,
        key: &str,
        hold: Duration,
        limit: Duration,
    ) -> Result<usize, Failed> {
        let deadline = Instant::now() + limit;
        match lane.enter(|| Key(key.to_owned()), deadline) {
            Entered::Alone(_slot) => {
                tokio::time::sleep(hold).await;
                Ok(key.len())
            }
            Entered::Queued(turn) => turn.wait().await,
        }
    }

    /// Takes every slot of `lane` for `hold`: lone callers whose statements take that long.
    fn occupy(
        lane: &Arc<Lane<Key>>,
        hold: Duration,
    ) -> Vec<tokio::task::JoinHandle<Result<usize, Failed>>> {
        callers(lane, "slot", IN_FLIGHT, hold)
    }

    /// `n` callers in tasks of their own, on keys `{tag}{i}`, each holding a statement it sends
    /// alone for `hold`, and waiting at most 20 s.
    fn callers(
        lane: &Arc<Lane<Key>>,
        tag: &str,
        n: usize,
        hold: Duration,
    ) -> Vec<tokio::task::JoinHandle<Result<usize, Failed>>> {
        (0..n)
            .map(|i| {
                let (lane, key) = (lane.clone(), format!("{tag}{i}"));
                tokio::spawn(async move { call(lane, &key, hold, Duration::from_secs(20)).await })
            })
            .collect()
    }

    /// A round of `queued` rows behind `alone` lone callers (holding their slots 10 ms): one
    /// batch of them.
    async fn round(lane: &Arc<Lane<Key>>, tag: String, alone: usize, queued: usize) {
        let held = callers(lane, &format!("{tag}:s"), alone, Duration::from_millis(10));
        tokio::time::sleep(Duration::from_millis(1)).await;
        let rows = callers(lane, &format!("{tag}:q"), queued, Duration::ZERO);
        finish(held).await;
        finish(rows).await;
    }

    /// A lane of 4 slots whose lone calls keep 1 once its batches are large, on a database that
    /// answers in 5 ms.
    fn moving_lane() -> (Db, Arc<Lane<Key>>) {
        moving_lane_on(&Budget::new(usize::MAX))
    }

    /// [`moving_lane`] sharing `budget`.
    fn moving_lane_on(budget: &Arc<Budget>) -> (Db, Arc<Lane<Key>>) {
        let db = Db {
            delay: Duration::from_millis(5),
            ..Db::default()
        };
        let lane = Lane::with_budget(Some(db.clone()), Slots { most: 4, least: 1 }, budget);
        (db, Arc::new(lane))
    }

    /// Waits for callers ([`occupy`], [`callers`]), each of which must have succeeded.
    async fn finish(callers: Vec<tokio::task::JoinHandle<Result<usize, Failed>>>) {
        for c in callers {
            c.await.unwrap().unwrap();
        }
    }

    /// Lanes sharing a budget keep at most its statements in flight together, whatever their
    /// own slots; a slot given back with the budget spent serves the other lanes' queues first.
    #[tokio::test(start_paused = true)]
    async fn lanes_share_the_budget_and_a_freed_slot_serves_the_others_first() {
        let db = Db {
            delay: Duration::from_millis(5),
            ..Db::default()
        };
        let budget = Budget::new(IN_FLIGHT);
        let slots = Slots {
            most: IN_FLIGHT,
            least: IN_FLIGHT,
        };
        let a = Arc::new(Lane::with_budget(Some(db.clone()), slots, &budget));
        let b = Arc::new(Lane::with_budget(Some(db.clone()), slots, &budget));
        // Lane a's lone calls spend the whole budget for 10 ms.
        let held = occupy(&a, Duration::from_millis(10));
        tokio::time::sleep(Duration::from_millis(1)).await;
        // b has every slot of its own free, but the budget has none: its call queues, and so
        // does a's next one.
        let b_row = callers(&b, "b", 1, Duration::ZERO);
        tokio::time::sleep(Duration::from_millis(1)).await;
        let a_row = callers(&a, "a", 1, Duration::ZERO);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(
            b.queued(),
            1,
            "b went beside a's statements, past the budget"
        );
        assert_eq!(a.queued(), 1);
        assert_eq!(budget.in_flight.load(Ordering::Acquire), IN_FLIGHT);
        // a's two statements end: the first slot back goes to b's queue (queued first or not,
        // it is the other lane's), the second to a's.
        finish(held).await;
        finish(b_row).await;
        finish(a_row).await;
        assert_eq!(
            *lock(&db.sent),
            vec![vec!["b0".to_owned()], vec!["a0".to_owned()]]
        );
        assert_eq!(budget.in_flight.load(Ordering::Acquire), 0);
    }

    /// Once a lane's batches are large on average, no call goes alone: one that finds fewer
    /// than `least` statements in flight starts a statement that gathers the calls beside it,
    /// and the rest wait and travel together; once batches are small again, lone calls take
    /// every slot.
    #[tokio::test(start_paused = true)]
    async fn lone_calls_leave_slots_to_batches_while_batches_are_large() {
        let (db, lane) = moving_lane();
        let alone_now = |lane: &Arc<Lane<Key>>| lock(&lane.inner.state).alone;
        assert_eq!(alone_now(&lane), 4);
        for i in 0..3 {
            round(&lane, format!("large{i}"), 4, 40).await;
        }
        assert_eq!(
            alone_now(&lane),
            1,
            "large batches: lone calls keep one slot"
        );
        // A call at the idle lane starts a statement; the next call queues for it rather than
        // go beside it, and both travel together.
        let before = lock(&db.sent).len();
        let first = lane.enter(|| Key("x".into()), Instant::now() + Duration::from_secs(1));
        let second = lane.enter(|| Key("y".into()), Instant::now() + Duration::from_secs(1));
        assert!(
            matches!(first, Entered::Queued(_)) && matches!(second, Entered::Queued(_)),
            "a call went alone while batches are large"
        );
        assert_eq!(lock(&lane.inner.state).in_flight, 1);
        for entered in [first, second] {
            if let Entered::Queued(turn) = entered {
                turn.wait().await.unwrap();
            }
        }
        assert_eq!(lock(&db.sent)[before..], [vec!["x".to_owned(), "y".into()]]);
        for i in 0..30 {
            round(&lane, format!("small{i}"), 1, 1).await;
        }
        assert_eq!(
            alone_now(&lane),
            4,
            "small batches: every slot for lone calls again"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_lone_caller_goes_alone_at_once() {
        let db = Db::default();
        let lane = lane(&db);
        let t = Instant::now();
        let got = call(
            lane.clone(),
            "a",
            Duration::from_millis(1),
            Duration::from_secs(1),
        )
        .await;
        assert_eq!(got.unwrap(), 1);
        assert_eq!(t.elapsed(), Duration::from_millis(1), "no timer, no wait");
        assert!(lock(&db.sent).is_empty(), "no batch for a lone caller");
    }

    #[tokio::test(start_paused = true)]
    async fn what_queues_while_slots_are_taken_goes_together_with_one_answer_each() {
        let db = Db {
            delay: Duration::from_millis(3),
            ..Db::default()
        };
        let lane = lane(&db);
        // Two lone callers take both slots for 10 ms.
        let alone = occupy(&lane, Duration::from_millis(10));
        tokio::time::sleep(Duration::from_millis(1)).await;
        let queued: Vec<_> = (0..5)
            .map(|i| {
                let lane = lane.clone();
                tokio::spawn(async move {
                    call(
                        lane,
                        &"k".repeat(i + 1),
                        Duration::ZERO,
                        Duration::from_secs(1),
                    )
                    .await
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(lane.queued(), 5);
        for (i, q) in queued.into_iter().enumerate() {
            assert_eq!(q.await.unwrap().unwrap(), i + 1, "each row its own answer");
        }
        finish(alone).await;
        let sent = lock(&db.sent).clone();
        assert_eq!(sent.len(), 1, "one statement for the five: {sent:?}");
        assert_eq!(sent[0], ["k", "kk", "kkk", "kkkk", "kkkkk"], "in key order");
    }

    /// When the oldest queued row leads (SQLite's lazily durable releases), the rows that lead
    /// go first, in a statement of their own, and the others, queued before or after them, in
    /// the next one; when the oldest does not lead, every row goes, so none waits for more
    /// than one statement of rows that lead.
    #[tokio::test(start_paused = true)]
    async fn rows_that_lead_go_first_in_a_statement_of_their_own() {
        for (order, expected) in [
            (
                ["lazy:1", "a1", "lazy:2", "a2"],
                vec![vec!["lazy:10", "lazy:20"], vec!["a10", "a20"]],
            ),
            (
                ["a1", "lazy:1", "a2", "lazy:2"],
                vec![vec!["a10", "a20", "lazy:10", "lazy:20"]],
            ),
        ] {
            let db = Db {
                delay: Duration::from_millis(3),
                ..Db::default()
            };
            let lane = Arc::new(Lane::new(Some(db.clone()), 1));
            let alone = callers(&lane, "slot", 1, Duration::from_millis(10));
            tokio::time::sleep(Duration::from_millis(1)).await;
            let mut queued = Vec::new();
            for key in order {
                queued.push((key, callers(&lane, key, 1, Duration::ZERO)));
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            assert_eq!(lane.queued(), 4);
            for (key, caller) in queued {
                for c in caller {
                    assert_eq!(
                        c.await.unwrap().unwrap(),
                        key.len() + 1,
                        "{key}'s own answer"
                    );
                }
            }
            finish(alone).await;
            let sent = lock(&db.sent).clone();
            assert_eq!(sent, expected, "queued as {order:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn two_rows_of_one_key_never_share_a_statement_and_batches_are_bounded() {
        let db = Db {
            delay: Duration::from_millis(2),
            ..Db::default()
        };
        let lane = lane(&db);
        let hold = occupy(&lane, Duration::from_millis(5));
        tokio::time::sleep(Duration::from_millis(1)).await;
        let mut queued = Vec::new();
        for i in 0..(MAX_ROWS + 10) {
            let lane = lane.clone();
            queued.push(tokio::spawn(async move {
                call(
                    lane,
                    &format!("key{i:03}"),
                    Duration::ZERO,
                    Duration::from_secs(1),
                )
                .await
            }));
        }
        let lane2 = lane.clone();
        queued.push(tokio::spawn(async move {
            call(lane2, "key000", Duration::ZERO, Duration::from_secs(1)).await
        }));
        for q in queued {
            q.await.unwrap().unwrap();
        }
        finish(hold).await;
        let sent = lock(&db.sent).clone();
        for batch in &sent {
            assert!(batch.len() <= MAX_ROWS, "a batch of {}", batch.len());
            let distinct: HashSet<&String> = batch.iter().collect();
            assert_eq!(distinct.len(), batch.len(), "a key twice in {batch:?}");
        }
        let rows: usize = sent.iter().map(Vec::len).sum();
        assert_eq!(rows, MAX_ROWS + 11, "every queued row sent exactly once");
    }

    #[tokio::test(start_paused = true)]
    async fn a_row_whose_deadline_passes_in_the_queue_is_not_sent() {
        let db = Db::default();
        let lane = lane(&db);
        let hold = occupy(&lane, Duration::from_millis(50));
        tokio::time::sleep(Duration::from_millis(1)).await;
        let t = Instant::now();
        let late = call(
            lane.clone(),
            "late",
            Duration::ZERO,
            Duration::from_millis(10),
        )
        .await;
        assert_eq!(
            t.elapsed(),
            Duration::from_millis(10),
            "answered at its own deadline"
        );
        let failed = late.unwrap_err();
        assert!(!failed.sent, "still queued: certainly not sent");
        assert_eq!(lane.queued(), 0, "taken out of the queue");
        finish(hold).await;
        assert!(
            lock(&db.sent).is_empty(),
            "never sent: {:?}",
            lock(&db.sent)
        );
    }

    /// A row queued behind every slot taken for 5 ms, with a deadline of 30 ms, on `db`: how
    /// long its call took, and how it failed.
    async fn in_flight_at_its_deadline(db: &Db) -> (Duration, Failed) {
        let lane = lane(db);
        let hold = occupy(&lane, Duration::from_millis(5));
        tokio::time::sleep(Duration::from_millis(1)).await;
        let t = Instant::now();
        let got = call(
            lane.clone(),
            "row",
            Duration::ZERO,
            Duration::from_millis(30),
        )
        .await;
        let took = t.elapsed();
        finish(hold).await;
        (took, got.unwrap_err())
    }

    #[tokio::test(start_paused = true)]
    async fn a_row_in_flight_at_its_deadline_is_an_unknown_outcome() {
        let db = Db {
            delay: Duration::from_millis(100),
            ..Db::default()
        };
        let (took, failed) = in_flight_at_its_deadline(&db).await;
        // Its deadline, and the grace for the answer of a statement that ends at it.
        assert_eq!(took, Duration::from_millis(30) + IN_FLIGHT_GRACE);
        assert!(failed.sent, "in flight: the outcome is unknown");
        assert!(
            failed.error.to_string().contains("no reply"),
            "{:?}",
            failed.error
        );
        assert_eq!(lock(&db.sent).len(), 1);
    }

    /// A statement that fails at its rows' deadline (a pool retrying a refused connection until
    /// then) answers just after it: a row in flight hears that failure, which names the cause,
    /// rather than "no reply". (Seen as a flaky fault test on MariaDB, a locker of one pooled
    /// connection whose server had gone: the timer won the race about one run in four.)
    #[tokio::test(start_paused = true)]
    async fn a_row_in_flight_hears_the_failure_its_statement_ends_with_at_the_deadline() {
        let db = Db {
            fail: Some(Failure::Fatal),
            past_deadline: Some(Duration::from_millis(2)),
            ..Db::default()
        };
        let (took, failed) = in_flight_at_its_deadline(&db).await;
        assert_eq!(took, Duration::from_millis(32));
        assert!(
            failed.error.to_string().contains("Fatal"),
            "the statement's own failure: {:?}",
            failed.error
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_batch_fails_each_row_with_the_batchs_class() {
        for class in [Failure::Unknown, Failure::NotCommitted, Failure::Fatal] {
            let db = Db {
                delay: Duration::from_millis(1),
                fail: Some(class),
                ..Db::default()
            };
            let lane = lane(&db);
            let hold = occupy(&lane, Duration::from_millis(5));
            tokio::time::sleep(Duration::from_millis(1)).await;
            let rows: Vec<_> = ["a", "b", "c"]
                .into_iter()
                .map(|k| {
                    let lane = lane.clone();
                    tokio::spawn(async move {
                        call(lane, k, Duration::ZERO, Duration::from_secs(1)).await
                    })
                })
                .collect();
            for r in rows {
                let failed = r.await.unwrap().unwrap_err();
                let copied = match &failed.error {
                    sqlx::Error::Database(db) => db.try_downcast_ref::<Copied>().map(|c| c.class),
                    _ => None,
                };
                assert_eq!(copied, Some(class), "{failed:?}");
                assert!(failed.sent);
                assert!(failed.error.to_string().contains(&format!("{class:?}")));
            }
            finish(hold).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_queued_row_whose_caller_went_away_is_not_sent() {
        let db = Db::default();
        let lane = lane(&db);
        let hold = occupy(&lane, Duration::from_millis(20));
        tokio::time::sleep(Duration::from_millis(1)).await;
        let gone = {
            let lane = lane.clone();
            tokio::spawn(
                async move { call(lane, "gone", Duration::ZERO, Duration::from_secs(1)).await },
            )
        };
        let kept = {
            let lane = lane.clone();
            tokio::spawn(
                async move { call(lane, "kept", Duration::ZERO, Duration::from_secs(1)).await },
            )
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        gone.abort();
        assert_eq!(kept.await.unwrap().unwrap(), 4);
        finish(hold).await;
        assert_eq!(*lock(&db.sent), [vec!["kept".to_owned()]]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_queue_behind_hung_statements_goes_beside_them() {
        let db = Db {
            delay: Duration::from_millis(1),
            ..Db::default()
        };
        let lane = lane(&db);
        // Both slots hang for 10 s (a connection cut without a word).
        let hung = occupy(&lane, Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(1)).await;
        let t = Instant::now();
        let got = call(lane.clone(), "next", Duration::ZERO, Duration::from_secs(5)).await;
        assert_eq!(got.unwrap(), 4);
        let waited = t.elapsed();
        assert!(
            waited >= STUCK - Duration::from_millis(1) && waited < STUCK * 3,
            "sent beside the hung statements after {waited:?}"
        );
        finish(hung).await;
    }

    #[tokio::test(start_paused = true)]
    async fn off_means_every_call_alone() {
        let lane: Arc<Lane<Key>> = Arc::new(Lane::new(None, IN_FLIGHT));
        let calls: Vec<_> = (0..8)
            .map(|i| {
                let lane = lane.clone();
                tokio::spawn(async move {
                    call(
                        lane,
                        &format!("k{i}"),
                        Duration::from_millis(5),
                        Duration::from_secs(1),
                    )
                    .await
                })
            })
            .collect();
        let t = Instant::now();
        for c in calls {
            c.await.unwrap().unwrap();
        }
        assert_eq!(
            t.elapsed(),
            Duration::from_millis(5),
            "all at once, none queued"
        );
    }

    /// The budget is the small-batch bound until a lane's batches average `BIG` rows, then the
    /// large-batch bound, and the small-batch bound again once they fall below `SMALL`.
    #[tokio::test(start_paused = true)]
    async fn the_budget_narrows_while_batches_are_large() {
        let budget = Budget::moving(4, 2);
        let (db, lane) = moving_lane_on(&budget);
        assert_eq!(budget.most(), 4);
        for i in 0..3 {
            round(&lane, format!("large{i}"), 4, 40).await;
        }
        assert_eq!(budget.most(), 2, "large batches: the large-batch bound");
        // The large lane's gathered statement and another lane's lone one spend it: the next
        // call queues.
        let a = lane.enter(|| Key("a".into()), Instant::now() + Duration::from_secs(1));
        let b = Lane::with_budget(Some(db.clone()), Slots { most: 4, least: 4 }, &budget);
        let b1 = b.enter(|| Key("b1".into()), Instant::now() + Duration::from_secs(1));
        let b2 = b.enter(|| Key("b2".into()), Instant::now() + Duration::from_secs(1));
        assert!(matches!(a, Entered::Queued(_)) && matches!(b1, Entered::Alone(_)));
        assert_eq!(budget.in_flight.load(Ordering::Acquire), 2);
        assert!(
            matches!(b2, Entered::Queued(_)),
            "a third statement beside two"
        );
        drop(b1);
        for entered in [a, b2] {
            if let Entered::Queued(turn) = entered {
                turn.wait().await.unwrap();
            }
        }
        for i in 0..30 {
            round(&lane, format!("small{i}"), 1, 1).await;
        }
        assert_eq!(
            budget.most(),
            4,
            "small batches: the small-batch bound again"
        );
    }

    /// While batches are large, the calls woken together with the one that found the lane idle
    /// (here: ready a turn of the scheduler after it) go in its statement, not one alone and
    /// the others behind it.
    #[tokio::test(start_paused = true)]
    async fn calls_woken_together_go_together_while_batches_are_large() {
        let (db, lane) = moving_lane();
        for i in 0..3 {
            round(&lane, format!("large{i}"), 4, 40).await;
        }
        let before = lock(&db.sent).len();
        let woken: Vec<_> = (0..8)
            .map(|i| {
                let lane = lane.clone();
                tokio::spawn(async move {
                    if i > 0 {
                        tokio::task::yield_now().await;
                    }
                    call(
                        lane,
                        &format!("w{i}"),
                        Duration::ZERO,
                        Duration::from_secs(1),
                    )
                    .await
                })
            })
            .collect();
        let t = Instant::now();
        finish(woken).await;
        let sent = lock(&db.sent)[before..].to_vec();
        assert_eq!(sent.len(), 1, "{sent:?}");
        assert_eq!(sent[0].len(), 8);
        assert_eq!(
            t.elapsed(),
            Duration::from_millis(5),
            "one round trip, no timer"
        );
    }

    /// While batches are large and another statement of the locker is in flight, a straggler
    /// left queued when its lane's statement ends waits for the next calls and goes with them;
    /// with no calls coming, it goes when the other statement ends.
    #[tokio::test(start_paused = true)]
    async fn stragglers_wait_for_the_next_calls_while_batches_are_large() {
        let budget = Budget::moving(4, 4);
        let (db, lane) = moving_lane_on(&budget);
        for i in 0..3 {
            round(&lane, format!("large{i}"), 4, 40).await;
        }
        assert!(lock(&lane.inner.state).large);
        // Another lane's statement, in flight until dropped.
        let other = Lane::with_budget(Some(db.clone()), Slots { most: 4, least: 4 }, &budget);
        let in_flight = other.enter(
            || Key("other".into()),
            Instant::now() + Duration::from_secs(1),
        );
        assert!(matches!(in_flight, Entered::Alone(_)));
        let sent = |from: usize| lock(&db.sent)[from..].to_vec();
        let limit = Duration::from_secs(1);
        let before = lock(&db.sent).len();
        // A statement of the lane, and a straggler queued behind it.
        let first = tokio::spawn(call(lane.clone(), "a", Duration::ZERO, limit));
        tokio::time::sleep(Duration::from_millis(1)).await;
        let straggler = tokio::spawn(call(lane.clone(), "s", Duration::ZERO, limit));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(first.is_finished());
        assert!(
            !straggler.is_finished(),
            "the straggler went alone: {:?}",
            sent(before)
        );
        assert_eq!(sent(before), [vec!["a".to_owned()]]);
        // The next calls take it along, in one statement.
        finish(callers(&lane, "w", 3, Duration::ZERO)).await;
        straggler.await.unwrap().unwrap();
        let keys = |k: &[&str]| k.iter().map(|k| k.to_string()).collect::<Vec<_>>();
        assert_eq!(sent(before + 1), [keys(&["s", "w0", "w1", "w2"])]);
        // Held again; no calls come: the other lane's statement ending sends it.
        let before = lock(&db.sent).len();
        let first = tokio::spawn(call(lane.clone(), "b", Duration::ZERO, limit));
        tokio::time::sleep(Duration::from_millis(1)).await;
        let straggler = tokio::spawn(call(lane.clone(), "t", Duration::ZERO, limit));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(first.is_finished() && !straggler.is_finished());
        drop(in_flight);
        let t = Instant::now();
        straggler.await.unwrap().unwrap();
        assert_eq!(
            t.elapsed(),
            Duration::from_millis(5),
            "sent at once, gathered"
        );
        assert_eq!(sent(before), [keys(&["b"]), keys(&["t"])]);
    }

    #[test]
    fn a_copy_keeps_text_sent_and_transport_kinds() {
        let io = Failed {
            error: sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                "refused",
            )),
            sent: false,
        };
        let c = copy(&io, Failure::NotSent);
        assert!(
            matches!(&c.error, sqlx::Error::Io(e) if e.kind() == std::io::ErrorKind::ConnectionRefused)
        );
        assert!(!c.sent);
        let c = copy(
            &Failed {
                error: sqlx::Error::PoolTimedOut,
                sent: false,
            },
            Failure::NotSent,
        );
        assert!(matches!(c.error, sqlx::Error::PoolTimedOut));
    }
}
