//! The coalescer on tokio's paused clock, against a fake database.

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
                tokio::spawn(
                    async move { call(lane, k, Duration::ZERO, Duration::from_secs(1)).await },
                )
            })
            .collect();
        for r in rows {
            let failed = r.await.unwrap().unwrap_err();
            assert_eq!(failed.class, Some(class), "{failed:?}");
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
        class: None,
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
            class: None,
        },
        Failure::NotSent,
    );
    assert!(matches!(c.error, sqlx::Error::PoolTimedOut));
}
