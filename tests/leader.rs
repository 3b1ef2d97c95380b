//! Leader election (`Locker::leader`) on every backend: hand-over on resignation, the leader
//! seen by `current` and `observe`, leadership that ends without being asked (an operator, a
//! shutdown), and three OS processes campaigning while one leader is killed, one is stopped past
//! its lease and one resigns: at most one leader acts at any instant.

mod common;

use std::collections::BTreeMap;
use std::future::poll_fn;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Stdio};
use std::time::Duration;

use dblock::{LockError, LockInfo, Observe};
use futures_core::Stream;

/// The processes' lease: short, so that a killed leader is replaced soon.
const TTL: Duration = Duration::from_millis(1000);
/// How often a leader acts (appends to the history).
const ACT_EVERY: Duration = Duration::from_millis(10);

fn now_us() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros()
}

fn append(log: &Path, line: String) {
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(log)
        .unwrap();
    f.write_all(format!("{line}\n").as_bytes()).unwrap();
}

/// Runs only inside a child process (ignored in normal runs).
#[tokio::test]
#[ignore = "child process entry point, started by the other tests"]
async fn child_entry() {
    let (role, locker) = common::child_locker().await;
    assert_eq!(role, "candidate");
    let dir = PathBuf::from(std::env::var("DBLOCK_CHILD_DIR").unwrap());
    let log = dir.join("history");
    let me = std::process::id();
    let election = locker
        .leader("election")
        .ttl(TTL)
        .holder(format!("pid-{me}"));
    loop {
        let leadership = election.campaign().await.unwrap();
        let term = leadership.fencing_token();
        append(&log, format!("lead {me} {term} {}", now_us()));
        let resign = dir.join(format!("resign-{me}"));
        loop {
            // The time of an act is taken before the check that allows it: a process stopped
            // between the two acts (if at all) at a time when it still led.
            let at = now_us();
            if leadership.is_lost() {
                append(&log, format!("lost {me} {term} {}", now_us()));
                break;
            }
            append(&log, format!("act {me} {term} {at}"));
            if resign.exists() {
                std::fs::remove_file(&resign).unwrap();
                append(&log, format!("resign {me} {term} {}", now_us()));
                leadership.resign().await.unwrap();
                // Let another candidate lead before campaigning again.
                tokio::time::sleep(TTL).await;
                break;
            }
            tokio::select! {
                _ = leadership.lost() => {
                    append(&log, format!("lost {me} {term} {}", now_us()));
                    break;
                }
                () = tokio::time::sleep(ACT_EVERY) => {}
            }
        }
    }
}

/// One line of the processes' history.
#[derive(Debug, Clone)]
struct Event {
    what: String,
    pid: u32,
    term: u64,
    at_us: u128,
}

fn history(log: &Path) -> Vec<Event> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            Some(Event {
                what: f.next()?.to_owned(),
                pid: f.next()?.parse().ok()?,
                term: f.next()?.parse().ok()?,
                at_us: f.next()?.parse().ok()?,
            })
        })
        .collect()
}

/// Waits for a `lead` line of a term above `after`; the new leader's pid, term and time.
async fn next_leader(log: &Path, after: u64, limit: Duration) -> (u32, u64, u128) {
    let start = std::time::Instant::now();
    loop {
        if let Some(e) = history(log)
            .into_iter()
            .find(|e| e.what == "lead" && e.term > after)
        {
            return (e.pid, e.term, e.at_us);
        }
        assert!(
            start.elapsed() < limit,
            "no new leader after term {after} within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn signal(pid: u32, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_never_have_two_leaders_through_kill_stop_and_resignation() {
    let (dbs, _dir) = common::all("leader_processes").await;
    for db in &dbs {
        let work = tempfile::tempdir().unwrap();
        let log = work.path().join("history");
        let mut children: BTreeMap<u32, Child> = (0..3)
            .map(|_| {
                let c = common::child_command(db, "candidate")
                    .env("DBLOCK_CHILD_DIR", work.path())
                    .stdout(Stdio::null())
                    .spawn()
                    .unwrap();
                (c.id(), c)
            })
            .collect();
        let limit = Duration::from_secs(15);

        // 1. The first leader is killed (SIGKILL): the next one leads once its lease ends.
        let (first, term1, _) = next_leader(&log, 0, limit).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut dead = children.remove(&first).unwrap();
        dead.kill().unwrap();
        let killed_at = now_us();
        dead.wait().unwrap();
        let (second, term2, led2) = next_leader(&log, term1, limit).await;
        let after_kill = Duration::from_micros((led2 - killed_at) as u64);

        // 2. The second is stopped (SIGSTOP) past its lease: the third leads meanwhile; the
        //    stopped one, resumed, finds its leadership lost before it acts again.
        tokio::time::sleep(Duration::from_millis(200)).await;
        signal(second, "-STOP");
        let stopped_at = now_us();
        let (third, term3, led3) = next_leader(&log, term2, limit).await;
        let after_stop = Duration::from_micros((led3 - stopped_at) as u64);
        tokio::time::sleep(TTL).await;
        signal(second, "-CONT");
        tokio::time::sleep(Duration::from_millis(300)).await;

        // 3. The third resigns: the second (back in the campaign) takes over at once.
        std::fs::File::create(work.path().join(format!("resign-{third}"))).unwrap();
        let (fourth, _term4, led4) = next_leader(&log, term3, limit).await;
        let resigned_at = history(&log)
            .into_iter()
            .find(|e| e.what == "resign" && e.term == term3)
            .expect("a resign line")
            .at_us;
        let after_resign = Duration::from_micros((led4 - resigned_at) as u64);
        tokio::time::sleep(Duration::from_millis(300)).await;
        for (_, mut c) in children {
            let _ = c.kill();
            let _ = c.wait();
        }

        // The history: every term's acts lie in one interval, and the intervals of the terms,
        // in term order, never overlap.
        let events = history(&log);
        let mut terms: BTreeMap<u64, (u32, u128, u128)> = BTreeMap::new();
        for e in events.iter().filter(|e| e.what == "act") {
            let t = terms.entry(e.term).or_insert((e.pid, e.at_us, e.at_us));
            assert_eq!(
                t.0, e.pid,
                "{}: term {} acted on by two processes",
                db.name, e.term
            );
            t.1 = t.1.min(e.at_us);
            t.2 = t.2.max(e.at_us);
        }
        let spans: Vec<_> = terms.iter().collect();
        for pair in spans.windows(2) {
            let ((t1, (p1, _, last1)), (t2, (p2, first2, _))) = (pair[0], pair[1]);
            assert!(
                last1 < first2,
                "{}: term {t1} (pid {p1}) acted until {last1} µs, after term {t2} (pid {p2}) \
                 began acting at {first2} µs",
                db.name
            );
        }
        assert!(terms.len() >= 4, "{}: terms {:?}", db.name, terms.keys());
        assert!(
            events
                .iter()
                .any(|e| e.what == "lost" && e.pid == second && e.term == term2),
            "{}: the stopped leader never saw its leadership lost",
            db.name
        );
        assert_ne!(fourth, third, "{}", db.name);
        println!(
            "{}: new leader {after_kill:?} after a SIGKILL, {after_stop:?} after a SIGSTOP \
             (ttl {TTL:?}), {after_resign:?} after a resignation",
            db.name
        );
    }
}

async fn next(changes: &mut Observe) -> Result<Option<LockInfo>, LockError> {
    tokio::time::timeout(
        Duration::from_secs(5),
        poll_fn(|cx| Pin::new(&mut *changes).poll_next(cx)),
    )
    .await
    .expect("an observed change within 5 s")
    .expect("the stream goes on")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resignation_hands_over_and_observers_see_every_leader() {
    let (dbs, _dir) = common::all("leader_handover").await;
    for db in &dbs {
        let election = db.locker.leader("scheduler").ttl(Duration::from_secs(5));
        let mut changes = election.observe();
        assert!(next(&mut changes).await.unwrap().is_none(), "{}", db.name);
        assert!(election.current().await.unwrap().is_none(), "{}", db.name);

        let a = election.clone().holder("node-a").campaign().await.unwrap();
        let seen = next(&mut changes).await.unwrap().expect("a leader");
        assert!(
            seen.holder.as_deref().unwrap().ends_with("node-a"),
            "{}",
            db.name
        );
        assert_eq!(seen.fencing_token, a.fencing_token(), "{}", db.name);
        let current = election.current().await.unwrap().unwrap();
        assert_eq!(current.fencing_token, a.fencing_token(), "{}", db.name);

        // B waits while A leads; A's resignation hands over at once.
        let b_election = election.clone().holder("node-b");
        let b = tokio::spawn(async move { b_election.campaign().await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!b.is_finished(), "{}: two leaders", db.name);
        let a_lost = tokio::spawn(a.lost());
        let term_a = a.fencing_token();
        let resigned = std::time::Instant::now();
        a.resign().await.unwrap();
        let b = b.await.unwrap().unwrap();
        let hand_over = resigned.elapsed();
        assert!(a_lost.await.unwrap().is_lost(), "{}", db.name);
        assert!(b.fencing_token() > term_a, "{}", db.name);
        assert!(
            hand_over < Duration::from_secs(2),
            "{}: hand-over took {hand_over:?}",
            db.name
        );
        let mut seen = next(&mut changes).await.unwrap();
        if seen.is_none() {
            seen = next(&mut changes).await.unwrap(); // the moment between the two
        }
        assert!(
            seen.unwrap().holder.unwrap().ends_with("node-b"),
            "{}",
            db.name
        );

        // Dropping the leadership resigns it too.
        drop(b);
        assert!(next(&mut changes).await.unwrap().is_none(), "{}", db.name);
        println!("{}: hand-over after resign {hand_over:?}", db.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leadership_ends_when_an_operator_takes_the_key_or_the_locker_shuts_down() {
    let (dbs, _dir) = common::all("leader_ends").await;
    for db in &dbs {
        let election = db.locker.leader("taken").ttl(Duration::from_millis(900));
        let leadership = election.campaign().await.unwrap();
        assert!(!leadership.is_lost(), "{}", db.name);
        // Renewal keeps it past several ttls.
        tokio::time::sleep(Duration::from_millis(2000)).await;
        assert!(!leadership.is_lost(), "{}: not renewed", db.name);
        assert!(
            db.locker.force_release("taken").await.unwrap(),
            "{}",
            db.name
        );
        let lost = tokio::time::timeout(Duration::from_secs(2), leadership.lost())
            .await
            .unwrap_or_else(|_| panic!("{}: renewal never saw the key taken", db.name));
        assert!(lost.is_lost(), "{}", db.name);
        assert!(leadership.is_lost(), "{}", db.name);
        assert!(leadership.resign().await.is_err(), "{}", db.name);

        // Two campaigns in one process exclude each other, even inside one owner scope.
        let locker = common::connect(db).await.table(db.locker.table_name());
        let owner = dblock::Owner::new();
        let first = owner.scope(locker.leader("solo").campaign()).await.unwrap();
        let second = tokio::time::timeout(
            Duration::from_millis(500),
            owner.scope(locker.leader("solo").campaign()),
        )
        .await;
        assert!(second.is_err(), "{}: a second campaign led too", db.name);

        // Shutdown ends the leadership, then refuses campaigns.
        let lost = first.lost();
        locker.shutdown().await;
        assert!(lost.await.is_lost(), "{}", db.name);
        assert!(matches!(
            locker.leader("solo").campaign().await,
            Err(LockError::ShutDown)
        ));
        assert!(
            election.current().await.unwrap().is_none(),
            "{}: the key stays held after shutdown",
            db.name
        );
        assert!(
            db.locker.leader("solo").current().await.unwrap().is_none(),
            "{}: shutdown left the leadership held",
            db.name
        );
    }
}
