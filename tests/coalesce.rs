//! Coalescing against the real servers and a SQLite file: many tasks of one locker lock,
//! extend and release distinct keys at once; their rows share statements, and each call still
//! gets its own answer (granted, busy, done, not held), its own fencing token, and nothing is
//! orphaned when callers go away.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use dblock::{ConnectOptions, LockError, Locker};
use tokio::sync::Barrier;

const TASKS: usize = 64;
const SEC: Duration = Duration::from_secs(1);

/// Statements of several rows the locker sent so far (0 where the hook is not built).
fn coalesced(locker: &Locker) -> u64 {
    #[cfg(feature = "_test-util")]
    return dblock::test_util::coalesced(locker).0;
    #[cfg(not(feature = "_test-util"))]
    {
        let _ = locker;
        0
    }
}

/// `TASKS` tasks each run `f(i)` at the same instant.
async fn at_once<F, Fut, T>(f: F) -> Vec<T>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = T> + Send,
    T: Send + 'static,
{
    let f = Arc::new(f);
    let start = Arc::new(Barrier::new(TASKS));
    let tasks: Vec<_> = (0..TASKS)
        .map(|i| {
            let (f, start) = (f.clone(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                f(i).await
            })
        })
        .collect();
    let mut out = Vec::with_capacity(TASKS);
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// Rounds of 64 tasks locking at once: 8 keys held by another locker (busy rows), 8 keys done
/// for `once` (done rows), 8 keys their owners hold already (re-entered rows), 40 free keys
/// (granted rows), all in the same statements. Each call
/// gets its own answer; fencing tokens of each key rise round after round; the locker did send
/// statements of several rows; and after the releases every key is free.
#[tokio::test]
async fn concurrent_calls_share_statements_and_each_gets_its_own_answer() {
    let (dbs, _dir) = common::all("coalesce_answers").await;
    for db in &dbs {
        let l = db.locker.clone();
        let other = common::connect(db).await.table(l.table_name());
        let tag = format!("{}-{}", db.name, fastrand::u32(..));
        let mut held_elsewhere = Vec::new();
        for i in 0..8 {
            held_elsewhere.push(
                other
                    .lock(format!("{tag}:busy:{i}"))
                    .ttl(30 * SEC)
                    .await
                    .unwrap(),
            );
        }
        for i in 0..8 {
            l.lock(format!("{tag}:done:{i}"))
                .once()
                .await
                .unwrap()
                .release()
                .await
                .unwrap();
        }
        // Held by owners of this locker: their calls in the rounds are re-entries, counted on
        // the tenure the process holds (in a batch, carried per row beside the key).
        let owners: Vec<dblock::Owner> = (0..8).map(|_| dblock::Owner::new()).collect();
        let mut held_here = Vec::new();
        for (i, owner) in owners.iter().enumerate() {
            held_here.push(
                l.lock(format!("{tag}:again:{i}"))
                    .owner(owner)
                    .ttl(30 * SEC)
                    .await
                    .unwrap(),
            );
        }
        let owners = std::sync::Arc::new(owners);
        let before = coalesced(&l);
        let mut last_token: HashMap<usize, u64> = HashMap::new();
        for round in 0..5 {
            let (locker, tag2, owners2) = (l.clone(), tag.clone(), owners.clone());
            let got = at_once(move |i| {
                let (locker, tag, owners) = (locker.clone(), tag2.clone(), owners2.clone());
                async move {
                    let (key, once) = match i {
                        0..8 => (format!("{tag}:busy:{i}"), false),
                        8..16 => (format!("{tag}:done:{}", i - 8), true),
                        16..24 => (format!("{tag}:again:{}", i - 16), false),
                        _ => (format!("{tag}:free:{i}"), false),
                    };
                    let mut req = locker.lock(&key).wait(Duration::ZERO).ttl(30 * SEC);
                    if once {
                        req = req.once();
                    }
                    if let 16..24 = i {
                        req = req.owner(&owners[i - 16]);
                    }
                    req.await
                }
            })
            .await;
            let mut guards = Vec::new();
            for (i, g) in got.into_iter().enumerate() {
                match (i, g) {
                    (0..8, Err(e)) => assert!(e.is_busy(), "{}: row {i}: {e:?}", db.name),
                    (8..16, Err(LockError::AlreadyDone { .. })) => {}
                    (16..24, Ok(g)) => {
                        let first = &held_here[i - 16];
                        assert_eq!(g.hold_count(), 2, "{}: round {round}: re-entry", db.name);
                        assert_eq!(
                            g.fencing_token(),
                            first.fencing_token(),
                            "{}: round {round}: re-entry changed the tenure",
                            db.name
                        );
                        guards.push(g);
                    }
                    (24.., Ok(g)) => {
                        assert_eq!(g.hold_count(), 1, "{}", db.name);
                        if let Some(&t) = last_token.get(&i) {
                            assert!(
                                g.fencing_token() > t,
                                "{}: round {round}: token {} after {t}",
                                db.name,
                                g.fencing_token()
                            );
                        }
                        last_token.insert(i, g.fencing_token());
                        guards.push(g);
                    }
                    (i, other) => panic!("{}: round {round}: row {i}: {other:?}", db.name),
                }
            }
            // Release them all at once: release rows share statements too.
            let releases: Vec<_> = guards
                .into_iter()
                .map(|g| tokio::spawn(async move { g.release().await }))
                .collect();
            for r in releases {
                r.await.unwrap().unwrap();
            }
        }
        for (i, g) in held_here.into_iter().enumerate() {
            let info = l
                .inspect(&format!("{tag}:again:{i}"))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(
                info.hold_count, 1,
                "{}: re-entries not all given back",
                db.name
            );
            g.release().await.unwrap();
        }
        for i in 24..TASKS {
            let info = l
                .inspect(&format!("{tag}:free:{i}"))
                .await
                .unwrap()
                .unwrap();
            assert!(!info.held, "{}: {tag}:free:{i} left held", db.name);
        }
        for g in held_elsewhere {
            g.release().await.unwrap();
        }
        if cfg!(feature = "_test-util") {
            assert!(
                coalesced(&l) > before,
                "{}: 64 tasks at once never shared a statement",
                db.name
            );
        }
    }
}

/// `coalesce(false)`: the same load sends every statement alone.
#[tokio::test]
async fn coalesce_false_sends_every_statement_alone() {
    let (dbs, _dir) = common::all("coalesce_off").await;
    for db in &dbs {
        let off = Locker::connect_with(&db.url, ConnectOptions::new().coalesce(false))
            .await
            .unwrap();
        let off = common::as_named(db.name, off).table(db.locker.table_name());
        let locker = off.clone();
        let got = at_once(move |i| {
            let locker = locker.clone();
            async move {
                let g = locker
                    .lock(format!("off:{}:{i}", fastrand::u32(..)))
                    .wait(10 * SEC)
                    .await?;
                g.release().await
            }
        })
        .await;
        for r in got {
            r.unwrap();
        }
        assert_eq!(coalesced(&off), 0, "{}", db.name);
    }
}

/// Extensions and releases of many holds at once, some of which were taken away meanwhile
/// (force-released by an operator): those rows answer on their own — an extension `Lost` (the
/// lease was taken while it ran), a release `NotHeld` — while the rows beside them in the same
/// statements succeed.
#[tokio::test]
async fn extends_and_releases_answer_per_row() {
    let (dbs, _dir) = common::all("coalesce_rows").await;
    for db in &dbs {
        let l = db.locker.clone();
        let tag = format!("{}-{}", db.name, fastrand::u32(..));
        let mut guards = Vec::new();
        for i in 0..TASKS {
            guards.push(Arc::new(
                l.lock(format!("{tag}:{i}")).ttl(30 * SEC).await.unwrap(),
            ));
        }
        // Every 4th hold is taken away.
        for i in (0..TASKS).step_by(4) {
            assert!(l.force_release(&format!("{tag}:{i}")).await.unwrap());
        }
        let gs = guards.clone();
        let extended = at_once(move |i| {
            let g = gs[i].clone();
            async move { g.extend(60 * SEC).await }
        })
        .await;
        for (i, r) in extended.into_iter().enumerate() {
            match (i % 4, r) {
                (0, Err(LockError::Lost { .. })) | (1..=3, Ok(())) => {}
                (_, other) => panic!("{}: extend of row:{i}: {other:?}", db.name),
            }
        }
        for i in (1..TASKS).filter(|i| i % 4 != 0) {
            let info = l.inspect(&format!("{tag}:{i}")).await.unwrap().unwrap();
            assert!(
                info.time_left > 40 * SEC,
                "{}: {tag}:{i} not extended: {:?}",
                db.name,
                info.time_left
            );
        }
        let slots: Arc<std::sync::Mutex<Vec<Option<dblock::LockGuard>>>> =
            Arc::new(std::sync::Mutex::new(
                guards
                    .into_iter()
                    .map(|g| Some(Arc::into_inner(g).expect("one owner")))
                    .collect(),
            ));
        let released = at_once(move |i| {
            let g = slots.lock().unwrap()[i].take().unwrap();
            async move { g.release().await }
        })
        .await;
        for (i, r) in released.into_iter().enumerate() {
            match (i % 4, r) {
                (0, Err(LockError::NotHeld { .. })) | (1..=3, Ok(())) => {}
                (_, other) => panic!("{}: release of row:{i}: {other:?}", db.name),
            }
        }
        for i in 0..TASKS {
            let info = l.inspect(&format!("{tag}:{i}")).await.unwrap().unwrap();
            assert!(!info.held, "{}: {tag}:{i} still held", db.name);
        }
    }
}

/// Callers that go away while their rows are queued or in flight (a time-out around `lock()`)
/// orphan nothing: once their detached attempts have settled, every key is free again.
///
/// A detached attempt may still take its key after its caller has gone (and then give it back
/// at once), so "free" is not checked by looking at a key once: every key must be takeable
/// within a few seconds, once right after its round and once more after every round, well
/// inside the 30 s lease an orphaned hold would keep it for. Each round has keys of its own, so
/// a late attempt of one round never meets the next round's callers.
#[tokio::test]
async fn callers_that_go_away_orphan_nothing() {
    let (dbs, _dir) = common::all("coalesce_gone").await;
    for db in &dbs {
        let l = db.locker.clone();
        let tag = format!("{}-{}", db.name, fastrand::u32(..));
        let mut kept = 0;
        for round in 0..3 {
            let (locker, tag2) = (l.clone(), format!("{tag}-{round}"));
            let got = at_once(move |i| {
                let (locker, tag) = (locker.clone(), tag2.clone());
                async move {
                    // Spread the give-up instants over the queue's and the statements' life.
                    let patience = Duration::from_micros(fastrand::u64(0..4000));
                    let key = format!("{tag}:{i}");
                    tokio::time::timeout(patience, locker.lock(&key).ttl(30 * SEC)).await
                }
            })
            .await;
            for g in got.into_iter().flatten() {
                kept += 1;
                g.unwrap().release().await.unwrap();
            }
            takeable(&l, &format!("{tag}-{round}"), db.name, kept).await;
        }
        for round in 0..3 {
            takeable(&l, &format!("{tag}-{round}"), db.name, kept).await;
        }
    }
}

/// Every key `{tag}:{i}` can be taken (and is then released) within 10 s: none is orphaned.
async fn takeable(l: &Locker, tag: &str, name: &str, kept: usize) {
    let (locker, tag2) = (l.clone(), tag.to_string());
    let got = at_once(move |i| {
        let (locker, key) = (locker.clone(), format!("{tag2}:{i}"));
        async move {
            let taken = locker.lock(&key).ttl(5 * SEC).wait(10 * SEC).await;
            (key, taken)
        }
    })
    .await;
    for (key, taken) in got {
        match taken {
            Ok(g) => g.release().await.unwrap(),
            Err(e) => panic!("{name}: {key} orphaned ({kept} calls kept their guard): {e:?}"),
        }
    }
}

/// Releases, acquires and extensions of many keys at once, in the same instant: on SQLite they
/// share one transaction (one lane for every kind), elsewhere each kind its own statements.
/// Each row still gets its own kind's answer: released, not held (taken away meanwhile),
/// extended, granted with its own fencing token, busy (held by another locker).
#[tokio::test]
async fn kinds_sent_together_answer_per_row() {
    let (dbs, _dir) = common::all("coalesce_kinds").await;
    for db in &dbs {
        let l = db.locker.clone();
        let other = common::connect(db).await.table(l.table_name());
        let tag = format!("{}-{}", db.name, fastrand::u32(..));
        // Rows 0..16 release (every 4th taken away), 16..32 extend (every 4th taken away),
        // 32..64 acquire (every 4th held by the other locker).
        let mut guards: Vec<Option<dblock::LockGuard>> = Vec::new();
        let mut kept = Vec::new();
        for i in 0..TASKS {
            let key = format!("{tag}:{i}");
            if i < 32 {
                guards.push(Some(l.lock(&key).ttl(30 * SEC).await.unwrap()));
            } else {
                if i % 4 == 0 {
                    kept.push(other.lock(&key).ttl(30 * SEC).await.unwrap());
                }
                guards.push(None);
            }
        }
        for i in (0..32).step_by(4) {
            assert!(l.force_release(&format!("{tag}:{i}")).await.unwrap());
        }
        let before = coalesced(&l);
        let guards = Arc::new(std::sync::Mutex::new(guards));
        let (locker, t) = (l.clone(), tag.clone());
        let got = at_once(move |i| {
            let g = guards.lock().unwrap()[i].take();
            let (locker, key) = (locker.clone(), format!("{t}:{i}"));
            async move {
                match (i, g) {
                    (0..16, Some(g)) => g.release().await.map(|()| None),
                    // The extended holds are kept (returned) to be looked at below.
                    (16..32, Some(g)) => g.extend(60 * SEC).await.map(|()| Some(g)),
                    (_, _) => locker.lock(key).ttl(30 * SEC).await.map(Some),
                }
            }
        })
        .await;
        let mut holds = Vec::new();
        for (i, r) in got.into_iter().enumerate() {
            match (i, i % 4, r) {
                (0..16, 0, Err(LockError::NotHeld { .. }))
                | (16..32, 0, Err(LockError::Lost { .. }))
                | (0..16, 1..=3, Ok(None))
                | (32.., 0, Err(LockError::Busy { .. })) => {}
                (16..32, 1..=3, Ok(Some(g))) => holds.push(g),
                (32.., 1..=3, Ok(Some(g))) => {
                    assert!(g.fencing_token() > 0, "{}", db.name);
                    holds.push(g);
                }
                (_, _, other) => panic!("{}: row {i}: {other:?}", db.name),
            }
        }
        for i in 0..TASKS {
            let info = l.inspect(&format!("{tag}:{i}")).await.unwrap().unwrap();
            let held = match i {
                0..16 => false,
                16..32 => i % 4 != 0,
                _ => true,
            };
            assert_eq!(info.held, held, "{}: {tag}:{i}", db.name);
            if (16..32).contains(&i) && held {
                assert!(
                    info.time_left > 40 * SEC,
                    "{}: {tag}:{i} not extended",
                    db.name
                );
            }
        }
        if cfg!(feature = "_test-util") {
            assert!(coalesced(&l) > before, "{}: nothing coalesced", db.name);
        }
        drop((kept, holds));
    }
}

/// The benchmark's raw coalesced statements (`test_util::Statements::acquire_batch`,
/// `release_batch`) answer per row as the coalescer's batches do: a key another owner holds is
/// busy and the rest are granted in one statement; a release with a stale token releases
/// nothing and the others free their keys; a whole batched cycle (`cycle_batch`) fails on a
/// busy key and goes through once every key is free; every key is free afterwards.
#[cfg(feature = "_test-util")]
#[tokio::test]
async fn raw_coalesced_statements_answer_per_row() {
    let (dbs, _dir) = common::all("coalesce_raw").await;
    for db in &dbs {
        let l = db.locker.clone();
        let raw = dblock::test_util::statements(&l);
        let tag = format!("{}-{}", db.name, fastrand::u32(..));
        let mut keys: Vec<String> = (0..6).map(|i| format!("{tag}:{i}")).collect();
        keys.sort_unstable();
        let other = l.lock(&keys[2]).ttl(30 * SEC).await.unwrap();
        let owner = dblock::Owner::new().id().to_owned();
        let tokens = raw.acquire_batch(&keys, &owner, 30 * SEC).await.unwrap();
        assert_eq!(tokens.len(), keys.len(), "{}", db.name);
        assert!(tokens[2].is_none(), "{}: a held key is busy", db.name);
        let mut held: Vec<(String, u64)> = keys
            .iter()
            .zip(&tokens)
            .filter_map(|(k, t)| t.map(|t| (k.clone(), t)))
            .collect();
        assert_eq!(held.len(), keys.len() - 1, "{}: {tokens:?}", db.name);
        held[0].1 += 1; // not its tenure
        let released = raw.release_batch(&held, &owner).await.unwrap();
        assert_eq!(released, vec![false, true, true, true, true], "{}", db.name);
        held[0].1 -= 1;
        let again = raw.release_batch(&held[..1], &owner).await.unwrap();
        assert_eq!(again, vec![true], "{}", db.name);
        // A whole batched cycle, as the benchmark runs it: an error while a key is busy (the
        // others it took stay held, and are released here), none once every key is free.
        let busy = raw.cycle_batch(&keys, &owner, 30 * SEC).await.unwrap_err();
        assert!(busy.to_string().contains("busy"), "{}: {busy}", db.name);
        let mut taken = Vec::new();
        for key in &keys {
            let info = l.inspect(key).await.unwrap().unwrap();
            if info.held && info.owner.as_deref() == Some(owner.as_str()) {
                taken.push((key.clone(), info.fencing_token));
            }
        }
        assert_eq!(taken.len(), keys.len() - 1, "{}", db.name);
        let freed = raw.release_batch(&taken, &owner).await.unwrap();
        assert!(freed.iter().all(|f| *f), "{}: {freed:?}", db.name);
        other.release().await.unwrap();
        raw.cycle_batch(&keys, &owner, 30 * SEC).await.unwrap();
        for key in &keys {
            let info = l.inspect(key).await.unwrap().unwrap();
            assert!(!info.held, "{}: {key} still held", db.name);
        }
    }
}
