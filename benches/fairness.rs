//! Part 4 of the benchmark, **fairness**: 16 waiters in 4 processes (4 each) take turns on one
//! key, each holding it 5 ms, with and without `fair()`. Separate processes, because the waiters
//! of one process already get a key in arrival order (the process's line); across processes only
//! `fair()` orders them. Reported: hand-off (release → next owner's `lock()` returning, p50 and
//! p99) and each call's wait (`lock()` called → returned: p50, p99, max).
//!
//! The processes are this benchmark binary itself, started with `DBLOCK_BENCH_FAIR_CHILD` set:
//! [`child`] runs instead of the benchmark and prints one line per call, in wall-clock
//! microseconds (one machine, one clock).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dblock::{ConnectOptions, Locker};

const PROCESSES: usize = 4;
const WAITERS_PER_PROCESS: usize = 4;
const FAIR_HOLD: Duration = Duration::from_millis(5);

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

/// In a child process: `WAITERS_PER_PROCESS` tasks call `lock()` on the key in turn from the
/// start time until the end time; one `EV called acquired releasing` line per call.
pub async fn child() {
    let var = |n: &str| std::env::var(n).unwrap();
    let options = ConnectOptions::new().pooler(var("DBLOCK_BENCH_POOLER") == "1");
    let locker = Locker::connect_with(&var("DBLOCK_BENCH_URL"), options)
        .await
        .unwrap()
        .table(&var("DBLOCK_BENCH_TABLE"));
    let key = var("DBLOCK_BENCH_KEY");
    let fair = var("DBLOCK_BENCH_FAIR") == "1";
    let start: i64 = var("DBLOCK_BENCH_START").parse().unwrap();
    let end: i64 = var("DBLOCK_BENCH_END").parse().unwrap();
    // Warm the pool before the start.
    locker.inspect(&key).await.unwrap();
    tokio::time::sleep(Duration::from_micros((start - now_us()).max(0) as u64)).await;
    let tasks: Vec<_> = (0..WAITERS_PER_PROCESS)
        .map(|_| {
            let (locker, key) = (locker.clone(), key.clone());
            tokio::spawn(async move {
                let mut lines = Vec::new();
                while now_us() < end {
                    let called = now_us();
                    let request = locker.lock(&key).wait(Duration::from_secs(120));
                    let request = if fair { request.fair() } else { request };
                    let g = request.await.expect("fairness lock");
                    let acquired = now_us();
                    tokio::time::sleep(FAIR_HOLD).await;
                    let releasing = now_us();
                    g.release().await.expect("fairness release");
                    lines.push(format!("EV {called} {acquired} {releasing}"));
                }
                lines
            })
        })
        .collect();
    let mut out = String::new();
    for t in tasks {
        for l in t.await.unwrap() {
            out.push_str(&l);
            out.push('\n');
        }
    }
    print!("{out}");
}

/// The figures of one run.
struct Fairness {
    handoffs: Vec<i64>,
    waits: Vec<i64>,
}

fn pct(v: &mut [i64], p: f64) -> f64 {
    v.sort_unstable();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v.get(i).copied().unwrap_or_default() as f64 / 1000.0
}

async fn run(name: &str, url: &str, pooler: bool, table: &str, fair: bool, secs: f64) -> Fairness {
    let key = format!("fairness:{}", fastrand::u64(..));
    let start = now_us() + 1_500_000;
    let end = start + (secs * 1e6) as i64;
    let children: Vec<_> = (0..PROCESSES)
        .map(|_| {
            tokio::process::Command::new(std::env::current_exe().unwrap())
                .env("DBLOCK_BENCH_FAIR_CHILD", "1")
                .env("DBLOCK_BENCH_URL", url)
                .env("DBLOCK_BENCH_POOLER", if pooler { "1" } else { "0" })
                .env("DBLOCK_BENCH_TABLE", table)
                .env("DBLOCK_BENCH_KEY", &key)
                .env("DBLOCK_BENCH_FAIR", if fair { "1" } else { "0" })
                .env("DBLOCK_BENCH_START", start.to_string())
                .env("DBLOCK_BENCH_END", end.to_string())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("{name}: cannot start a waiter process: {e}"))
        })
        .collect();
    let mut calls: Vec<(i64, i64, i64)> = Vec::new();
    for c in children {
        let out = c.wait_with_output().await.unwrap();
        assert!(out.status.success(), "{name}: a waiter process failed");
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let f: Vec<i64> = line
                .strip_prefix("EV ")
                .map(|r| r.split(' ').filter_map(|x| x.parse().ok()).collect())
                .unwrap_or_default();
            if let [called, acquired, releasing] = f[..] {
                calls.push((called, acquired, releasing));
            }
        }
    }
    calls.sort_by_key(|c| c.1);
    let handoffs = calls.windows(2).map(|w| w[1].1 - w[0].2).collect();
    let waits = calls.iter().map(|c| c.1 - c.0).collect();
    Fairness { handoffs, waits }
}

/// Part 4: every backend in `targets` (name, URL, pooler mode, table), fair and not.
pub async fn fairness(targets: &[(&'static str, String, bool, String)], secs: f64) {
    println!();
    println!(
        "Fairness: {} waiters in {PROCESSES} processes take turns on one key, holding it {FAIR_HOLD:?};",
        PROCESSES * WAITERS_PER_PROCESS
    );
    println!("hand-off = release to the next owner's lock() returning; wait = lock() called to returned.");
    println!();
    println!("| backend | waiting | hand-offs | hand-off p50 | hand-off p99 | wait p50 | wait p99 | max wait |");
    println!("|---|---|---|---|---|---|---|---|");
    let secs = secs.max(3.0);
    for (name, url, pooler, table) in targets {
        for fair in [false, true] {
            let mut f = run(name, url, *pooler, table, fair, secs).await;
            let max = f.waits.iter().copied().max().unwrap_or_default() as f64 / 1000.0;
            println!(
                "| {name} | {} | {} | {:.1} ms | {:.1} ms | {:.0} ms | {:.0} ms | {max:.0} ms |",
                if fair { "fair()" } else { "default" },
                f.handoffs.len(),
                pct(&mut f.handoffs, 0.5),
                pct(&mut f.handoffs, 0.99),
                pct(&mut f.waits, 0.5),
                pct(&mut f.waits, 0.99),
            );
        }
    }
}
