//! Readers of a configuration snapshot and the writer that replaces it: a shared (read) lock
//! (`shared = true`) and the exclusive lock of the same key. Readers run together; the writer
//! runs alone, and once it waits, readers that come after it wait behind it.
//!
//! Runs on SQLite with no server: `cargo run --example config_snapshot`.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dblock::{distributed_lock, LockError, Locker};

struct Snapshot {
    version: AtomicU32,
    readers: AtomicUsize,
}

#[distributed_lock(key = "config", shared = true, locker = locker, wait = "30s")]
async fn read_config(locker: &Locker, snapshot: &Snapshot, reader: u32) -> Result<u32, LockError> {
    let now = snapshot.readers.fetch_add(1, Ordering::SeqCst) + 1;
    let version = snapshot.version.load(Ordering::SeqCst);
    println!("reader {reader}: version {version} ({now} reading)");
    tokio::time::sleep(Duration::from_millis(40)).await;
    snapshot.readers.fetch_sub(1, Ordering::SeqCst);
    Ok(version)
}

#[distributed_lock(key = "config", locker = locker, wait = "30s")]
async fn replace_config(locker: &Locker, snapshot: &Snapshot) -> Result<(), LockError> {
    let readers = snapshot.readers.load(Ordering::SeqCst);
    let version = snapshot.version.fetch_add(1, Ordering::SeqCst) + 1;
    println!("writer: version {version} written with {readers} readers inside");
    if readers > 0 {
        return Err(LockError::Config("a reader beside the writer".into()));
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let path = std::env::temp_dir().join("dblock-example-config.db");
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let locker = Locker::connect(&url).await?;
    locker.migrate().await?;
    let snapshot = Arc::new(Snapshot {
        version: AtomicU32::new(1),
        readers: AtomicUsize::new(0),
    });
    let mut readers = Vec::new();
    for reader in 1..=6 {
        let (locker, snapshot) = (locker.clone(), snapshot.clone());
        readers.push(tokio::spawn(async move {
            for _ in 0..3 {
                read_config(&locker, &snapshot, reader).await?;
            }
            Ok::<_, LockError>(())
        }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    replace_config(&locker, &snapshot).await?;
    for r in readers {
        r.await??;
    }
    println!(
        "\nversion {} after 18 reads and one write",
        snapshot.version.load(Ordering::SeqCst)
    );
    Ok(())
}
