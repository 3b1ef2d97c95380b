// `reentrant` is an option of the lock and the semaphore: a read and a lock inside the body's
// transaction refuse it.
use dblock::distributed_lock;

#[distributed_lock(key = "config", shared = true, reentrant = false)]
async fn read() -> Result<(), dblock::LockError> {
    Ok(())
}

#[distributed_lock(key = "account:{id}", tx = tx, reentrant = false)]
async fn in_tx(id: u64, tx: &mut dblock::sqlx::SqliteConnection) -> Result<(), dblock::LockError> {
    let _ = (id, tx);
    Ok(())
}

fn main() {}
