//! Counting semaphores (`Locker::semaphore`) on every backend: never more holders than permits,
//! in one process and across three, a killed holder's permit back at its ttl, re-entry, and the
//! typed error for two numbers of permits on one key.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dblock::LockError;

const PERMITS: u32 = 4;

fn now_us() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros()
}

/// Runs only inside a child process (ignored in normal runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "child process entry point, started by the other tests"]
async fn child_entry() {
    let (role, locker) = common::child_locker().await;
    let dir = PathBuf::from(std::env::var("DBLOCK_CHILD_DIR").unwrap());
    match role.as_str() {
        "churn" => {
            let tasks: Vec<_> = (0..3)
                .map(|_| {
                    let (locker, log) = (locker.clone(), dir.join("history"));
                    tokio::spawn(async move {
                        for _ in 0..6 {
                            let permit = locker
                                .semaphore("pool", PERMITS)
                                .wait(Duration::from_secs(60))
                                .await
                                .unwrap();
                            let from = now_us();
                            tokio::time::sleep(Duration::from_millis(fastrand::u64(5..25))).await;
                            let to = now_us();
                            let mut f = std::fs::OpenOptions::new()
                                .append(true)
                                .create(true)
                                .open(&log)
                                .unwrap();
                            // One write per line: the processes append to one file at once.
                            f.write_all(format!("{from} {to}\n").as_bytes()).unwrap();
                            drop(f);
                            permit.release().await.unwrap();
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
        }
        "holder" => {
            let a = locker
                .semaphore("doomed", 2)
                .ttl(Duration::from_millis(1500))
                .await
                .unwrap();
            let b = locker
                .semaphore("doomed", 2)
                .ttl(Duration::from_millis(1500))
                .await
                .unwrap();
            println!("HELD {} {}", a.fencing_token(), b.fencing_token());
            std::io::stdout().flush().unwrap();
            tokio::time::sleep(Duration::from_secs(120)).await;
            drop((a, b));
        }
        "releaser" => {
            let p = locker.semaphore("handoff", 1).await.unwrap();
            println!("HELD {}", p.fencing_token());
            std::io::stdout().flush().unwrap();
            tokio::time::sleep(Duration::from_millis(1500)).await;
            p.release().await.unwrap();
            println!("RELEASED {}", now_us());
            std::io::stdout().flush().unwrap();
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        other => panic!("unknown role {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_more_holders_than_permits_and_every_task_gets_its_turn() {
    let (dbs, _dir) = common::all("semaphore_churn").await;
    for db in &dbs {
        let inside = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..12)
            .map(|_| {
                let (locker, inside, most) = (db.locker.clone(), inside.clone(), most.clone());
                tokio::spawn(async move {
                    for _ in 0..5 {
                        let permit = locker
                            .semaphore("exports", PERMITS)
                            .wait(Duration::from_secs(60))
                            .await
                            .unwrap();
                        assert_eq!(permit.key(), "exports");
                        let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(fastrand::u64(2..15))).await;
                        inside.fetch_sub(1, Ordering::SeqCst);
                        permit.release().await.unwrap();
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let most = most.load(Ordering::SeqCst);
        assert!(
            most <= PERMITS as usize,
            "{}: {most} holders at once",
            db.name
        );
        assert!(
            most >= 2,
            "{}: never more than one holder ({most})",
            db.name
        );
    }
}

/// The largest number of intervals that overlap at one instant.
fn most_at_once(intervals: &[(u128, u128)]) -> usize {
    let mut edges: Vec<(u128, i32)> = intervals
        .iter()
        .flat_map(|&(from, to)| [(from, 1), (to, -1)])
        .collect();
    // At equal times an end comes before a start: touching intervals do not overlap.
    edges.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, d) in edges {
        now += d;
        most = most.max(now);
    }
    most as usize
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_never_hold_more_than_the_permits() {
    let (dbs, _dir) = common::all("semaphore_processes").await;
    for db in &dbs {
        let work = tempfile::tempdir().unwrap();
        let mut children: Vec<_> = (0..3)
            .map(|_| {
                common::child_command(db, "churn")
                    .env("DBLOCK_CHILD_DIR", work.path())
                    .stdout(Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for c in &mut children {
            assert!(c.wait().unwrap().success(), "{}: a child failed", db.name);
        }
        let intervals = read_intervals(&work.path().join("history"));
        assert_eq!(
            intervals.len(),
            3 * 3 * 6,
            "{}: not every task got its permits",
            db.name
        );
        let most = most_at_once(&intervals);
        assert!(
            most <= PERMITS as usize,
            "{}: {most} holders at once",
            db.name
        );
        println!(
            "{}: at most {most} of {PERMITS} permits held at once",
            db.name
        );
    }
}

fn read_intervals(log: &Path) -> Vec<(u128, u128)> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| {
            let (a, b) = l.split_once(' ').unwrap();
            (a.parse().unwrap(), b.parse().unwrap())
        })
        .collect()
}

#[test]
fn the_overlap_count_counts() {
    assert_eq!(most_at_once(&[(0, 10), (5, 15), (9, 20)]), 3);
    assert_eq!(most_at_once(&[(0, 10), (10, 20)]), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holders_permits_come_back_at_their_ttl() {
    let (dbs, _dir) = common::all("semaphore_sigkill").await;
    for db in &dbs {
        let work = tempfile::tempdir().unwrap();
        let mut c = common::child_command(db, "holder")
            .env("DBLOCK_CHILD_DIR", work.path())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let line = common::read_marker(&mut c, "HELD ").await;
        let held_at = std::time::Instant::now();
        c.kill().unwrap(); // SIGKILL: no release
        c.wait().unwrap();
        let err = db.locker.semaphore("doomed", 2).await.unwrap_err();
        assert!(err.is_busy(), "{}: a permit was free: {err}", db.name);
        let permit = db
            .locker
            .semaphore("doomed", 2)
            .wait(Duration::from_secs(10))
            .await
            .expect("a permit once the ttl ran out");
        let after = held_at.elapsed();
        assert!(
            after < Duration::from_millis(1500 + 1000),
            "{}: took {after:?} after a 1.5 s ttl",
            db.name
        );
        let dead: Vec<u64> = line.split(' ').map(|t| t.parse().unwrap()).collect();
        assert!(
            dead.iter().any(|&t| permit.fencing_token() > t),
            "{}: token {} not above the dead holder's {dead:?}",
            db.name,
            permit.fencing_token()
        );
        permit.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_are_leases_reentrant_per_owner_and_refuse_a_second_number() {
    let (dbs, _dir) = common::all("semaphore_rules").await;
    for db in &dbs {
        let locker = &db.locker;
        let me = dblock::Owner::new();
        let a = locker.semaphore("exports", 2).owner(&me).await.unwrap();
        let again = locker.semaphore("exports", 2).owner(&me).await.unwrap();
        assert_eq!(again.hold_count(), 2, "{}", db.name);
        assert_eq!(again.fencing_token(), a.fencing_token(), "{}", db.name);
        // Not reentrant: a permit of its own (the other one), and then none is left, to this
        // owner either.
        let own = locker
            .semaphore("exports", 2)
            .owner(&me)
            .reentrant(false)
            .await
            .unwrap();
        assert_eq!(own.hold_count(), 1, "{}", db.name);
        for owner in [me.clone(), dblock::Owner::new()] {
            let third = locker.semaphore("exports", 2).owner(&owner);
            assert!(
                third.reentrant(false).await.unwrap_err().is_busy(),
                "{}: a third permit of two",
                db.name
            );
        }
        own.release().await.unwrap();
        let b = locker.semaphore("exports", 2).await.unwrap();
        assert!(
            locker.semaphore("exports", 2).await.unwrap_err().is_busy(),
            "{}: a third holder of two permits",
            db.name
        );
        // Another number of permits for the same key is refused, naming both.
        match locker.semaphore("exports", 5).await {
            Err(LockError::PermitsMismatch { asked, in_use, .. }) => {
                assert_eq!((asked, in_use), (5, 2), "{}", db.name);
            }
            other => panic!("{}: {other:?}", db.name),
        }
        // A lock of the same name is another lock.
        let lock = locker.lock("exports").await.unwrap();
        again.release().await.unwrap();
        a.release().await.unwrap();
        b.release().await.unwrap();
        lock.release().await.unwrap();
        let five = locker.semaphore("exports", 5).await.unwrap();
        five.release().await.unwrap();
        assert!(matches!(
            locker.semaphore("exports", 0).await,
            Err(LockError::Config(_))
        ));
        assert!(matches!(
            locker.semaphore("k".repeat(256), 2).await,
            Err(LockError::InvalidKey { .. })
        ));
    }
}

/// A semaphore key may be as long as any key (255 bytes), though its slots' row keys add up to
/// 15 bytes: keys past 233 bytes name their rows by a digest. Two such keys that differ in their
/// last byte only are two semaphores, and the operator's view names the key.
/// An owner's permit of the semaphore whose key is another's followed by the slots' separator
/// is no permit of that other: asking for the other again re-enters the permit of its own,
/// whichever of the two the owner's holds list first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_of_a_longer_key_is_not_mistaken_for_the_shorter_keys() {
    let (dbs, _dir) = common::all("semaphore_suffix").await;
    for db in &dbs {
        let locker = &db.locker;
        // The holds are looked up in a hash map: several owners, so both orders are met.
        for round in 0..12 {
            let me = dblock::Owner::new();
            let longer = locker
                .semaphore("exports\x1f2.0", 2)
                .owner(&me)
                .await
                .unwrap();
            let first = locker.semaphore("exports", 2).owner(&me).await.unwrap();
            let again = locker.semaphore("exports", 2).owner(&me).await.unwrap();
            assert_eq!(
                (again.hold_count(), again.fencing_token()),
                (2, first.fencing_token()),
                "{} round {round}: a second permit instead of a re-entry",
                db.name
            );
            for g in [again, first, longer] {
                g.release().await.unwrap();
            }
        }
    }
}

/// An owner whose permit was freed by an operator and taken by another owner meanwhile asks for
/// the semaphore again: its old slot is busy, which is no answer to the call (the owner's hold
/// of it is lost, as its renewal would say); the call waits for a permit as any other, within
/// its wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_freed_and_taken_by_another_is_waited_for_again() {
    let (dbs, _dir) = common::all("semaphore_freed").await;
    for db in &dbs {
        let (locker, operator) = (&db.locker, common::connect(db).await);
        let operator = operator.table(locker.table_name());
        let me = dblock::Owner::new();
        let _old = locker.semaphore("s", 1).owner(&me).await.unwrap();
        assert!(operator.force_release("s").await.unwrap(), "{}", db.name);
        let other = operator.semaphore("s", 1).await.unwrap();
        let giver = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            other.release().await.unwrap();
        });
        let again = locker
            .semaphore("s", 1)
            .owner(&me)
            .wait(Duration::from_secs(10))
            .await;
        let again = again.unwrap_or_else(|e| panic!("{}: {e}", db.name));
        assert_eq!(again.hold_count(), 1, "{}: a new permit", db.name);
        giver.await.unwrap();
        // Its release frees the semaphore: nothing of the lost hold is counted in it.
        again.release().await.unwrap();
        let free = operator.semaphore("s", 1).await;
        assert!(free.is_ok(), "{}: {free:?}", db.name);
    }
}

/// Two calls of one owner at once (sibling futures of one task, `join!`) take one permit, held
/// twice, as two calls one after the other do: never a permit each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_owners_calls_at_once_share_one_permit() {
    let (dbs, _dir) = common::all("semaphore_siblings").await;
    for db in &dbs {
        let locker = &db.locker;
        for round in 0..8 {
            let me = dblock::Owner::new();
            let (a, b) = tokio::join!(
                locker.semaphore("siblings", 3).owner(&me),
                locker.semaphore("siblings", 3).owner(&me)
            );
            let (a, b) = (a.unwrap(), b.unwrap());
            assert_eq!(
                (a.fencing_token(), a.hold_count().max(b.hold_count())),
                (b.fencing_token(), 2),
                "{} round {round}: two permits for one owner",
                db.name
            );
            b.release().await.unwrap();
            a.release().await.unwrap();
        }
    }
}

/// A semaphore whose key is another's slot row key (`a` + separator + `1.0`) has waiters in
/// this process: the other semaphore's permit is not held up by them (its slot's attempt is no
/// waiter of any line; the semaphore's own call is).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_of_a_semaphore_named_like_a_slot_hold_no_other_back() {
    let (dbs, _dir) = common::all("semaphore_line_names").await;
    for db in &dbs {
        let locker = &db.locker;
        // Fresh names each run: a run cut short leaves its permits until their ttl.
        let plain = format!("a{}", fastrand::u32(..));
        let odd = format!("{plain}\x1f1.0");
        let held = locker.semaphore(&odd, 1).await.unwrap();
        let waiter = {
            let (locker, odd) = (locker.clone(), odd.clone());
            tokio::spawn(
                async move { locker.semaphore(odd, 1).wait(Duration::from_secs(30)).await },
            )
        };
        // The waiter is in its line once it has found the semaphore full.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let other = locker
            .semaphore(&plain, 1)
            .wait(Duration::from_secs(1))
            .await;
        assert!(other.is_ok(), "{}: {other:?}", db.name);
        drop(held);
        let waited = waiter.await.unwrap();
        assert!(waited.is_ok(), "{}: {waited:?}", db.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_up_to_255_bytes_are_semaphores_of_their_own() {
    let (dbs, _dir) = common::all("semaphore_long_keys").await;
    for db in &dbs {
        let locker = &db.locker;
        for len in [233, 234, 240, 255] {
            let (a, b) = ("é".repeat(len / 2) + &"a".repeat(len % 2), "k".repeat(len));
            let mut c = a.clone();
            c.pop();
            c.push('c');
            let me = dblock::Owner::new();
            let first = locker.semaphore(&a, 2).owner(&me).await.unwrap();
            let again = locker.semaphore(&a, 2).owner(&me).await.unwrap();
            assert_eq!(again.hold_count(), 2, "{} {len}: a re-entry", db.name);
            let second = locker.semaphore(&a, 2).await.unwrap();
            let third = locker.semaphore(&a, 2).await;
            assert!(
                third.unwrap_err().is_busy(),
                "{} {len}: two permits",
                db.name
            );
            // Other keys as long are semaphores of their own.
            for other in [&b, &c] {
                let permit = locker.semaphore(other, 2).await.unwrap();
                permit.release().await.unwrap();
            }
            let in_use = locker.permits(&a).await.unwrap();
            assert_eq!(in_use.len(), 2, "{} {len}", db.name);
            assert!(in_use.iter().all(|p| p.key == a), "{} {len}", db.name);
            assert_eq!(first.key(), a, "{} {len}", db.name);
            assert!(locker.force_release(&a).await.unwrap(), "{} {len}", db.name);
            assert!(
                locker.permits(&a).await.unwrap().is_empty(),
                "{} {len}",
                db.name
            );
            let freed = locker.semaphore(&a, 2).await.unwrap();
            freed.release().await.unwrap();
            for gone in [first, again, second] {
                assert!(gone.release().await.is_err(), "{} {len}", db.name);
            }
        }
    }
}

/// A permit's errors name the semaphore's key, never the row a permit takes (`key␟N.i`):
/// extending a permit whose lease ran out is `NotHeld` for "exports".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_that_ran_out_is_not_held_under_its_semaphores_key() {
    let (dbs, _dir) = common::all("semaphore_not_held").await;
    for db in &dbs {
        let permit = db
            .locker
            .semaphore("exports", 2)
            .ttl(Duration::from_millis(300))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(900)).await;
        match permit.extend(Duration::from_secs(5)).await {
            Err(LockError::NotHeld { key }) => assert_eq!(key, "exports", "{}", db.name),
            other => panic!("{}: {other:?}", db.name),
        }
    }
}

/// `permits = 2` on a function: at most two bodies at once, each under its own permit.
#[cfg(feature = "macros")]
#[dblock::distributed_lock(key = "report:{region}", permits = 2, locker = locker, wait = "60s")]
async fn export(
    locker: &dblock::Locker,
    region: &str,
    inside: &AtomicUsize,
    most: &AtomicUsize,
) -> Result<u64, LockError> {
    let held = dblock::current().expect("inside a locked body");
    assert_eq!(held.key, format!("report:{region}"));
    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
    most.fetch_max(now, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(fastrand::u64(2..15))).await;
    inside.fetch_sub(1, Ordering::SeqCst);
    Ok(held.fencing_token)
}

#[cfg(feature = "macros")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_attribute_runs_at_most_permits_bodies_at_once() {
    let (dbs, _dir) = common::all("semaphore_attribute").await;
    for db in &dbs {
        let (inside, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let tasks: Vec<_> = (0..6)
            .map(|_| {
                let (locker, inside, most) = (db.locker.clone(), inside.clone(), most.clone());
                tokio::spawn(async move {
                    for _ in 0..4 {
                        export(&locker, "eu", &inside, &most).await.unwrap();
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let most = most.load(Ordering::SeqCst);
        assert!(
            (1..=2).contains(&most),
            "{}: {most} bodies at once",
            db.name
        );
        assert!(
            db.locker.semaphore("report:eu", 2).await.is_ok(),
            "{}: a permit left behind",
            db.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_of_one_process_get_permits_in_arrival_order() {
    let (dbs, _dir) = common::all("semaphore_order").await;
    for db in &dbs {
        let held = db.locker.semaphore("line", 1).await.unwrap();
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for i in 0..6 {
            let (locker, order) = (db.locker.clone(), order.clone());
            waiters.push(tokio::spawn(async move {
                let permit = locker
                    .semaphore("line", 1)
                    .wait(Duration::from_secs(30))
                    .await
                    .unwrap();
                order.lock().unwrap().push(i);
                tokio::time::sleep(Duration::from_millis(5)).await;
                permit.release().await.unwrap();
            }));
            // Arrive one after another (each has found every permit taken by now).
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        held.release().await.unwrap();
        for w in waiters {
            w.await.unwrap();
        }
        assert_eq!(
            *order.lock().unwrap(),
            vec![0, 1, 2, 3, 4, 5],
            "{}",
            db.name
        );
    }
}

/// A permit given back by another process reaches a waiter promptly: on PostgreSQL by NOTIFY
/// (the waiter asked every slot's holder for one), elsewhere by its polling (at most 250 ms
/// apart). The time is printed; the bound only says it is the release, not the lease's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_given_back_by_another_process_wakes_a_waiter() {
    let (dbs, _dir) = common::all("semaphore_handoff").await;
    for db in &dbs {
        let work = tempfile::tempdir().unwrap();
        let mut c = common::child_command(db, "releaser")
            .env("DBLOCK_CHILD_DIR", work.path())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = c.stdout.take().unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                let _ = tx.send(line);
            }
        });
        next(&mut rx, "HELD ").await;
        let permit = db
            .locker
            .semaphore("handoff", 1)
            .wait(Duration::from_secs(10))
            .await
            .unwrap();
        let granted = now_us();
        let released: u128 = next(&mut rx, "RELEASED ").await.parse().unwrap();
        let after = Duration::from_micros(granted.saturating_sub(released) as u64);
        assert!(
            after < Duration::from_secs(1),
            "{}: the permit came {after:?} after its release",
            db.name
        );
        println!(
            "{}: permit granted {after:?} after another process gave it back",
            db.name
        );
        permit.release().await.unwrap();
        c.wait().unwrap();
    }
}

/// What follows `marker` on the next line of a child's output that has it.
async fn next(rx: &mut tokio::sync::mpsc::UnboundedReceiver<String>, marker: &str) -> String {
    loop {
        let line = rx.recv().await.expect("the child's output");
        if let Some((_, rest)) = line.split_once(marker) {
            return rest.trim().to_owned();
        }
    }
}
