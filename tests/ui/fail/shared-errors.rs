// `shared = true` takes one key, a literal `true`/`false`, and none of the options of the
// exclusive lock or of a semaphore.
use dblock::distributed_lock;

const READS: bool = true;

#[distributed_lock(key = ["a", "b"], shared = true)]
async fn list() -> Result<(), dblock::LockError> {
    Ok(())
}

#[distributed_lock(key = "config", shared = READS)]
async fn not_a_literal() -> Result<(), dblock::LockError> {
    Ok(())
}

#[distributed_lock(key = "config", shared = true, once = true, permits = 2)]
async fn with_lock_options() -> Result<(), dblock::LockError> {
    Ok(())
}

fn main() {}
