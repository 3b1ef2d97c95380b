//! Shared (read) locks (`Locker::read`) on every backend: readers share a key and exclude the
//! writer (`Locker::lock`) and the writer excludes them, a waiting writer is not starved by a
//! stream of readers, no race of a reader and a writer lets both in (write skew), re-entry and
//! the refusal to wait for oneself.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dblock::LockError;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_share_a_key_and_exclude_the_writer() {
    let (dbs, _dir) = common::all("read_basics").await;
    for db in &dbs {
        let locker = &db.locker;
        let a = locker.read("config").await.unwrap();
        let b = locker.read("config").await.unwrap();
        assert_eq!(a.key(), "config", "{}", db.name);
        assert_eq!(b.hold_count(), 2, "{}: two readers", db.name);
        assert_eq!(
            a.fencing_token(),
            b.fencing_token(),
            "{}: one read tenure",
            db.name
        );
        let info = locker.inspect("config").await.unwrap().unwrap();
        assert!(info.held && info.hold_count == 2, "{}: {info:?}", db.name);
        assert_eq!(
            info.kind,
            dblock::LockKind::Read {
                writer_waiting: false
            },
            "{}",
            db.name
        );
        assert!(
            locker.lock("config").await.unwrap_err().is_busy(),
            "{}: a writer beside readers",
            db.name
        );
        // A writer that waits gets the key once both readers are gone.
        let writer = {
            let locker = locker.clone();
            tokio::spawn(async move { locker.lock("config").wait(Duration::from_secs(10)).await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!writer.is_finished(), "{}", db.name);
        a.release().await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!writer.is_finished(), "{}: in beside a reader", db.name);
        let read_token = b.fencing_token();
        b.release().await.unwrap();
        let w = writer.await.unwrap().unwrap();
        assert!(w.fencing_token() > read_token, "{}", db.name);
        assert!(
            locker.read("config").await.unwrap_err().is_busy(),
            "{}: a reader beside the writer",
            db.name
        );
        let write_token = w.fencing_token();
        w.release().await.unwrap();
        let c = locker
            .read("config")
            .wait(Duration::from_secs(5))
            .await
            .unwrap();
        assert!(c.fencing_token() > write_token, "{}", db.name);
        c.release().await.unwrap();
        assert!(
            !locker.inspect("config").await.unwrap().unwrap().held,
            "{}",
            db.name
        );
    }
}

/// The readers' row is held under a marker, not an owner's id: `force_release_if_owner`
/// refuses the marker (it would free every reader at once) and leaves the readers be;
/// `force_release` frees the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readers_marker_is_no_owner_to_force_release() {
    let (dbs, _dir) = common::all("read_marker").await;
    for db in &dbs {
        let locker = &db.locker;
        let a = locker.read("report").await.unwrap();
        let _b = locker.read("report").await.unwrap();
        let info = locker.inspect("report").await.unwrap().unwrap();
        let marker = info.owner.clone().expect("a held read row shows its owner");
        let refused = locker
            .force_release_if_owner("report", &marker)
            .await
            .unwrap_err();
        assert!(
            matches!(&refused, LockError::Config(m) if m.contains("no owner id")),
            "{}: {refused:?}",
            db.name
        );
        let info = locker.inspect("report").await.unwrap().unwrap();
        assert!(info.held && info.hold_count == 2, "{}: {info:?}", db.name);
        assert!(locker.force_release("report").await.unwrap(), "{}", db.name);
        assert!(a.release().await.is_err(), "{}: freed", db.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_writer_is_not_starved_by_a_stream_of_readers() {
    let (dbs, _dir) = common::all("read_starvation").await;
    for db in &dbs {
        let stop = Arc::new(AtomicBool::new(false));
        let reads = Arc::new(AtomicUsize::new(0));
        // Four readers, each taking the key again as soon as it let go: some reader always
        // holds it, so a writer without its place in line would never get in.
        let readers: Vec<_> = (0..4)
            .map(|i| {
                let (locker, stop, reads) = (db.locker.clone(), stop.clone(), reads.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(15 * i)).await;
                    while !stop.load(Ordering::SeqCst) {
                        let r = locker
                            .read("feed")
                            .wait(Duration::from_secs(30))
                            .await
                            .unwrap();
                        reads.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(60)).await;
                        r.release().await.unwrap();
                    }
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let asked = std::time::Instant::now();
        let writer = db
            .locker
            .lock("feed")
            .wait(Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("{}: the writer starved: {e}", db.name));
        let waited = asked.elapsed();
        let before = reads.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            reads.load(Ordering::SeqCst),
            before,
            "{}: a reader got in beside the writer",
            db.name
        );
        writer.release().await.unwrap();
        stop.store(true, Ordering::SeqCst);
        for r in readers {
            r.await.unwrap();
        }
        println!(
            "{}: the writer waited {waited:?} behind the readers",
            db.name
        );
    }
}

/// A reader and a writer racing for a fresh key, many times over: never both. (Write skew: a
/// check of the other's rows that is not protected by a row lock would let both in.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_and_a_writer_racing_are_never_both_let_in() {
    let (dbs, _dir) = common::all("read_write_skew").await;
    for db in &dbs {
        let mut both = 0;
        let mut readers_won = 0;
        for round in 0..150 {
            let key = format!("race:{round}");
            let (l1, l2) = (db.locker.clone(), db.locker.clone());
            let (k1, k2) = (key.clone(), key.clone());
            let barrier = Arc::new(tokio::sync::Barrier::new(2));
            let (b1, b2) = (barrier.clone(), barrier.clone());
            let reader = tokio::spawn(async move {
                b1.wait().await;
                l1.read(k1).await
            });
            let writer = tokio::spawn(async move {
                b2.wait().await;
                l2.lock(k2).await
            });
            let (r, w) = (reader.await.unwrap(), writer.await.unwrap());
            if r.is_ok() && w.is_ok() {
                both += 1;
            }
            if r.is_ok() {
                readers_won += 1;
            }
            for g in [r, w].into_iter().flatten() {
                g.release().await.unwrap();
            }
        }
        assert_eq!(both, 0, "{}: reader and writer both let in", db.name);
        println!("{}: readers won {readers_won} of 150 races", db.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_and_writers_never_overlap_under_churn() {
    let (dbs, _dir) = common::all("read_churn").await;
    for db in &dbs {
        let readers = Arc::new(AtomicUsize::new(0));
        let writers = Arc::new(AtomicUsize::new(0));
        let (most_readers, bad) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let (locker, readers, writers, most, bad) = (
                    db.locker.clone(),
                    readers.clone(),
                    writers.clone(),
                    most_readers.clone(),
                    bad.clone(),
                );
                tokio::spawn(async move {
                    for n in 0..8 {
                        if (i + n) % 4 == 0 {
                            let w = locker
                                .lock("doc")
                                .wait(Duration::from_secs(60))
                                .await
                                .unwrap();
                            if writers.fetch_add(1, Ordering::SeqCst) > 0
                                || readers.load(Ordering::SeqCst) > 0
                            {
                                bad.fetch_add(1, Ordering::SeqCst);
                            }
                            tokio::time::sleep(Duration::from_millis(5)).await;
                            writers.fetch_sub(1, Ordering::SeqCst);
                            w.release().await.unwrap();
                        } else {
                            let r = locker
                                .read("doc")
                                .wait(Duration::from_secs(60))
                                .await
                                .unwrap();
                            let now = readers.fetch_add(1, Ordering::SeqCst) + 1;
                            most.fetch_max(now, Ordering::SeqCst);
                            if writers.load(Ordering::SeqCst) > 0 {
                                bad.fetch_add(1, Ordering::SeqCst);
                            }
                            tokio::time::sleep(Duration::from_millis(5)).await;
                            readers.fetch_sub(1, Ordering::SeqCst);
                            r.release().await.unwrap();
                        }
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(bad.load(Ordering::SeqCst), 0, "{}: overlap", db.name);
        assert!(
            most_readers.load(Ordering::SeqCst) >= 2,
            "{}: readers never shared the key",
            db.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_never_waits_for_itself_and_re_enters_past_a_waiting_writer() {
    let (dbs, _dir) = common::all("read_owner").await;
    for db in &dbs {
        let locker = &db.locker;
        let me = dblock::Owner::new();
        let r = locker.read("k").owner(&me).await.unwrap();
        // Upgrade: refused at once, not after the wait.
        let asked = std::time::Instant::now();
        match locker
            .lock("k")
            .owner(&me)
            .wait(Duration::from_secs(5))
            .await
        {
            Err(LockError::WouldWaitForItself { key }) => assert_eq!(key, "k"),
            other => panic!("{}: {other:?}", db.name),
        }
        assert!(asked.elapsed() < Duration::from_secs(2), "{}", db.name);
        // A writer waits (and records its intent); the reading owner reads again at once,
        // a new reader waits behind the writer.
        let writer = {
            let locker = locker.clone();
            tokio::spawn(async move { locker.lock("k").wait(Duration::from_secs(10)).await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        let info = locker.inspect("k").await.unwrap().unwrap();
        assert_eq!(
            info.kind,
            dblock::LockKind::Read {
                writer_waiting: true
            },
            "{}: the operator sees the waiting writer",
            db.name
        );
        let again = locker
            .read("k")
            .owner(&me)
            .await
            .expect("a re-entry is not held back by the writer's intent");
        assert_eq!(again.hold_count(), 2, "{}", db.name);
        assert!(
            locker.read("k").await.unwrap_err().is_busy(),
            "{}: a new reader went ahead of the waiting writer",
            db.name
        );
        again.release().await.unwrap();
        r.release().await.unwrap();
        let w = writer.await.unwrap().unwrap();
        // Downgrade: refused at once too.
        let writer_owner = w.owner().clone();
        match locker
            .read("k")
            .owner(&writer_owner)
            .wait(Duration::from_secs(5))
            .await
        {
            Err(LockError::WouldWaitForItself { .. }) => {}
            other => panic!("{}: {other:?}", db.name),
        }
        w.release().await.unwrap();
        assert_eq!(
            locker.inspect("k").await.unwrap().unwrap().kind,
            dblock::LockKind::Lock,
            "{}",
            db.name
        );
        // The intent of a writer that got the key holds nobody back afterwards.
        let after = locker.read("k").await.unwrap();
        after.release().await.unwrap();
    }
}

/// `shared = true`: readers of a config snapshot run together; the writer that replaces it
/// (`shared = false`, the lock) runs alone.
#[cfg(feature = "macros")]
mod attribute {
    use super::*;
    use dblock::Locker;

    pub struct Seen {
        pub readers: AtomicUsize,
        pub writers: AtomicUsize,
        pub most_readers: AtomicUsize,
        pub overlaps: AtomicUsize,
    }

    #[dblock::distributed_lock(key = "snapshot", shared = true, locker = locker, wait = "60s")]
    pub async fn read_snapshot(locker: &Locker, seen: &Seen) -> Result<(), LockError> {
        let now = seen.readers.fetch_add(1, Ordering::SeqCst) + 1;
        seen.most_readers.fetch_max(now, Ordering::SeqCst);
        if seen.writers.load(Ordering::SeqCst) > 0 {
            seen.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        assert_eq!(dblock::current().unwrap().key, "snapshot");
        tokio::time::sleep(Duration::from_millis(10)).await;
        seen.readers.fetch_sub(1, Ordering::SeqCst);
        Ok(())
    }

    #[dblock::distributed_lock(key = "snapshot", shared = false, locker = locker, wait = "60s")]
    pub async fn replace_snapshot(locker: &Locker, seen: &Seen) -> Result<(), LockError> {
        if seen.writers.fetch_add(1, Ordering::SeqCst) > 0
            || seen.readers.load(Ordering::SeqCst) > 0
        {
            seen.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        seen.writers.fetch_sub(1, Ordering::SeqCst);
        Ok(())
    }
}

#[cfg(feature = "macros")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_attribute_reads_together_and_writes_alone() {
    let (dbs, _dir) = common::all("read_attribute").await;
    for db in &dbs {
        let seen = Arc::new(attribute::Seen {
            readers: AtomicUsize::new(0),
            writers: AtomicUsize::new(0),
            most_readers: AtomicUsize::new(0),
            overlaps: AtomicUsize::new(0),
        });
        let tasks: Vec<_> = (0..6)
            .map(|i| {
                let (locker, seen) = (db.locker.clone(), seen.clone());
                tokio::spawn(async move {
                    for n in 0..5 {
                        if i == 0 && n % 2 == 0 {
                            attribute::replace_snapshot(&locker, &seen).await.unwrap();
                        } else {
                            attribute::read_snapshot(&locker, &seen).await.unwrap();
                        }
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(seen.overlaps.load(Ordering::SeqCst), 0, "{}", db.name);
        assert!(seen.most_readers.load(Ordering::SeqCst) >= 2, "{}", db.name);
    }
}

/// Runs only inside a child process (ignored in normal runs).
#[tokio::test]
#[ignore = "child process entry point, started by the other tests"]
async fn child_entry() {
    use std::io::Write;
    let (role, locker) = common::child_locker().await;
    assert_eq!(role, "reader");
    let r = locker
        .read("doomed")
        .ttl(Duration::from_millis(1500))
        .await
        .unwrap();
    println!("HELD {}", r.fencing_token());
    std::io::stdout().flush().unwrap();
    tokio::time::sleep(Duration::from_secs(120)).await;
    drop(r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_reader_keeps_the_writer_out_only_until_its_ttl() {
    let (dbs, _dir) = common::all("read_sigkill").await;
    for db in &dbs {
        let mut c = common::child_command(db, "reader")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let token: u64 = common::read_marker(&mut c, "HELD ").await.parse().unwrap();
        let held_at = std::time::Instant::now();
        c.kill().unwrap(); // SIGKILL: no release
        c.wait().unwrap();
        assert!(
            db.locker.lock("doomed").await.unwrap_err().is_busy(),
            "{}: the writer got in beside a live reader",
            db.name
        );
        // Another reader may still join the dead one's phase meanwhile.
        let w = db
            .locker
            .lock("doomed")
            .wait(Duration::from_secs(10))
            .await
            .expect("free after the reader's ttl");
        let after = held_at.elapsed();
        assert!(
            after < Duration::from_millis(1500 + 1000),
            "{}: took {after:?} after a 1.5 s ttl",
            db.name
        );
        assert!(w.fencing_token() > token, "{}", db.name);
        w.release().await.unwrap();
    }
}

/// A reader's `max_hold` counts from its own read, not from the start of the read phase it
/// joined: a reader that joins a phase two seconds old (its first reader renewed, a 1 s ttl),
/// renewed, with a cap of two seconds, holds past the phase's last lease after the first reader
/// left (its renewals were refused by the phase's cap, and the row's lease ran out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_readers_max_hold_counts_from_its_own_read() {
    let (dbs, _dir) = common::all("read_max_hold").await;
    for db in &dbs {
        let locker = &db.locker;
        let first = locker
            .read("capped")
            .ttl(Duration::from_secs(1))
            .await
            .unwrap()
            .auto_renew();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let late = locker
            .read("capped")
            .ttl(Duration::from_millis(600))
            .max_hold(Duration::from_secs(2))
            .await
            .unwrap()
            .auto_renew();
        let joined = std::time::Instant::now();
        first.release().await.unwrap();
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let row = locker.inspect("capped").await.unwrap().unwrap();
        assert!(
            row.held && !late.is_lost(),
            "{}: the late reader lost its hold {:?} after its read (ttl 600 ms, cap 2 s): {row:?}",
            db.name,
            joined.elapsed()
        );
        // Its own cap still ends it: renewal asks for nothing past two seconds from its read.
        let lost = tokio::time::timeout(Duration::from_secs(10), late.lost()).await;
        let after = joined.elapsed();
        assert!(
            lost.is_ok() && after >= Duration::from_millis(1500),
            "{}: the cap of 2 s ended the hold after {after:?} ({lost:?})",
            db.name
        );
    }
}

/// A writer that gives up withdraws its intent: a reader that comes after it is let in at once,
/// not held back for the rest of the intent's lease (2 s, renewed while the writer waited).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_that_gave_up_holds_no_reader_back() {
    let (dbs, _dir) = common::all("read_withdraw").await;
    for db in &dbs {
        let locker = &db.locker;
        let first = locker.read("report").await.unwrap();
        let writer = {
            let locker = locker.clone();
            tokio::spawn(
                async move { locker.lock("report").wait(Duration::from_millis(800)).await },
            )
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        let info = locker.inspect("report").await.unwrap().unwrap();
        assert_eq!(
            info.kind,
            dblock::LockKind::Read {
                writer_waiting: true
            },
            "{}: the waiting writer's intent is recorded",
            db.name
        );
        let e = writer.await.unwrap().unwrap_err();
        assert!(e.is_busy(), "{}: {e}", db.name);
        // Without the withdrawal the intent lives on for more than a second: this reader would
        // wait behind it and be told busy.
        let second = locker
            .read("report")
            .wait(Duration::from_secs(1))
            .await
            .unwrap_or_else(|e| panic!("{}: a reader behind a writer that gave up: {e}", db.name));
        assert_eq!(second.hold_count(), 2, "{}", db.name);
        second.release().await.unwrap();
        first.release().await.unwrap();
    }
}
