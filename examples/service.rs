//! A service struct that carries its own `Locker` (`locker = self.locks`) and calls locked methods
//! from locked methods: the nested calls share the owner, so re-entry on the same key succeeds at
//! once and the row's `hold_count` shows it.
//!
//! `cargo run --example service` (`SQLite` in memory, no server).
#![deny(warnings, clippy::pedantic)]

use std::time::Duration;

use dblock::{distributed_lock, LockError, Locker};

struct Accounts {
    locks: Locker,
    bank: String,
}

impl Accounts {
    /// Moves money between two accounts, locking both in a fixed order (no deadlock).
    #[distributed_lock(key = "{self.bank}:account:{first}", locker = self.locks, wait = "2s")]
    async fn transfer(&self, first: u32, second: u32, cents: u64) -> Result<(), LockError> {
        self.debit(first, cents).await?; // same key as ours: reentrant, hold_count 2
        self.credit(second, cents).await // another key, same owner
    }

    #[distributed_lock(key = "{self.bank}:account:{account}", locker = self.locks, wait = "2s")]
    async fn debit(&self, account: u32, cents: u64) -> Result<(), LockError> {
        let held = dblock::current().expect("inside a locked body");
        let row = self.locks.inspect(&held.key).await?.expect("row");
        println!(
            "debit  {account}: {cents:>5} cents  (key {}, token {}, hold_count in the row {})",
            held.key, held.fencing_token, row.hold_count
        );
        Ok(())
    }

    #[distributed_lock(key = "{self.bank}:account:{account}", locker = self.locks, wait = "2s", ttl = "10s")]
    async fn credit(&self, account: u32, cents: u64) -> Result<(), LockError> {
        let held = dblock::current().expect("inside a locked body");
        println!(
            "credit {account}: {cents:>5} cents  (key {}, token {})",
            held.key, held.fencing_token
        );
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), LockError> {
    let locks = Locker::connect("sqlite::memory:").await?;
    locks.migrate().await?;
    let accounts = Accounts {
        locks: locks.clone(),
        bank: "acme".into(),
    };

    accounts.transfer(1, 2, 2_500).await?;

    // While someone else holds account 2, a transfer into it waits, then gives up.
    let blocker = locks
        .lock("acme:account:2")
        .ttl(Duration::from_secs(30))
        .await?;
    match accounts.transfer(1, 2, 100).await {
        Err(LockError::Busy { key, waited }) => println!("{key} busy, gave up after {waited:?}"),
        other => println!("unexpected: {other:?}"),
    }
    blocker.release().await?;
    println!(
        "held now: {:?}",
        locks
            .held()
            .await?
            .iter()
            .map(|l| &l.key)
            .collect::<Vec<_>>()
    );
    Ok(())
}
