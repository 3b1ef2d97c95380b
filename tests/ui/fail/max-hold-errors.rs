use dblock::{distributed_lock, LockError};

#[distributed_lock(key = "a", max_hold = "0s")]
async fn zero() -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "c", ttl = "1s", min_hold = "1m", max_hold = "30s")]
async fn shorter_than_min_hold() -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "d", max_hold = 10)]
async fn no_unit() -> Result<(), LockError> {
    Ok(())
}

fn main() {}
