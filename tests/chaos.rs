//! A chaos run and a history checker, on PostgreSQL and MariaDB: several worker processes (this
//! test binary, started with `DBLOCK_CHAOS` set) take and give back locks on a few keys, each
//! through a fault proxy of its own, while the parent cuts replies and sends, blackholes, delays
//! replies past the ttl, refuses connections, stops a holder (SIGSTOP) past its ttl and kills one
//! (SIGKILL). Every worker logs what it was told; the checker (`common/history.rs`, shared with
//! `tests/replicated.rs`) then proves from the logs and the table:
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
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use common::history::{self, check, parse, signal, Workload};
use common::proxy::{Mode, Proxy};
use dblock::Locker;

const WORKERS: usize = 4;
const KEYS: usize = 3;
const RUN: Duration = Duration::from_secs(14);
const TTL: Duration = Duration::from_secs(3);
/// Workers wait this long before they exit, so background releases and resolutions finish.
const LINGER: Duration = Duration::from_millis(5000);
const WORKLOAD: Workload = Workload {
    run: RUN,
    ttl: TTL,
    keys: KEYS,
    linger: LINGER,
};

/// The worker: runs only inside a child process (ignored in normal runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "chaos worker entry point, started by the chaos test"]
async fn chaos_worker() {
    history::worker(&WORKLOAD).await;
}

fn worker(url: &str, table: &str, log: &Path) -> Child {
    history::spawn_worker("chaos_worker", url, table, log)
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
    history::check_no_orphans(name, &history, observer).await;
    eprintln!(
        "chaos on {name}: {} holds checked, {counts:?}, faults {faults:?}",
        holds.len()
    );
}
