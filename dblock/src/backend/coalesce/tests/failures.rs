//! Deadlines, failed statements and callers that went away, and what each row hears; the
//! budget's narrowing and gathering under large batches.

use super::*;

#[tokio::test(start_paused = true)]
async fn a_row_whose_deadline_passes_in_the_queue_is_not_sent() {
    let db = Db::default();
    let (lane, hold) = occupied(&db, Duration::from_millis(50)).await;
    let t = Instant::now();
    let late = row(&lane, "late", Duration::from_millis(10)).await;
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
    let (lane, hold) = occupied(db, Duration::from_millis(5)).await;
    let t = Instant::now();
    let got = row(&lane, "row", Duration::from_millis(30)).await;
    let took = t.elapsed();
    finish(hold).await;
    (took, got.unwrap_err())
}

#[tokio::test(start_paused = true)]
async fn a_row_in_flight_at_its_deadline_is_an_unknown_outcome() {
    let db = Db::answering_in(Duration::from_millis(100));
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
        let (lane, hold) = occupied(&db, Duration::from_millis(5)).await;
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
    let (lane, hold) = occupied(&db, Duration::from_millis(20)).await;
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
    let db = Db::answering_in(Duration::from_millis(1));
    // Both slots hang for 10 s (a connection cut without a word).
    let (lane, hung) = occupied(&db, Duration::from_secs(10)).await;
    let t = Instant::now();
    let got = row(&lane, "next", Duration::from_secs(5)).await;
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
    let hold = Duration::from_millis(5);
    let calls: Vec<_> = (0..8)
        .map(|i| spawn_call(&lane, format!("k{i}"), hold, Duration::from_secs(1)))
        .collect();
    let t = Instant::now();
    for c in calls {
        c.await.unwrap().unwrap();
    }
    assert_eq!(t.elapsed(), hold, "all at once, none queued");
}

/// The budget is the small-batch bound until a lane's batches average `BIG` rows, then the
/// large-batch bound, and the small-batch bound again once they fall below `SMALL`.
#[tokio::test(start_paused = true)]
async fn the_budget_narrows_while_batches_are_large() {
    let budget = Budget::moving(4, 2);
    let (db, lane) = moving_lane_on(&budget);
    assert_eq!(budget.most(), 4);
    make_batches_large(&lane).await;
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
    make_batches_large(&lane).await;
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
    assert_eq!(t.elapsed(), ROUND_TRIP, "one round trip, no timer");
}

/// While batches are large and another statement of the locker is in flight, a straggler
/// left queued when its lane's statement ends waits for the next calls and goes with them;
/// with no calls coming, it goes when the other statement ends.
#[tokio::test(start_paused = true)]
async fn stragglers_wait_for_the_next_calls_while_batches_are_large() {
    let budget = Budget::moving(4, 4);
    let (db, lane) = moving_lane_on(&budget);
    make_batches_large(&lane).await;
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
    assert_eq!(t.elapsed(), ROUND_TRIP, "sent at once, gathered");
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
