//! Proofs of holding (`proof = held`): passed down two calls, typed proofs accepted where their
//! kind is asked, the untyped conversion, shared and permit proofs, and the future stays `Send`.
#![deny(warnings)]

use dblock::mode::{Permit, Shared};
use dblock::{distributed_lock, Held, LockError, Locker};

dblock::lock_kind!(
    /// The lock of one account.
    pub AccountLock
);
dblock::lock_kind!(LedgerLock);

mod ledger {
    use super::AccountLock;
    use dblock::Held;

    /// Two calls down: only callable with a proof.
    pub async fn post(held: Held<'_, AccountLock>, cents: i64) -> u64 {
        tokio::task::yield_now().await;
        audit(held.untyped(), cents)
    }

    pub fn audit(held: Held<'_>, cents: i64) -> u64 {
        held.fencing_token() + cents as u64 + held.locks().len() as u64
    }
}

#[distributed_lock(key = "acct:{id}", locker = locker, proof = held: AccountLock)]
async fn deposit(locker: &Locker, id: u64, cents: i64) -> Result<u64, LockError> {
    Ok(ledger::post(held, cents).await)
}

#[distributed_lock(key = ["acct:{from}", "acct:{to}"], locker = locker, proof = held: AccountLock)]
async fn transfer(locker: &Locker, from: u64, to: u64) -> Result<usize, LockError> {
    ledger::post(held, 1).await;
    // One proof for all the keys.
    Ok(held.locks().len())
}

#[distributed_lock(key = "report", locker = locker, proof = held)]
async fn untyped(locker: &Locker) -> Result<String, LockError> {
    let copy = held; // Copy
    let key = held.key().to_owned();
    let reader: Held<'_, dblock::AnyLock, Shared> = copy.shared();
    Ok(format!("{key}{}", reader.fencing_token()))
}

fn read_only(held: Held<'_, LedgerLock, Shared>) -> u64 {
    held.fencing_token()
}

#[distributed_lock(key = "ledger", locker = locker, shared = true, proof = held: LedgerLock)]
async fn report(locker: &Locker) -> Result<u64, LockError> {
    Ok(read_only(held))
}

#[distributed_lock(key = "pool", locker = locker, permits = 3, proof = slot)]
async fn with_permit(locker: &Locker) -> Result<u64, LockError> {
    let slot: Held<'_, dblock::AnyLock, Permit> = slot;
    Ok(slot.fencing_token())
}

/// The proof from a guard, borrowing it.
async fn from_guard(locker: &Locker) -> Result<u64, LockError> {
    let guard = locker.lock("acct:1").await?;
    let token = ledger::post(guard.held_as::<AccountLock>(), 0).await;
    let token = token + ledger::audit(guard.held(), 0);
    guard.release().await?;
    Ok(token)
}

fn assert_send<T: Send>(_: &T) {}

fn main() {
    let locker: Option<Locker> = None;
    if let Some(l) = locker {
        let fut = deposit(&l, 1, 5);
        assert_send(&fut);
        drop(fut);
        let fut = transfer(&l, 1, 2);
        assert_send(&fut);
        drop(fut);
        drop(untyped(&l));
        drop(report(&l));
        drop(with_permit(&l));
        let fut = from_guard(&l);
        assert_send(&fut);
    }
}
