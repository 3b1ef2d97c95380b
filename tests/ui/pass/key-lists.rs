//! Several keys: templates and expressions mixed, a one-key list, a method with `self` fields.
#![deny(warnings)]

use dblock::{distributed_lock, LockError, Locker};

#[distributed_lock(key = ["acct:{from}", "acct:{to}"], wait = "5s")]
async fn transfer(from: u64, to: u64, cents: u64) -> Result<u64, LockError> {
    Ok(from + to + cents)
}

#[distributed_lock(key = [format!("user:{}", name.to_lowercase()), "audit"])]
async fn mixed(name: &str) -> Result<(), LockError> {
    let _ = name;
    Ok(())
}

#[distributed_lock(key = ["only"])]
async fn one() -> Result<(), LockError> {
    Ok(())
}

struct Ledger {
    locks: Locker,
    id: u32,
}

impl Ledger {
    #[distributed_lock(key = ["ledger:{self.id}", "acct:{acct}"], locker = self.locks, once = true)]
    async fn post(&self, acct: u32) -> Result<(), LockError> {
        let _ = acct;
        Ok(())
    }
}

fn assert_send<T: Send>(_: T) {}

async fn use_all(ledger: &Ledger) -> Result<(), LockError> {
    transfer(1, 2, 3).await?;
    mixed("A").await?;
    one().await?;
    ledger.post(1).await
}

/// Type-checks only: the futures are built, never polled.
fn check(ledger: &Ledger) {
    assert_send(transfer(1, 2, 3));
    assert_send(use_all(ledger));
}

fn main() {
    let _ = check;
}
