//! A chaos run's history and its checker, shared by `tests/chaos.rs` and `tests/replicated.rs`.
//!
//! Worker processes (the test binary itself, started on an ignored entry-point test) take and give
//! back locks on a few keys and log every step, one line each, to one shared file: that file is the
//! history. The checker then proves from it:
//! - every grant `lock()` returned was live (`is_lost()` false);
//! - no two owners ever certainly held one key at once (a hold is certain from the moment `lock()`
//!   returned until the worker started to release it, or, if the guard then said it could be
//!   lost, until its lease ended);
//! - fencing tokens increase in the order the holds began;
//! - no hold was counted twice (every grant of a non-nesting worker has `hold_count` 1);
//! - no hold was orphaned: after the survivors exit gracefully, no row is held by any of them
//!   (`check_no_orphans`);
//! - no untyped error: a worker that meets one fails (the parent asserts each exit status).

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dblock::{ConnectOptions, LockError, Locker, Owner};

/// What each worker does: lock a random one of `keys` keys for `ttl`, hold it 0–40 ms, release,
/// for `run`; then wait `linger` so background releases and resolutions finish before it exits.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    pub run: Duration,
    pub ttl: Duration,
    pub keys: usize,
    pub linger: Duration,
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

fn us(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_micros() as i64
}

/// The worker's loop, inside a child process started by [`spawn_worker`]: reads its URL, table
/// and log file from the environment, logs its history, and returns its locker after a graceful
/// exit (the line `EXIT`), for checks of its own. Panics on an untyped error.
pub async fn worker(workload: &Workload) -> Locker {
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
    let until = Instant::now() + workload.run;
    while Instant::now() < until {
        let key = format!("key{}", fastrand::usize(..workload.keys));
        let owner = Owner::new();
        line(format!("TRY {key} {owner}"));
        match locker
            .lock(&key)
            .owner(&owner)
            .ttl(workload.ttl)
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
            Err(LockError::Database(e)) => {
                line(format!("ERR db {}", e.to_string().replace(' ', "_")))
            }
            Err(e) => panic!("untyped lock error: {e:?}"),
        }
    }
    // A graceful exit: background releases and resolutions get to finish.
    tokio::time::sleep(workload.linger).await;
    line("EXIT".into());
    locker
}

/// Starts a worker: this test binary, running only the ignored test `entry` (which calls
/// [`worker`]), on `url`, appending its history to `log`.
pub fn spawn_worker(entry: &str, url: &str, table: &str, log: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            entry,
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

/// Sends `sig` (`-STOP`, `-CONT`, `-KILL`) to a worker.
pub fn signal(child: &Child, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {sig}");
}

#[derive(Debug, Clone)]
pub struct Hold {
    pub pid: u32,
    pub key: String,
    pub token: u64,
    pub hold_count: u32,
    pub start: i64,
    pub lease_end: i64,
    /// `lock()` returned a guard that was already lost (its lease could have ended).
    pub lost_at_return: bool,
    pub end: Option<i64>,
    /// When the worker started to release it, the guard said it could be lost (the worker was
    /// stopped past its ttl).
    pub lost_at_end: bool,
}

impl Hold {
    /// Until when the hold was certain: until the worker started to release it; if by then the
    /// guard said it could be lost, only until the lease ended; if it never got to release it
    /// (killed), until the lease ended.
    pub fn certain_until(&self) -> i64 {
        match self.end {
            Some(end) if !self.lost_at_end => end,
            Some(end) => end.min(self.lease_end),
            None => self.lease_end,
        }
    }
}

/// The holds of a history, and how often each kind of line, error and release outcome occurred.
pub fn parse(log: &str) -> (Vec<Hold>, HashMap<&str, usize>) {
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
pub fn check(name: &str, holds: &[Hold]) {
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

/// No orphan: whatever a worker that exited gracefully took, it gave back (or its resolution
/// did) before it exited. Only the rows of killed workers (no `EXIT` line) may still be held,
/// as `observer` (a locker on the workers' table) sees them now.
pub async fn check_no_orphans(name: &str, history: &str, observer: &Locker) {
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
}

/// How the calls of a history ended, kept apart: `lock()` errors by kind (`busy`, `lost`,
/// `unknown`, `db: <the error>`) and release outcomes (`ok`, `notheld`, `unknown`, `db:<the error>`).
#[derive(Debug, Default)]
pub struct Tally {
    pub grants: usize,
    pub lock_errors: std::collections::BTreeMap<String, usize>,
    pub releases: std::collections::BTreeMap<String, usize>,
}

pub fn tally(log: &str) -> Tally {
    let mut t = Tally::default();
    for l in log.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        match f.get(1) {
            Some(&"GOT") => t.grants += 1,
            Some(&"ERR") => *t.lock_errors.entry(f[2..].join(": ")).or_default() += 1,
            Some(&"REL") => *t.releases.entry(f[4].to_owned()).or_default() += 1,
            _ => {}
        }
    }
    t
}
