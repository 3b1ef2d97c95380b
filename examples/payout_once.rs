//! A payout that must happen once: `once = true` runs the body until it succeeds. The first
//! attempt fails (the provider is down), the retry succeeds, the third call is refused with
//! `AlreadyDone` without running the body. Each hold's outcome is in the lock row.
//!
//! Runs on SQLite with no server: `cargo run --example payout_once`.

use std::sync::atomic::{AtomicBool, Ordering};

use dblock::{distributed_lock, LockError, Locker};

#[derive(Debug, thiserror::Error)]
enum PayoutError {
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("payment provider unavailable")]
    ProviderDown,
}

static PROVIDER_UP: AtomicBool = AtomicBool::new(false);

#[distributed_lock(key = "payout:{invoice}", once = true, wait = "5s")]
async fn pay(invoice: u64, cents: u64) -> Result<(), PayoutError> {
    if !PROVIDER_UP.load(Ordering::SeqCst) {
        return Err(PayoutError::ProviderDown); // recorded as Failed: runnable again
    }
    println!("paid invoice {invoice}: {cents} cents");
    Ok(()) // recorded as Succeeded: never runs again for this invoice
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let path = std::env::temp_dir().join("dblock-example-payout.db");
    let locker = Locker::connect(&format!("sqlite://{}?mode=rwc", path.display())).await?;
    locker.migrate().await?;
    locker.reset("payout:1001").await?; // a fresh start for the example
    dblock::set_default(locker.clone());

    let first = pay(1001, 4200).await;
    println!("first attempt:  {first:?}");
    PROVIDER_UP.store(true, Ordering::SeqCst);
    let second = pay(1001, 4200).await;
    println!("second attempt: {second:?}");
    let third = pay(1001, 4200).await;
    println!("third attempt:  {third:?}");

    let info = locker.inspect("payout:1001").await?.expect("row");
    println!(
        "row: last outcome {:?}, finished at {:?}",
        info.last_outcome, info.finished_at
    );
    match (first, second, third) {
        (
            Err(PayoutError::ProviderDown),
            Ok(()),
            Err(PayoutError::Lock(LockError::AlreadyDone { .. })),
        ) => {
            println!("\npaid exactly once");
            Ok(())
        }
        other => Err(format!("unexpected: {other:?}").into()),
    }
}
