use dblock::{distributed_lock, LockError};

// A spawned task may outlive the lock: the proof cannot be moved into it.
#[distributed_lock(key = "k", proof = held)]
async fn spawn_with_proof() -> Result<(), LockError> {
    tokio::spawn(async move {
        println!("{}", held.fencing_token());
    });
    Ok(())
}

fn main() {
    drop(spawn_with_proof());
}
