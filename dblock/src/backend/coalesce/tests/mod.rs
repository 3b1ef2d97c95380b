//! The coalescer on tokio's paused clock, against a fake database: how calls share lanes,
//! slots and statements here; deadlines, failures and callers gone in `failures.rs`.

mod failures;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use tokio::time::Instant;

use super::failure::copy;
use super::lane::*;
use super::policy::*;
use super::{Classify, Row};
use crate::retry::{Failed, Failure};
use crate::sync::lock;
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

impl Db {
    /// A database that answers every statement after `delay`.
    fn answering_in(delay: Duration) -> Db {
        Db {
            delay,
            ..Db::default()
        }
    }
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
                class: None,
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

/// A [`call`] that holds nothing once sent (a row, as the ones queued behind busy slots),
/// waiting at most `limit`.
async fn row(lane: &Arc<Lane<Key>>, key: &str, limit: Duration) -> Result<usize, Failed> {
    call(lane.clone(), key, Duration::ZERO, limit).await
}

/// [`call`] in a task of its own.
fn spawn_call(
    lane: &Arc<Lane<Key>>,
    key: String,
    hold: Duration,
    limit: Duration,
) -> tokio::task::JoinHandle<Result<usize, Failed>> {
    let lane = lane.clone();
    tokio::spawn(async move { call(lane, &key, hold, limit).await })
}

/// Takes every slot of `lane` for `hold`: lone callers whose statements take that long.
fn occupy(
    lane: &Arc<Lane<Key>>,
    hold: Duration,
) -> Vec<tokio::task::JoinHandle<Result<usize, Failed>>> {
    callers(lane, "slot", IN_FLIGHT, hold)
}

/// A test lane on `db` whose slots lone callers have taken for `hold` (their statements are
/// in flight, 1 ms on): what comes next queues behind them.
async fn occupied(
    db: &Db,
    hold: Duration,
) -> (
    Arc<Lane<Key>>,
    Vec<tokio::task::JoinHandle<Result<usize, Failed>>>,
) {
    let lane = lane(db);
    let held = occupy(&lane, hold);
    tokio::time::sleep(Duration::from_millis(1)).await;
    (lane, held)
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
        .map(|i| spawn_call(lane, format!("{tag}{i}"), hold, Duration::from_secs(20)))
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

/// Three rounds of 40 rows behind 4 lone callers: the lane's batches are large from then on.
async fn make_batches_large(lane: &Arc<Lane<Key>>) {
    for i in 0..3 {
        round(lane, format!("large{i}"), 4, 40).await;
    }
}

/// A lane of 4 slots whose lone calls keep 1 once its batches are large, on a database that
/// answers in 5 ms.
fn moving_lane() -> (Db, Arc<Lane<Key>>) {
    moving_lane_on(&Budget::new(usize::MAX))
}

/// How long the database of [`moving_lane`] takes to answer a statement.
const ROUND_TRIP: Duration = Duration::from_millis(5);

/// [`moving_lane`] sharing `budget`.
fn moving_lane_on(budget: &Arc<Budget>) -> (Db, Arc<Lane<Key>>) {
    let db = Db::answering_in(ROUND_TRIP);
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
    let db = Db::answering_in(Duration::from_millis(5));
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
    make_batches_large(&lane).await;
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
    let db = Db::answering_in(Duration::from_millis(3));
    // Two lone callers take both slots for 10 ms.
    let (lane, alone) = occupied(&db, Duration::from_millis(10)).await;
    let queued: Vec<_> = (0..5)
        .map(|i| {
            spawn_call(
                &lane,
                "k".repeat(i + 1),
                Duration::ZERO,
                Duration::from_secs(1),
            )
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
        let db = Db::answering_in(Duration::from_millis(3));
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
    let db = Db::answering_in(Duration::from_millis(2));
    let (lane, hold) = occupied(&db, Duration::from_millis(5)).await;
    let mut queued = Vec::new();
    for i in 0..(MAX_ROWS + 10) {
        queued.push(spawn_call(
            &lane,
            format!("key{i:03}"),
            Duration::ZERO,
            Duration::from_secs(1),
        ));
    }
    queued.push(spawn_call(
        &lane,
        "key000".to_owned(),
        Duration::ZERO,
        Duration::from_secs(1),
    ));
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
