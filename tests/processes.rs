//! Mutual exclusion across OS processes, and a holder killed with SIGKILL. The children are this
//! test binary itself, started with `DBLOCK_CHILD` set and told to run only `child_entry`.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dblock::Locker;

const CHILDREN: usize = 3;
/// The scheduled job's period and how many periods the scheduler test runs.
const PERIOD_MS: u64 = 1000;
const PERIODS: u64 = 5;

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}
const ITERATIONS: u64 = 15;

/// Runs only inside a child process (ignored in normal runs).
#[tokio::test]
#[ignore = "child process entry point, started by the other tests"]
async fn child_entry() {
    let (role, locker) = common::child_locker().await;
    match role.as_str() {
        "counter" => {
            let dir = std::env::var("DBLOCK_CHILD_DIR").unwrap();
            let (counter, log) = (
                Path::new(&dir).join("counter"),
                Path::new(&dir).join("tokens"),
            );
            for _ in 0..ITERATIONS {
                let g = locker
                    .lock("shared-counter")
                    .wait(Duration::from_secs(120))
                    .await
                    .unwrap();
                let n: u64 = std::fs::read_to_string(&counter)
                    .unwrap()
                    .trim()
                    .parse()
                    .unwrap();
                std::thread::sleep(Duration::from_millis(2)); // widen the race window
                std::fs::write(&counter, format!("{}\n", n + 1)).unwrap();
                let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
                writeln!(f, "{}", g.fencing_token()).unwrap();
                drop(f);
                g.release().await.unwrap();
            }
        }
        "attr-counter" => {
            let dir = std::env::var("DBLOCK_CHILD_DIR").unwrap();
            for _ in 0..ITERATIONS {
                bump(&locker, Path::new(&dir)).await.unwrap();
            }
        }
        "holder" => {
            let g = locker
                .lock("doomed")
                .ttl(Duration::from_millis(1500))
                .await
                .unwrap();
            println!("HELD {}", g.fencing_token());
            std::io::stdout().flush().unwrap();
            tokio::time::sleep(Duration::from_secs(120)).await;
            drop(g);
        }
        "scheduler" => {
            // A job every PERIOD on every process: try at each period boundary (wall clock, the
            // same for every process on this machine), with min_hold just under the period.
            let dir = std::env::var("DBLOCK_CHILD_DIR").unwrap();
            let log = Path::new(&dir).join("runs");
            let start = now_ms() / PERIOD_MS + 1;
            for period in start..start + PERIODS {
                let at = period * PERIOD_MS + fastrand::u64(0..20);
                tokio::time::sleep(Duration::from_millis(at.saturating_sub(now_ms()))).await;
                if let Ok(g) = locker
                    .lock("job")
                    .min_hold(Duration::from_millis(PERIOD_MS - 100))
                    .await
                {
                    let mut f = std::fs::OpenOptions::new()
                        .append(true)
                        .create(true)
                        .open(&log)
                        .unwrap();
                    // When the database granted it (its clock, as min_hold is measured): this
                    // process's own clock could read it late under load.
                    let info = locker.inspect("job").await.unwrap().unwrap();
                    let granted_ms = info
                        .acquired_at
                        .duration_since(std::time::UNIX_EPOCH)
                        .unwrap()
                        .as_millis();
                    f.write_all(format!("{} {granted_ms}\n", std::process::id()).as_bytes())
                        .unwrap();
                    g.release().await.unwrap(); // a short job: the key stays taken regardless
                }
            }
        }
        other => panic!("unknown role {other}"),
    }
}

/// The same read-modify-write as the "counter" role, protected by the attribute.
#[dblock::distributed_lock(key = "shared-counter", locker = locker, wait = "120s")]
async fn bump(locker: &Locker, dir: &Path) -> Result<(), dblock::LockError> {
    let (counter, log) = (dir.join("counter"), dir.join("tokens"));
    let n: u64 = std::fs::read_to_string(&counter)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2)).await; // widen the race window
    std::fs::write(&counter, format!("{}\n", n + 1)).unwrap();
    let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
    writeln!(f, "{}", dblock::current().unwrap().fencing_token).unwrap();
    Ok(())
}

fn child(db: &common::Db, role: &str, dir: &Path) -> Command {
    let mut cmd = common::child_command(db, role);
    cmd.env("DBLOCK_CHILD_DIR", dir);
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_share_a_counter_without_lost_updates() {
    shared_counter("counter").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_share_a_counter_through_the_attribute() {
    shared_counter("attr-counter").await;
}

async fn shared_counter(role: &str) {
    let (dbs, _dir) = common::all(&format!("procs_{}", role.replace('-', "_"))).await;
    for db in &dbs {
        let work = tempfile::tempdir().unwrap();
        std::fs::write(work.path().join("counter"), "0\n").unwrap();
        std::fs::write(work.path().join("tokens"), "").unwrap();
        let children: Vec<_> = (0..CHILDREN)
            .map(|_| {
                child(db, "counter", work.path())
                    .stdout(Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for mut c in children {
            let status = tokio::task::spawn_blocking(move || c.wait())
                .await
                .unwrap()
                .unwrap();
            assert!(status.success(), "{}: child failed: {status}", db.name);
        }
        let count: u64 = std::fs::read_to_string(work.path().join("counter"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert_eq!(
            count,
            CHILDREN as u64 * ITERATIONS,
            "{}: lost updates across processes",
            db.name
        );
        let tokens: Vec<u64> = std::fs::read_to_string(work.path().join("tokens"))
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        assert_eq!(tokens.len() as u64, count);
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "{}: tokens not strictly increasing: {tokens:?}",
            db.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_blocks_others_only_until_its_ttl_ends() {
    let (dbs, _dir) = common::all("sigkill").await;
    for db in &dbs {
        let work = tempfile::tempdir().unwrap();
        let mut c = child(db, "holder", work.path())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let line = common::read_marker(&mut c, "HELD ").await;
        let held_at = Instant::now();
        let dead_token: u64 = line.parse().unwrap();

        c.kill().unwrap(); // SIGKILL: no release, no destructor
        c.wait().unwrap();
        assert!(
            db.locker.lock("doomed").await.unwrap_err().is_busy(),
            "{}: free before its ttl",
            db.name
        );

        let g = db
            .locker
            .lock("doomed")
            .wait(Duration::from_secs(10))
            .await
            .expect("free after ttl");
        let after = held_at.elapsed();
        assert!(
            after < Duration::from_millis(1500 + 1000),
            "{}: took {after:?} after a 1.5 s ttl",
            db.name
        );
        assert!(g.fencing_token() > dead_token, "{}", db.name);
        g.release().await.unwrap();
    }
}

/// Three processes run a job every second, each trying at every period boundary with `min_hold`
/// just under the period: the job runs once a period, not three times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_hold_runs_a_scheduled_job_once_a_period_across_processes() {
    let (dbs, _dir) = common::all("procs_schedule").await;
    for db in &dbs {
        let work = tempfile::tempdir().unwrap();
        let children: Vec<_> = (0..CHILDREN)
            .map(|_| {
                child(db, "scheduler", work.path())
                    .stdout(Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for mut c in children {
            let status = tokio::task::spawn_blocking(move || c.wait())
                .await
                .unwrap()
                .unwrap();
            assert!(status.success(), "{}: scheduler failed: {status}", db.name);
        }
        let runs: Vec<u64> = std::fs::read_to_string(work.path().join("runs"))
            .unwrap_or_default()
            .lines()
            .map(|l| l.split_whitespace().nth(1).unwrap().parse().unwrap())
            .collect();
        // Once per period: as many runs as periods (give or take the edges), never two close.
        assert!(
            (PERIODS - 1..=PERIODS + 1).contains(&(runs.len() as u64)),
            "{}: {} runs in {PERIODS} periods on {CHILDREN} processes: {runs:?}",
            db.name,
            runs.len()
        );
        let mut sorted = runs.clone();
        sorted.sort();
        assert!(
            sorted.windows(2).all(|w| w[1] - w[0] >= PERIOD_MS - 150),
            "{}: two runs within one period: {sorted:?}",
            db.name
        );
    }
}
