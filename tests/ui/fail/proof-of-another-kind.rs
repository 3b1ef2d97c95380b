use dblock::mode::Shared;
use dblock::{distributed_lock, Held, LockError};

dblock::lock_kind!(pub AccountLock);
dblock::lock_kind!(pub LedgerLock);

fn post(_held: Held<'_, AccountLock>) {}
fn write(_held: Held<'_>) {}

#[distributed_lock(key = "ledger", proof = held: LedgerLock)]
async fn wrong_lock() -> Result<(), LockError> {
    post(held); // a proof of the ledger's lock, where the account's is asked
    Ok(())
}

#[distributed_lock(key = "acct", shared = true, proof = held)]
async fn read_is_not_write() -> Result<(), LockError> {
    write(held); // a read's proof where an exclusive one is asked
    Ok(())
}

#[distributed_lock(key = "acct", shared = true, proof = held)]
async fn read_cannot_fence(tx: &mut dblock::sqlx::SqliteConnection) -> Result<(), LockError> {
    held.fence(&mut *tx).await // a read does not exclude: it cannot fence a write
}

fn untyped_to_typed(held: Held<'_>) {
    post(held); // an untyped proof does not become a typed one
}

fn shared_to_exclusive(held: Held<'_, AccountLock, Shared>) {
    post(held);
}

fn main() {
    drop(wrong_lock());
    drop(read_is_not_write());
}
