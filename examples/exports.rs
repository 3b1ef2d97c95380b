//! At most three exports at once across every instance of a service: a counting semaphore
//! (`permits = 3`). Eight tasks on two lockers (two "instances") each ask to export; the example
//! counts how many run at once and checks it never passes three.
//!
//! Runs on SQLite with no server: `cargo run --example exports`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dblock::{distributed_lock, LockError, Locker};

const PERMITS: usize = 3;

/// One export; `wait = "30s"`: queue for a permit rather than give up.
#[distributed_lock(key = "exports", permits = 3, locker = locker, wait = "30s")]
async fn export(locker: &Locker, job: usize, running: &AtomicUsize) -> Result<(), LockError> {
    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
    let permit = dblock::current().expect("inside the locked body");
    println!(
        "export {job}: running with {now} of {PERMITS} permits in use (token {})",
        permit.fencing_token
    );
    tokio::time::sleep(Duration::from_millis(100)).await; // the export
    running.fetch_sub(1, Ordering::SeqCst);
    if now > PERMITS {
        return Err(LockError::Config(format!("{now} exports at once")));
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let path = std::env::temp_dir().join("dblock-example-exports.db");
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let running = Arc::new(AtomicUsize::new(0));
    let mut jobs = Vec::new();
    for instance in 0..2 {
        let locker = Locker::connect(&url).await?;
        locker.migrate().await?;
        for n in 0..4 {
            let (locker, running) = (locker.clone(), running.clone());
            jobs.push(tokio::spawn(async move {
                export(&locker, instance * 4 + n, &running).await
            }));
        }
    }
    for job in jobs {
        job.await??;
    }
    println!("\n8 exports, never more than {PERMITS} at once");
    Ok(())
}
