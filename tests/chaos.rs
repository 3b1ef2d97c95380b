//! A chaos run and a history checker, on PostgreSQL and MariaDB: several worker processes (this
//! test binary, started with `DBLOCK_CHAOS` set) take and give back locks on a few keys, each
//! through a fault proxy of its own, while the parent cuts replies and sends, blackholes, delays
//! replies past the ttl, refuses connections, stops a holder (SIGSTOP) past its ttl and kills one
//! (SIGKILL). Every worker logs what it was told; the checker then proves from the logs and the
//! table:
//! - every grant `lock()` returned was live (`is_lost()` false);
//! - no two owners ever certainly held one key at once (a hold is certain from the moment `lock()`
//!   returned until the worker started to release it, or, if the guard then said it could be
//!   lost, until its lease ended);
//! - fencing tokens increase in the order the holds began;
//! - no hold was counted twice (every grant of a non-nesting worker has `hold_count` 1);
//! - no hold was orphaned: after the survivors exit gracefully, no row is held by any of them;
//! - no untyped error: a worker that meets one fails, and so does the run.

#![cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(unused))]

mod common;

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::proxy::{Mode, Proxy};
use dblock::{ConnectOptions, LockError, Locker, Owner};

const WORKERS: usize = 4;
const KEYS: usize = 3;
const RUN: Duration = Duration::from_secs(14);
const TTL: Duration = Duration::from_secs(3);
/// Workers wait this long before they exit, so background releases and resolutions finish.
const LINGER: Duration = Duration::from_millis(5000);

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

fn us(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_micros() as i64
}

/// The worker: runs only inside a child process (ignored in normal runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "chaos worker entry point, started by the chaos test"]
async fn chaos_worker() {
    let url = std::env::var("DBLOCK_CHAOS_URL").expect("DBLOCK_CHAOS_URL");
    let table = std::env::var("DBLOCK_CHAOS_TABLE").unwrap();
    let log_path = std::env::var("DBLOCK_CHAOS_LOG").unwrap();
    // A statement may take longer than the ttl (as a commit waiting for a stalled synchronous
    // standby can): grants can then arrive after their lease could have ended.
    let options = ConnectOptions::new()
        .statement_timeout(Duration::from_secs(4))
        .acquire_timeout(Duration::from_secs(1));
    let locker = loop {
        match Locker::connect_with(&url, options.clone()).await {
            Ok(l) => break l.table(&table),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .unwrap();
    let pid = std::process::id();
    // One write per line: the workers append to one file, and an O_APPEND write of a short
    // line is not interleaved with another process's.
    let mut line = |text: String| {
        log.write_all(format!("{pid} {text}\n").as_bytes()).unwrap();
    };
    let until = Instant::now() + RUN;
    while Instant::now() < until {
        let key = format!("key{}", fastrand::usize(..KEYS));
        let owner = Owner::new();
        line(format!("TRY {key} {owner}"));
        match locker
            .lock(&key)
            .owner(&owner)
            .ttl(TTL)
            .wait(Duration::from_secs(5))
            .await
        {
            Ok(g) => {
                let lost_at_return = g.is_lost();
                line(format!(
                    "GOT {key} {} {} {} {} {}",
                    g.fencing_token(),
                    g.hold_count(),
                    now_us(),
                    us(g.expires_at()),
                    u8::from(lost_at_return),
                ));
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..40))).await;
                // Stopped past its ttl, the worker knows its lease may be gone: is_lost().
                line(format!(
                    "END {key} {} {} {}",
                    g.fencing_token(),
                    now_us(),
                    u8::from(g.is_lost())
                ));
                let token = g.fencing_token();
                let outcome = match g.release().await {
                    Ok(()) => "ok".to_owned(),
                    Err(LockError::NotHeld { .. }) => "notheld".to_owned(),
                    Err(e) if e.is_outcome_unknown() => "unknown".to_owned(),
                    Err(LockError::Database(e)) => {
                        format!("db:{}", e.to_string().replace(' ', "_"))
                    }
                    Err(e) => panic!("untyped release error: {e:?}"),
                };
                line(format!("REL {key} {token} {outcome}"));
            }
            Err(LockError::Busy { .. }) => line("ERR busy".into()),
            Err(LockError::Lost { .. }) => line("ERR lost".into()),
            Err(e) if e.is_outcome_unknown() => line("ERR unknown".into()),
            Err(LockError::Database(_)) => line("ERR db".into()),
            Err(e) => panic!("untyped lock error: {e:?}"),
        }
    }
    // A graceful exit: background releases and resolutions get to finish.
    tokio::time::sleep(LINGER).await;
    line("EXIT".into());
}

#[derive(Debug, Clone)]
struct Hold {
    pid: u32,
    key: String,
    token: u64,
    hold_count: u32,
    start: i64,
    lease_end: i64,
    /// `lock()` returned a guard that was already lost (its lease could have ended).
    lost_at_return: bool,
    end: Option<i64>,
    /// When the worker started to release it, the guard said it could be lost (the worker was
    /// stopped past its ttl).
    lost_at_end: bool,
}

impl Hold {
    /// Until when the hold was certain: until the worker started to release it; if by then the
    /// guard said it could be lost, only until the lease ended; if it never got to release it
    /// (killed), until the lease ended.
    fn certain_until(&self) -> i64 {
        match self.end {
            Some(end) if !self.lost_at_end => end,
            Some(end) => end.min(self.lease_end),
            None => self.lease_end,
        }
    }
}

fn parse(log: &str) -> (Vec<Hold>, HashMap<&str, usize>) {
    let mut holds: Vec<Hold> = Vec::new();
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for l in log.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = l.split_whitespace().collect();
        let pid: u32 = f[0].parse().unwrap();
        *counts.entry(f[1]).or_default() += 1;
        match f[1] {
            "GOT" => holds.push(Hold {
                pid,
                key: f[2].into(),
                token: f[3].parse().unwrap(),
                hold_count: f[4].parse().unwrap(),
                start: f[5].parse().unwrap(),
                lease_end: f[6].parse().unwrap(),
                lost_at_return: f[7] == "1",
                end: None,
                lost_at_end: false,
            }),
            "END" => {
                let (key, token): (&str, u64) = (f[2], f[3].parse().unwrap());
                let h = holds
                    .iter_mut()
                    .rev()
                    .find(|h| h.pid == pid && h.key == key && h.token == token)
                    .expect("END without GOT");
                h.end = Some(f[4].parse().unwrap());
                h.lost_at_end = f[5] == "1";
            }
            "REL" => *counts.entry(f[4]).or_default() += 1,
            "TRY" | "EXIT" => {}
            "ERR" => *counts.entry(f[2]).or_default() += 1,
            _ => {}
        }
    }
    (holds, counts)
}

/// The checker: what must hold of every history.
fn check(name: &str, holds: &[Hold]) {
    assert!(
        holds.len() > 50,
        "{name}: only {} holds: too few to say anything",
        holds.len()
    );
    for h in holds {
        assert_eq!(h.hold_count, 1, "{name}: a hold counted twice: {h:?}");
        assert!(
            !h.lost_at_return,
            "{name}: a grant was returned dead: {h:?}"
        );
    }
    let mut by_key: HashMap<&str, Vec<&Hold>> = HashMap::new();
    for h in holds {
        by_key.entry(&h.key).or_default().push(h);
    }
    for (key, mut hs) in by_key {
        hs.sort_by_key(|h| h.start);
        // Fencing order: tokens increase in the order the holds began.
        for w in hs.windows(2) {
            assert!(
                w[1].token > w[0].token,
                "{name}: fencing tokens out of order on {key}:\n  {:?}\n  {:?}",
                w[0],
                w[1]
            );
        }
        // No overlap: each hold begins after every earlier hold stopped being certain.
        let mut latest: Option<&Hold> = None;
        for h in &hs {
            if let Some(prev) = latest {
                assert!(
                    h.start >= prev.certain_until(),
                    "{name}: overlapping holds of {key}:\n  {prev:?}\n  {h:?}"
                );
            }
            if latest.is_none_or(|p| h.certain_until() > p.certain_until()) {
                latest = Some(h);
            }
        }
    }
}

fn worker(url: &str, table: &str, log: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "chaos_worker",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("DBLOCK_CHAOS_URL", url)
        .env("DBLOCK_CHAOS_TABLE", table)
        .env("DBLOCK_CHAOS_LOG", log)
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

fn signal(child: &Child, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {sig}");
}

#[cfg(not(any(feature = "postgres", feature = "mysql")))]
#[test]
#[ignore = "the chaos run needs `--features postgres` and/or `--features mysql` (or --all-features)"]
fn chaos_needs_a_server_backend() {}

#[cfg(any(feature = "postgres", feature = "mysql"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_run_keeps_every_promise() {
    #[allow(unused_mut)]
    let mut servers: Vec<(&str, String, Option<common::Db>)> = Vec::new();
    #[cfg(feature = "postgres")]
    servers.push((
        "postgres",
        common::postgres_url(),
        common::postgres("chaos").await,
    ));
    #[cfg(feature = "mysql")]
    servers.push(("mariadb", common::mysql_url(), common::mysql("chaos").await));
    for (name, direct, db) in servers {
        let Some(db) = db else { continue };
        run(name, &direct, &db.locker).await;
    }
}

async fn run(name: &str, direct: &str, observer: &Locker) {
    let host = common::host_of(direct);
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("history");
    let table = observer.table_name().to_owned();
    let mut proxies = Vec::new();
    let mut children = Vec::new();
    for _ in 0..WORKERS {
        let proxy = Proxy::start(&host).await;
        children.push(worker(&proxy.url(direct), &table, &log));
        proxies.push(proxy);
    }
    let started = Instant::now();
    let mut rng = fastrand::Rng::with_seed(7);
    let mut faults: HashMap<&str, usize> = HashMap::new();
    let killed = 0; // the worker that gets SIGKILL, half-way
    let mut step = 0;
    while started.elapsed() < RUN - Duration::from_secs(2) {
        step += 1;
        // Every fault in turn, each on a live worker (not the killed one once it is dead).
        let w = if step > 6 {
            1 + step % (WORKERS - 1)
        } else {
            step % WORKERS
        };
        let (what, mode, hold) = match step % 5 {
            0 => ("lost replies + reset", Mode::HoldReplies, 300),
            1 => (
                "replies later than the ttl",
                Mode::DelayReplies(TTL + Duration::from_millis(500)),
                2000,
            ),
            2 => ("lost sends", Mode::DropSends, 400),
            3 => ("blackhole", Mode::Blackhole, 1500),
            _ => ("refused + reset", Mode::Refuse, 800),
        };
        *faults.entry(what).or_default() += 1;
        proxies[w].set(mode);
        tokio::time::sleep(Duration::from_millis(hold)).await;
        if matches!(mode, Mode::HoldReplies | Mode::Refuse) {
            proxies[w].reset_all();
        }
        proxies[w].set(Mode::Pass);
        if step == 3 {
            // A holder stopped past its ttl, then resumed.
            let s = 1 + rng.usize(..WORKERS - 1);
            signal(&children[s], "-STOP");
            tokio::time::sleep(TTL + Duration::from_millis(700)).await;
            signal(&children[s], "-CONT");
            *faults.entry("SIGSTOP past the ttl").or_default() += 1;
        }
        if step == 6 {
            signal(&children[killed], "-KILL");
            *faults.entry("SIGKILL").or_default() += 1;
        }
        tokio::time::sleep(Duration::from_millis(rng.u64(100..300))).await;
    }
    for (i, mut c) in children.into_iter().enumerate() {
        let status = tokio::task::spawn_blocking(move || c.wait())
            .await
            .unwrap()
            .unwrap();
        if i != killed {
            assert!(status.success(), "{name}: worker {i} failed: {status}");
        }
    }
    let history = std::fs::read_to_string(&log).unwrap();
    let (holds, counts) = parse(&history);
    check(name, &holds);
    // No orphan: whatever a survivor took, it gave back (or its resolution did) before it exited.
    let killed_pids: Vec<u32> = history
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .filter(|pid| !history.contains(&format!("{pid} EXIT")))
        .collect();
    // Every owner a worker used (also for calls that failed) → that worker.
    let owners: HashMap<&str, u32> = history
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(1) == Some(&"TRY")).then(|| (f[3], f[0].parse().unwrap()))
        })
        .collect();
    for info in observer.held().await.unwrap() {
        let pid = info.owner.as_deref().and_then(|o| owners.get(o));
        assert!(
            pid.is_some_and(|p| killed_pids.contains(p)),
            "{name}: a hold not of the killed worker outlived the run: {info:?} (worker {pid:?})"
        );
    }
    eprintln!(
        "chaos on {name}: {} holds checked, {counts:?}, faults {faults:?}",
        holds.len()
    );
}
