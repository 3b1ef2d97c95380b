//! Part 5 of the benchmark, **other kinds of lock**, per backend, beside the plain lock's rows:
//! - semaphore: acquire+release cycles/s of permits of one semaphore of 4 permits, at 1 and 8
//!   owners (at 8, half of them wait at any moment), and the plain lock's cycles/s at the same
//!   owner counts on keys of their own (the ratio is the semaphore's cost: one read and the
//!   slot's acquire per permit, and waiting for a permit at 8);
//! - read: read+release cycles/s with 8 readers on one key (they share it);
//! - writer behind readers: 4 readers keep a key read-held (each holds 20 ms and comes back at
//!   once); a writer asks for it; the time until its `lock()` returns (its intent stops new
//!   readers; the readers already in drain);
//! - leader hand-over: an instance leads, another campaigns; the leader resigns; the time from
//!   `resign()` being called to the other's `campaign()` returning.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dblock::Locker;

const PERMITS: u32 = 4;
const TTL: Duration = Duration::from_secs(30);
const READERS: usize = 4;
const READ_HOLD: Duration = Duration::from_millis(20);
const SAMPLES: usize = 20;

/// Calls of `f` by `owners` tasks for `secs`: cycles/s, p50, p99.
async fn cycles<F, Fut>(owners: usize, secs: Duration, f: F) -> (f64, Duration, Duration)
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let f = Arc::new(f);
    let start = Instant::now();
    let tasks: Vec<_> = (0..owners)
        .map(|o| {
            let f = f.clone();
            tokio::spawn(async move {
                let mut lat = Vec::new();
                while start.elapsed() < secs {
                    let t = Instant::now();
                    f(o).await;
                    lat.push(t.elapsed());
                }
                lat
            })
        })
        .collect();
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await.unwrap());
    }
    let rate = lat.len() as f64 / start.elapsed().as_secs_f64();
    (rate, pct(&mut lat, 0.5), pct(&mut lat, 0.99))
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort_unstable();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v.get(i).copied().unwrap_or_default()
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

pub async fn kinds(lockers: &[(&'static str, Locker)], secs: f64) {
    let secs = Duration::from_secs_f64(secs.max(2.0));
    println!();
    println!("Other kinds of lock: cycles/s (p50, p99) beside the plain lock at the same owners;");
    println!(
        "writer behind {READERS} readers and leader hand-over: p50 and p99 of {SAMPLES} samples."
    );
    println!();
    println!("| backend | what | owners | cycles/s or samples | p50 | p99 | ratio to the lock |");
    println!("|---|---|---|---|---|---|---|");
    for (name, locker) in lockers {
        let run = fastrand::u32(..);
        for owners in [1, 8] {
            let l = locker.clone();
            let lock = cycles(owners, secs, move |o| {
                let l = l.clone();
                async move {
                    let g = l
                        .lock(format!("kinds:{run}:lock:{o}"))
                        .ttl(TTL)
                        .await
                        .unwrap();
                    g.release().await.unwrap();
                }
            })
            .await;
            println!(
                "| {name} | lock, a key each | {owners} | {:.0} | {} | {} | 1.00 |",
                lock.0,
                ms(lock.1),
                ms(lock.2)
            );
            let l = locker.clone();
            let sem = cycles(owners, secs, move |_| {
                let l = l.clone();
                async move {
                    let p = l
                        .semaphore(format!("kinds:{run}:sem"), PERMITS)
                        .ttl(TTL)
                        .wait(Duration::from_secs(60))
                        .await
                        .unwrap();
                    p.release().await.unwrap();
                }
            })
            .await;
            println!(
                "| {name} | semaphore, {PERMITS} permits | {owners} | {:.0} | {} | {} | {:.2} |",
                sem.0,
                ms(sem.1),
                ms(sem.2),
                sem.0 / lock.0
            );
            if owners == 8 {
                let l = locker.clone();
                let read = cycles(owners, secs, move |_| {
                    let l = l.clone();
                    async move {
                        let r = l
                            .read(format!("kinds:{run}:read"))
                            .ttl(TTL)
                            .wait(Duration::from_secs(60))
                            .await
                            .unwrap();
                        r.release().await.unwrap();
                    }
                })
                .await;
                println!(
                    "| {name} | read, one key | {owners} | {:.0} | {} | {} | {:.2} |",
                    read.0,
                    ms(read.1),
                    ms(read.2),
                    read.0 / lock.0
                );
            }
        }
        let mut behind = writer_behind_readers(locker, &format!("kinds:{run}:doc")).await;
        println!(
            "| {name} | writer behind {READERS} readers | 1 | {} | {} | {} | |",
            behind.len(),
            ms(pct(&mut behind, 0.5)),
            ms(pct(&mut behind, 0.99))
        );
        let mut handover = leader_handover(locker, &format!("kinds:{run}:leader")).await;
        println!(
            "| {name} | leader hand-over | 2 | {} | {} | {} | |",
            handover.len(),
            ms(pct(&mut handover, 0.5)),
            ms(pct(&mut handover, 0.99))
        );
    }
}

/// Readers keep `key` read-held; a writer asks `SAMPLES` times: how long each waited.
async fn writer_behind_readers(locker: &Locker, key: &str) -> Vec<Duration> {
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..READERS)
        .map(|i| {
            let (l, key, stop) = (locker.clone(), key.to_owned(), stop.clone());
            tokio::spawn(async move {
                tokio::time::sleep(READ_HOLD / READERS as u32 * i as u32).await;
                while !stop.load(Ordering::SeqCst) {
                    let r = l
                        .read(key.clone())
                        .wait(Duration::from_secs(60))
                        .await
                        .unwrap();
                    tokio::time::sleep(READ_HOLD).await;
                    r.release().await.unwrap();
                }
            })
        })
        .collect();
    let mut waited = Vec::new();
    tokio::time::sleep(Duration::from_millis(100)).await;
    for _ in 0..SAMPLES {
        let asked = Instant::now();
        let w = locker
            .lock(key)
            .wait(Duration::from_secs(60))
            .await
            .unwrap();
        waited.push(asked.elapsed());
        w.release().await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::SeqCst);
    for r in readers {
        r.await.unwrap();
    }
    waited
}

/// Two instances; the leader resigns while the other campaigns, `SAMPLES` times: resign() to
/// the other's campaign() returning.
async fn leader_handover(locker: &Locker, key: &str) -> Vec<Duration> {
    let mut took = Vec::new();
    let election = locker.leader(key).ttl(Duration::from_secs(10));
    let mut leading = election.campaign().await.unwrap();
    for _ in 0..SAMPLES {
        let next = {
            let election = election.clone();
            tokio::spawn(async move {
                let l = election.campaign().await.unwrap();
                (l, Instant::now())
            })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        let resigned = Instant::now();
        leading.resign().await.unwrap();
        let (l, led) = next.await.unwrap();
        took.push(led - resigned);
        leading = l;
    }
    leading.resign().await.unwrap();
    took
}
