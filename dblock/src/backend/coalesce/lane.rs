//! The lane of one kind of statement: its slots in flight, the rows queued for the next
//! statement, and the per-row answers and deadlines.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::retry::{Failed, Failure};
use crate::sync::lock;

use super::failure::copy;
use super::policy::*;
use super::queue::{take_batch, Queued, State};
use super::{Classify, Row};

/// The lane of one kind of statement: how many are in flight, and the rows waiting for the
/// next one.
#[derive(Debug)]
pub(crate) struct Lane<R: Row> {
    pub(super) inner: Arc<Inner<R>>,
}

#[derive(Debug)]
pub(super) struct Inner<R: Row> {
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
    pub(super) state: Mutex<State<R>>,
    /// The latest failure of a statement of the lane: what a row that never got its turn
    /// reports as the cause.
    last_failure: Mutex<Option<(Instant, std::io::ErrorKind, String)>>,
    /// Statements of more than one row sent, and the rows in them.
    coalesced: [AtomicU64; 2],
}

/// How a call entered its lane.
pub(crate) enum Entered<'a, R: Row> {
    /// Sends its own statement now; the slot is given back (and the queue sent) when dropped.
    Alone(Slot<'a, R>),
    /// Queued for the next statement.
    Queued(Waiting<'a, R>),
}

/// A slot of a lane taken by a lone caller.
pub(crate) struct Slot<'a, R: Row> {
    lane: Option<&'a Arc<Inner<R>>>,
}

impl<R: Row> Slot<'_, R> {
    /// `result`, its failure noted for the rows queued behind it.
    pub(super) fn noted<T>(self, result: Result<T, Failed>) -> Result<T, Failed> {
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
pub(crate) struct Waiting<'a, R: Row> {
    lane: &'a Arc<Inner<R>>,
    id: u64,
    queued_at: Instant,
    deadline: Instant,
    answer: oneshot::Receiver<Result<R::Out, Failed>>,
}

impl<R: Row> Waiting<'_, R> {
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
                class: None,
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
                    class: None,
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
    pub(super) fn build(
        to: Option<R::To>,
        slots: Slots,
        budget: &Arc<Budget>,
        regroup: bool,
    ) -> Self {
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
        Entered::Queued(Waiting {
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
    pub(super) fn queued(&self) -> usize {
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
                class: None,
            };
            for answer in answers {
                let _ = answer.send(Err(copy(&failed, Failure::Unknown)));
            }
        }
        Err(failed) => {
            lane.note(&failed);
            let class = to.classify(&failed);
            if class == Failure::Locked && rows.len() > 1 {
                // One row was held past the lock wait (an open transaction holds its key): the
                // other rows are not to wait for it. Each goes again alone, all at once, and
                // only the held one's caller hears that it is locked.
                send_alone(to, &rows, answers, deadline).await;
                return;
            }
            for answer in answers {
                let _ = answer.send(Err(copy(&failed, class)));
            }
        }
    }
}

/// Sends each of `rows` as a statement of its own, concurrently (distinct keys, in key order:
/// no two can deadlock), and answers each row with its own result.
async fn send_alone<R: Row>(
    to: &R::To,
    rows: &[R],
    answers: Vec<tokio::sync::oneshot::Sender<Result<R::Out, Failed>>>,
    deadline: Instant,
) {
    let outs =
        futures_util::future::join_all(rows.chunks(1).map(|one| R::send(to, one, deadline))).await;
    for (answer, out) in answers.into_iter().zip(outs) {
        let out = match out {
            Ok(mut outs) if outs.len() == 1 => Ok(outs.remove(0)),
            Ok(outs) => Err(Failed {
                error: sqlx::Error::Protocol(format!(
                    "a one-row statement answered {} rows",
                    outs.len()
                )),
                sent: true,
                class: Some(Failure::Unknown),
            }),
            Err(failed) => {
                let class = to.classify(&failed);
                Err(copy(&failed, class))
            }
        };
        let _ = answer.send(out);
    }
}
