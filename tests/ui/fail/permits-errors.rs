// `permits = N` takes one key and at least one permit, and has none of the lock-only options.
use dblock::distributed_lock;

#[distributed_lock(key = ["a", "b"], permits = 2)]
async fn list(id: u64) -> Result<(), dblock::LockError> {
    let _ = id;
    Ok(())
}

#[distributed_lock(key = "exports", permits = 0)]
async fn none() -> Result<(), dblock::LockError> {
    Ok(())
}

#[distributed_lock(key = "exports", permits = 3, once = true, min_hold = "1s")]
async fn lock_only() -> Result<(), dblock::LockError> {
    Ok(())
}

fn main() {}
