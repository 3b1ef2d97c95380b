//! A fixed number of lock cycles on one backend, for counting the client's instructions with
//! `valgrind --tool=callgrind` (repeatable whatever else the machine does; the server's work is
//! in another process and not counted):
//!
//! ```sh
//! cargo bench -p dblock-bench --bench profile --no-run
//! DBLOCK_PROFILE=dblock valgrind --tool=callgrind target/release/deps/profile-* postgres://postgres@127.0.0.1:5432/test
//! ```
//!
//! `DBLOCK_PROFILE`: `dblock` (the default), `dblock-off` (the same with `coalesce(false)`: what
//! coalescing costs a lone caller) or `ceiling` (the same statements, none of the client's
//! machinery). `DBLOCK_PROFILE_CYCLES` (default 2000) cycles after 200 of warm-up.
//!
//! `DBLOCK_PROFILE_OWNERS=64`: that many owners at once instead, each on keys of its own, every
//! owner doing `DBLOCK_PROFILE_CYCLES` cycles (coalesced, the default): a workload to watch the
//! whole machine with, server included (`perf record -a -g` while it runs). With
//! `DBLOCK_PROFILE=ceiling` the same owners' keys go as raw coalesced statements instead, in
//! `DBLOCK_PROFILE_SENDERS` (default 2) tasks' perfectly formed batches, as the benchmark's
//! "raw coalesced statements": what the statements cost without the library's machinery.
//! `DBLOCK_PROFILE_POOL=n`: the locker's pool size (its coalescing slots).
//! With owners, it also prints the mean time of a `lock()` and of a `release()` call (for the
//! raw statements, of a batch's acquire and release together): where a cycle's time goes
//! between the two lanes.

use std::time::Duration;

use dblock::Locker;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "sqlite::memory:".into());
    let cycles: usize = std::env::var("DBLOCK_PROFILE_CYCLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let which = std::env::var("DBLOCK_PROFILE").unwrap_or_else(|_| "dblock".into());
    let mut options = dblock::ConnectOptions::new().coalesce(which != "dblock-off");
    if let Some(n) = std::env::var("DBLOCK_PROFILE_POOL")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        options = options.max_connections(n);
    }
    let locker = Locker::connect_with(&url, options)
        .await
        .unwrap()
        .table("dblock_profile");
    locker.migrate().await.unwrap();
    let raw = dblock::test_util::statements(&locker);
    let owner = dblock::Owner::new().id().to_owned();
    let ttl = Duration::from_secs(30);
    let started = std::time::Instant::now();
    let owners: usize = std::env::var("DBLOCK_PROFILE_OWNERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    if owners > 0 && which == "ceiling" {
        // The same keys in flight in perfectly formed batches: each sender acquires its share
        // of the owners' next keys in one coalesced statement and releases them in another
        // (the benchmark's raw coalesced statements).
        let raw = std::sync::Arc::new(raw);
        let senders: usize = std::env::var("DBLOCK_PROFILE_SENDERS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(2);
        let per = owners / senders;
        let tasks: Vec<_> = (0..senders)
            .map(|t| {
                let raw = raw.clone();
                let owner = owner.clone();
                tokio::spawn(async move {
                    let mut took = Duration::ZERO;
                    for i in 0..cycles {
                        let mut keys: Vec<String> = (0..per)
                            .map(|o| format!("profile:{}:{}", t * per + o, i % 64))
                            .collect();
                        keys.sort_unstable();
                        let t0 = std::time::Instant::now();
                        raw.cycle_batch(&keys, &owner, ttl).await.unwrap();
                        took += t0.elapsed();
                    }
                    took
                })
            })
            .collect();
        let mut took = Duration::ZERO;
        for t in tasks {
            took += t.await.unwrap();
        }
        let n = senders * per * cycles;
        let secs = started.elapsed().as_secs_f64();
        eprintln!(
            "raw coalesced statements, {owners} owners' keys in batches of {per}: {n} cycles in \
             {secs:.2} s, {:.0}/s; a batch's acquire and release: {:.0} us",
            n as f64 / secs,
            took.as_secs_f64() * 1e6 / (senders * cycles) as f64,
        );
        return;
    }
    if owners > 0 {
        let tasks: Vec<_> = (0..owners)
            .map(|o| {
                let locker = locker.clone();
                tokio::spawn(async move {
                    let (mut locking, mut releasing) = (Duration::ZERO, Duration::ZERO);
                    for i in 0..cycles {
                        let key = format!("profile:{o}:{}", i % 64);
                        let t0 = std::time::Instant::now();
                        let g = locker.lock(key).ttl(ttl).await.unwrap();
                        let t1 = std::time::Instant::now();
                        g.release().await.unwrap();
                        locking += t1 - t0;
                        releasing += t1.elapsed();
                    }
                    (locking, releasing)
                })
            })
            .collect();
        let (mut locking, mut releasing) = (Duration::ZERO, Duration::ZERO);
        for t in tasks {
            let (l, r) = t.await.unwrap();
            locking += l;
            releasing += r;
        }
        let n = owners * cycles;
        let secs = started.elapsed().as_secs_f64();
        let (statements, rows) = dblock::test_util::coalesced(&locker);
        eprintln!(
            "{owners} owners: {n} cycles in {secs:.2} s, {:.0}/s; {statements} coalesced \
             statements of {:.1} rows, {} rows alone; a call's mean time: lock() {:.0} us, \
             release() {:.0} us",
            n as f64 / secs,
            rows as f64 / statements.max(1) as f64,
            (2 * n as u64).saturating_sub(rows),
            locking.as_secs_f64() * 1e6 / n as f64,
            releasing.as_secs_f64() * 1e6 / n as f64,
        );
        return;
    }
    for i in 0..cycles + 200 {
        let key = format!("profile:{}", i % 64);
        if which == "ceiling" {
            let token = raw.acquire(&key, &owner, ttl).await.unwrap().unwrap();
            assert!(raw.release(&key, &owner, token).await.unwrap());
        } else {
            let g = locker.lock(key).ttl(ttl).await.unwrap();
            g.release().await.unwrap();
        }
    }
    eprintln!(
        "{which}: {} cycles in {:?}",
        cycles + 200,
        started.elapsed()
    );
}
