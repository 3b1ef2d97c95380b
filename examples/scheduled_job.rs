//! A job every second on three workers (three lockers, as three instances of a service would
//! have), each trying at every tick: `min_hold` just under the period keeps the key taken after
//! the quick job ends, so the job runs once a second, not three times.
//!
//! Runs on SQLite with no server: `cargo run --example scheduled_job`.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dblock::{distributed_lock, LockError, Locker};

const WORKERS: u32 = 3;
const TICKS: u32 = 4;

/// The job: quick. `wait = "0s"`: a worker that finds it taken skips this tick.
#[distributed_lock(key = "nightly-report", locker = locker, wait = "0s", min_hold = "900ms")]
async fn report(locker: &Locker, worker: u32, runs: &AtomicU32) -> Result<(), LockError> {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    println!("run {n}: worker {worker} made the report");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let path = std::env::temp_dir().join("dblock-example-schedule.db");
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let runs = Arc::new(AtomicU32::new(0));
    let mut workers = Vec::new();
    for worker in 1..=WORKERS {
        let locker = Locker::connect(&url).await?; // one per "instance"
        locker.migrate().await?;
        let runs = runs.clone();
        workers.push(tokio::spawn(async move {
            let mut ticks = tokio::time::interval(Duration::from_secs(1));
            for _ in 0..TICKS {
                ticks.tick().await;
                match report(&locker, worker, &runs).await {
                    Ok(()) | Err(LockError::Busy { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        }));
    }
    for w in workers {
        w.await??;
    }
    let n = runs.load(Ordering::SeqCst);
    println!("\n{TICKS} ticks on {WORKERS} workers: the report ran {n} times");
    if n > TICKS {
        return Err(format!("ran {n} times in {TICKS} ticks").into());
    }
    Ok(())
}
