//! Expanded code raises no warning in a crate that denies warnings (clippy::pedantic is checked on
//! the examples by CI's clippy run).
#![deny(warnings, unused, rust_2018_idioms, missing_docs)]

//! Crate docs.

use dblock::{distributed_lock, LockError};

/// Settles an order.
///
/// # Errors
/// When the lock is busy.
#[distributed_lock(key = "order:{order_id}", ttl = "30s", wait = "0s")]
pub async fn settle(order_id: u64) -> Result<u64, LockError> {
    Ok(order_id)
}

fn main() {
    drop(settle(1));
}
