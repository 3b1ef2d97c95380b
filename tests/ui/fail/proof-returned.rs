use dblock::{distributed_lock, Held, LockError};

// The proof cannot leave the locked body: it would outlive the lock.
#[distributed_lock(key = "k", proof = held)]
async fn leak() -> Result<Held<'static>, LockError> {
    Ok(held)
}

fn main() {
    drop(leak());
}
