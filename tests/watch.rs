//! `Locker::watch` on every backend: acquired, released (with its outcome), expired, stolen
//! and an operator's release are reported for the keys under the prefix and only those, and a
//! consumer that does not keep up gets a `Lagged` item instead of unbounded memory.

mod common;

use std::time::Duration;

use dblock::{LockError, LockEvent, LockKind, Outcome, Watch};
use futures::StreamExt;

const EVERY: Duration = Duration::from_millis(50);
const LIMIT: Duration = Duration::from_secs(20);

async fn next(events: &mut Watch, name: &str) -> LockEvent {
    match tokio::time::timeout(LIMIT, events.next()).await {
        Ok(Some(Ok(e))) => e,
        other => panic!("{name}: no event: {other:?}"),
    }
}

/// Starts the watch and waits until its first read (the starting point) is behind it: a
/// sentinel key taken after that read is reported. Then the sentinel is gone again, and so are
/// the events of the sentinels before it.
async fn started(events: &mut Watch, l: &dblock::Locker, prefix: &str, every: Duration) {
    let sentinel = |e: &LockEvent, key: &str, acquired: bool| match e {
        LockEvent::Acquired(e) => acquired && e.key == key,
        LockEvent::Released { event, .. } => !acquired && event.key == key,
        _ => false,
    };
    // The first poll starts the watch, whose first read (the starting point) follows at once.
    let first = tokio::time::timeout(Duration::from_millis(1), events.next()).await;
    assert!(first.is_err(), "an event before the first read: {first:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    for round in 0..50 {
        let key = format!("{prefix}sentinel:{round}");
        let g = l.lock(key.as_str()).await.unwrap();
        let seen = tokio::time::timeout(every * 6, async {
            while let Some(Ok(e)) = events.next().await {
                if sentinel(&e, &key, true) {
                    return;
                }
            }
        })
        .await;
        g.release().await.unwrap();
        if seen.is_ok() {
            let gone = tokio::time::timeout(LIMIT, async {
                while let Some(Ok(e)) = events.next().await {
                    if sentinel(&e, &key, false) {
                        return;
                    }
                }
            })
            .await;
            assert!(gone.is_ok(), "the sentinel's release was not reported");
            return;
        }
    }
    panic!("the watch never started");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_reports_what_happens_to_keys() {
    let (dbs, _dir) = common::all("watch").await;
    for db in &dbs {
        let name = db.name;
        let l = common::own_table(db, "watch").await;
        let already = l.lock("w:already").await.unwrap();
        // Older than the stream by more than its margin (20 ms): not reported.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut events = l.watch("w:").every(EVERY);
        started(&mut events, &l, "w:", EVERY).await;

        // Taken and released: with the owner, holder, token and outcome.
        let g = l.lock("w:a").holder("job-a").await.unwrap();
        let _outside = l.lock("x:not-watched").await.unwrap();
        match next(&mut events, name).await {
            LockEvent::Acquired(e) => {
                assert_eq!(e.key, "w:a", "{name}");
                assert_eq!(e.fencing_token, g.fencing_token(), "{name}");
                assert_eq!(e.owner.as_deref(), Some(g.owner().id()), "{name}");
                assert!(e.holder.unwrap().ends_with("job-a"), "{name}");
            }
            other => panic!("{name}: {other:?}"),
        }
        let token = g.fencing_token();
        g.release().await.unwrap();
        match next(&mut events, name).await {
            LockEvent::Released { event, outcome } => {
                assert_eq!((event.key.as_str(), event.fencing_token), ("w:a", token));
                assert_eq!(outcome, Some(Outcome::Succeeded), "{name}");
            }
            other => panic!("{name}: {other:?}"),
        }

        // A lease that runs out.
        let short = l.lock("w:b").ttl(Duration::from_millis(300)).await.unwrap();
        assert!(matches!(next(&mut events, name).await, LockEvent::Acquired(e) if e.key == "w:b"));
        match next(&mut events, name).await {
            LockEvent::Expired(e) => assert_eq!(e.fencing_token, short.fencing_token()),
            other => panic!("{name}: {other:?}"),
        }
        drop(short);

        // Stolen.
        let victim = l.lock("w:c").await.unwrap();
        assert!(matches!(next(&mut events, name).await, LockEvent::Acquired(e) if e.key == "w:c"));
        let thief = l.clone();
        let newer = tokio::spawn(async move { thief.steal("w:c").await })
            .await
            .unwrap()
            .unwrap();
        match next(&mut events, name).await {
            LockEvent::Stolen { event, from_token } => {
                assert_eq!(from_token, victim.fencing_token(), "{name}");
                assert_eq!(event.fencing_token, newer.fencing_token(), "{name}");
            }
            other => panic!("{name}: {other:?}"),
        }
        drop(victim);
        newer.release().await.unwrap();
        assert!(matches!(
            next(&mut events, name).await,
            LockEvent::Released { event, outcome: Some(Outcome::Succeeded) } if event.key == "w:c"
        ));

        // An operator's release: a failure.
        let stuck = l.lock("w:d").await.unwrap();
        assert!(matches!(next(&mut events, name).await, LockEvent::Acquired(e) if e.key == "w:d"));
        assert!(l.force_release("w:d").await.unwrap());
        assert!(matches!(
            next(&mut events, name).await,
            LockEvent::Released { event, outcome: Some(Outcome::Failed) } if event.key == "w:d"
        ));
        drop(stuck);
        already.release().await.unwrap();
        assert!(matches!(
            next(&mut events, name).await,
            LockEvent::Released { event, .. } if event.key == "w:already"
        ));

        // Holds that begin and end between two reads (a read every second here).
        let mut rare = l.watch("w:short:").every(Duration::from_secs(1));
        started(&mut rare, &l, "w:short:", Duration::from_secs(1)).await;
        // Seen held by a read; the holds below come right after it.
        let seen = l.lock("w:short:seen").await.unwrap();
        assert!(matches!(next(&mut rare, name).await,
                LockEvent::Acquired(e) if e.key == "w:short:seen"));
        let brief = l.lock("w:short:a").holder("brief").await.unwrap();
        let brief_token = brief.fencing_token();
        brief.release().await.unwrap();
        seen.release().await.unwrap(); // the tenure seen held ends, and another begins and ends
        let twice = l.lock("w:short:seen").await.unwrap();
        let twice_token = twice.fencing_token();
        twice.release().await.unwrap();
        let mut got = Vec::new();
        while got.len() < 5 {
            got.push(next(&mut rare, name).await);
        }
        let [a, b, c, d, e] = <[LockEvent; 5]>::try_from(got).unwrap();
        match (a, b) {
            (LockEvent::Acquired(a), LockEvent::Released { event, outcome }) => {
                assert_eq!(
                    (a.key.as_str(), a.fencing_token),
                    ("w:short:a", brief_token)
                );
                assert!(a.holder.unwrap().ends_with("brief"), "{name}");
                assert_eq!(event.fencing_token, brief_token, "{name}");
                assert_eq!(outcome, Some(Outcome::Succeeded), "{name}");
            }
            other => panic!("{name}: the brief hold: {other:?}"),
        }
        assert!(
            matches!(&c, LockEvent::Released { event, outcome: None }
                if event.key == "w:short:seen" && event.fencing_token < twice_token),
            "{name}: {c:?}"
        );
        assert!(
            matches!(&d, LockEvent::Acquired(e) if e.fencing_token == twice_token),
            "{name}: {d:?}"
        );
        assert!(
            matches!(&e, LockEvent::Released { event, outcome: Some(Outcome::Succeeded) }
                if event.fencing_token == twice_token),
            "{name}: {e:?}"
        );
        drop(rare);

        // A consumer that does not read: bounded, and told how much it missed.
        let mut slow = l.watch("w:lag:").every(EVERY).capacity(2);
        started(&mut slow, &l, "w:lag:", EVERY).await;
        let mut held = Vec::new();
        for i in 0..8 {
            held.push(l.lock(format!("w:lag:{i}")).await.unwrap());
            tokio::time::sleep(EVERY * 2).await;
        }
        let mut lagged = 0;
        for _ in 0..3 {
            if let LockEvent::Lagged { skipped } = next(&mut slow, name).await {
                lagged += skipped;
            }
        }
        assert!(lagged > 0, "{name}: nothing reported skipped");
        drop(held);

        // The stream ends with the locker.
        l.shutdown().await;
        let end = tokio::time::timeout(LIMIT, async {
            while let Some(item) = events.next().await {
                if let Err(e) = item {
                    assert!(matches!(e, LockError::ShutDown), "{name}: {e:?}");
                }
            }
        })
        .await;
        assert!(end.is_ok(), "{name}: the stream did not end after shutdown");
    }
}

/// How many events a watch keeps up with: `KEYS` keys taken and released in waves, then a
/// wave of brief holds (each released at once), every change reported? Prints events/s per backend (`cargo test --test watch -- --ignored
/// --nocapture`); a measurement, not a check of speed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run it by name"]
async fn watch_throughput() {
    const KEYS: usize = 500;
    const WAVES: usize = 4;
    let (dbs, _dir) = common::all("watch_rate").await;
    for db in &dbs {
        let name = db.name;
        let l = common::own_table(db, "watch_rate").await;
        let mut events = l
            .watch("t:")
            .every(Duration::from_millis(250))
            .capacity(100_000);
        started(&mut events, &l, "t:", Duration::from_millis(250)).await;
        let counted = tokio::spawn(async move {
            let mut n = 0usize;
            let until = std::time::Instant::now() + Duration::from_secs(120);
            while n < KEYS * (WAVES + 1) * 2 && std::time::Instant::now() < until {
                match tokio::time::timeout(Duration::from_secs(10), events.next()).await {
                    Ok(Some(Ok(LockEvent::Lagged { .. }))) | Err(_) | Ok(None) => break,
                    Ok(Some(_)) => n += 1,
                }
            }
            n
        });
        let start = std::time::Instant::now();
        for _ in 0..WAVES {
            let guards = futures::future::join_all((0..KEYS).map(|i| {
                std::future::IntoFuture::into_future(
                    l.lock(format!("t:{i}")).ttl(Duration::from_secs(60)),
                )
            }))
            .await;
            tokio::time::sleep(Duration::from_millis(600)).await;
            for g in guards {
                g.unwrap().release().await.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(600)).await;
        }
        // And a wave of brief holds, each over before a read can see it held.
        futures::future::join_all((0..KEYS).map(|i| {
            let l = &l;
            async move {
                let g = l.lock(format!("t:{i}")).await.unwrap();
                g.release().await.unwrap();
            }
        }))
        .await;
        let n = counted.await.unwrap();
        let took = start.elapsed();
        eprintln!(
            "{name}: {n} of {} events in {took:?}: {:.0} events/s",
            KEYS * (WAVES + 1) * 2,
            n as f64 / took.as_secs_f64()
        );
    }
}

/// Any `Duration` and any capacity are accepted (SPEC: no panic on bad input): a watch that
/// reads once a `Duration::MAX` with room for `usize::MAX` events starts, reads, and stays
/// open (before, the capacity panicked in the first poll and the read's window overflowed,
/// ending the stream).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_takes_any_interval_and_capacity() {
    let (dbs, _dir) = common::all("watch_bounds").await;
    for db in &dbs {
        let l = common::own_table(db, "watch_bounds").await;
        let _held = l.lock("b:held").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await; // older than the stream
        let mut events = l.watch("b:").every(Duration::MAX).capacity(usize::MAX);
        // The first read is the starting point: no event, and the stream stays open.
        let first = tokio::time::timeout(Duration::from_secs(2), events.next()).await;
        assert!(first.is_err(), "{}: {first:?}", db.name);
    }
}

/// The holds taken after `watch()` made the stream are reported even when they were taken (and
/// given back) before its first poll; a hold older than the stream is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_taken_before_the_first_poll_are_reported() {
    let (dbs, _dir) = common::all("watch_early").await;
    for db in &dbs {
        let name = db.name;
        let l = common::own_table(db, "watch_early").await;
        let _older = l.lock("e:older").await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut events = l.watch("e:").every(EVERY);
        let held = l.lock("e:held").await.unwrap();
        l.lock("e:gone").await.unwrap().release().await.unwrap();
        let mut seen = Vec::new();
        let all = tokio::time::timeout(LIMIT, async {
            loop {
                let e = next(&mut events, name).await;
                seen.push(e);
                let acquired = |key: &str| {
                    seen.iter()
                        .any(|e| matches!(e, LockEvent::Acquired(e) if e.key == key))
                };
                let gone = seen.iter().any(|e| {
                    matches!(e, LockEvent::Released { event, outcome: Some(Outcome::Succeeded) } if event.key == "e:gone")
                });
                if acquired("e:held") && acquired("e:gone") && gone {
                    return;
                }
            }
        })
        .await;
        assert!(all.is_ok(), "{name}: {seen:?}");
        // A few more reads: the older hold is never reported.
        let more = tokio::time::timeout(EVERY * 6, events.next()).await;
        if let Ok(Some(Ok(e))) = &more {
            seen.push(e.clone());
        }
        assert!(
            !seen
                .iter()
                .any(|e| matches!(e, LockEvent::Acquired(e) if e.key == "e:older")),
            "{name}: a hold older than the stream was reported: {seen:?}"
        );
        let held_event = seen
            .iter()
            .find_map(|e| match e {
                LockEvent::Acquired(e) if e.key == "e:held" => Some(e.fencing_token),
                _ => None,
            })
            .unwrap();
        assert_eq!(held_event, held.fencing_token(), "{name}");
    }
}

/// A stream first polled long after `watch()` made it (more than its usual window of two reads
/// and a margin) still reports a hold taken and given back in between.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_first_poll_still_reports_what_came_since_watch() {
    let (dbs, _dir) = common::all("watch_late").await;
    for db in &dbs {
        let name = db.name;
        let l = common::own_table(db, "watch_late").await;
        let mut events = l.watch("late:").every(EVERY);
        l.lock("late:gone").await.unwrap().release().await.unwrap();
        // Well past `2 × every + 500 ms`, the window of a read.
        tokio::time::sleep(EVERY * 2 + Duration::from_millis(1500)).await;
        let mut seen = Vec::new();
        let both = tokio::time::timeout(LIMIT, async {
            loop {
                seen.push(next(&mut events, name).await);
                let acquired = seen
                    .iter()
                    .any(|e| matches!(e, LockEvent::Acquired(e) if e.key == "late:gone"));
                let released = seen.iter().any(|e| {
                    matches!(e, LockEvent::Released { event, outcome: Some(Outcome::Succeeded) } if event.key == "late:gone")
                });
                if acquired && released {
                    return;
                }
            }
        })
        .await;
        assert!(both.is_ok(), "{name}: {seen:?}");
    }
}

/// After `shutdown` the streams say why they end: one `ShutDown` item, then the end — for a
/// watch and an election's `observe` made afterwards (as any later call fails) and for a watch
/// that was running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_shutdown_the_streams_yield_shut_down_and_end() {
    let (dbs, _dir) = common::all("watch_shut").await;
    for db in &dbs {
        let name = db.name;
        let l = common::own_table(db, "watch_shut").await;
        let mut running = l.watch("s:").every(EVERY);
        let _ = l.lock("s:k").await.unwrap();
        next(&mut running, name).await; // it reads
        l.shutdown().await;
        for (which, mut stream) in [
            ("running watch", running),
            ("new watch", l.watch("s:").every(EVERY)),
        ] {
            let items = tokio::time::timeout(LIMIT, async {
                let mut errors = Vec::new();
                while let Some(item) = stream.next().await {
                    if let Err(e) = item {
                        errors.push(e);
                    }
                }
                errors
            })
            .await
            .unwrap_or_else(|_| panic!("{name}: the {which} did not end"));
            assert!(
                matches!(items.as_slice(), [LockError::ShutDown]),
                "{name}: {which}: {items:?}"
            );
        }
        let mut observe = l.leader("s:lead").observe();
        let first = tokio::time::timeout(LIMIT, observe.next()).await.unwrap();
        assert!(
            matches!(first, Some(Err(LockError::ShutDown))),
            "{name}: {first:?}"
        );
        assert!(observe.next().await.is_none(), "{name}: observe goes on");
    }
}

/// Semaphore permits are watched too: a permit's events carry the semaphore's key and
/// `LockKind::Permit`, a lock's `LockKind::Lock`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_are_reported_under_their_semaphores_key() {
    let (dbs, _dir) = common::all("watch_permits").await;
    for db in &dbs {
        let name = db.name;
        let l = common::own_table(db, "watch_permits").await;
        let mut events = l.watch("p:").every(EVERY);
        started(&mut events, &l, "p:", EVERY).await;

        let permit = l.semaphore("p:pool", 2).await.unwrap();
        match next(&mut events, name).await {
            LockEvent::Acquired(e) => {
                assert_eq!(e.key, "p:pool", "{name}");
                assert!(
                    matches!(e.kind, LockKind::Permit { permits: 2, .. }),
                    "{name}: {e:?}"
                );
                assert_eq!(e.fencing_token, permit.fencing_token(), "{name}");
            }
            other => panic!("{name}: {other:?}"),
        }
        permit.release().await.unwrap();
        match next(&mut events, name).await {
            LockEvent::Released { event, outcome } => {
                assert_eq!(event.key, "p:pool", "{name}");
                assert!(matches!(event.kind, LockKind::Permit { .. }), "{name}");
                assert_eq!(outcome, Some(Outcome::Succeeded), "{name}");
            }
            other => panic!("{name}: {other:?}"),
        }

        let g = l.lock("p:lock").await.unwrap();
        match next(&mut events, name).await {
            LockEvent::Acquired(e) => {
                assert_eq!(
                    (e.key.as_str(), e.kind),
                    ("p:lock", LockKind::Lock),
                    "{name}"
                )
            }
            other => panic!("{name}: {other:?}"),
        }
        g.release().await.unwrap();
    }
}

/// A locker whose table name is invalid: the watch says so once a round (its reads of the lock
/// table and of the permits' table fail alike), not once per table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_table_is_one_error_a_round() {
    let (dbs, _dir) = common::all("watch_bad_table").await;
    for db in &dbs {
        let bad = db.locker.table("no such; table");
        let mut events = bad.watch("").every(Duration::from_secs(2));
        let first = tokio::time::timeout(LIMIT, events.next()).await;
        assert!(
            matches!(first, Ok(Some(Err(LockError::Config(_))))),
            "{}: {first:?}",
            db.name
        );
        // The next read is a round later (2 s): nothing comes meanwhile.
        let second = tokio::time::timeout(Duration::from_millis(300), events.next()).await;
        assert!(second.is_err(), "{}: {second:?}", db.name);
    }
}
