//! A lane's state: its statements in flight, its batches' size, and the rows queued for its next
//! statement; and which of them go next ([`take_batch`]).

use std::collections::VecDeque;
use std::hash::BuildHasher;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::policy::MAX_ROWS;
use super::Row;
use crate::retry::Failed;

/// The state of one lane, under its mutex.
pub(super) struct State<R: Row> {
    pub(super) in_flight: usize,
    /// Statements in flight below which a lone call goes at once (between `slots.least` and
    /// `slots.most`, as the batches' sizes say).
    pub(super) alone: usize,
    /// The mean size of the lane's batches, in sixteenths of a row, each new batch weighing
    /// 1/8.
    pub(super) mean_x16: usize,
    /// Whether the lane's batches count as large (from a mean of `BIG` rows until it falls
    /// below `SMALL`), as the budget counts it.
    pub(super) large: bool,
    pub(super) queue: VecDeque<Queued<R>>,
    pub(super) next_id: u64,
    /// When a statement of the lane last started or ended.
    pub(super) progress: Instant,
    /// Whether the queue is a few stragglers held back for the calls that come next
    /// ([`Inner::send_queued`]).
    pub(super) held: bool,
}

impl<R: Row> std::fmt::Debug for State<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("in_flight", &self.in_flight)
            .field("queued", &self.queue.len())
            .finish()
    }
}

pub(super) struct Queued<R: Row> {
    pub(super) id: u64,
    pub(super) row: R,
    pub(super) deadline: Instant,
    pub(super) answer: oneshot::Sender<Result<R::Out, Failed>>,
}

/// The next statement's rows out of `state`'s queue: at most [`MAX_ROWS`], one per key, in
/// the order they queued; rows whose callers went away are dropped. When the oldest row leads
/// ([`Row::leads`]), only rows that lead go, and the others wait for the next statement; when
/// it does not, every kind goes. A row that does not lead so waits for one statement at most
/// that it would have travelled in, however many rows that lead queue behind it.
/// Hashes a batch's keys ([`take_batch`]).
static KEYS: foldhash::fast::FixedState = foldhash::fast::FixedState::with_seed(0x6462_6c6f_636b);

pub(super) fn take_batch<R: Row>(state: &mut State<R>, to: &R::To) -> Vec<Queued<R>> {
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
