#[dblock::distributed_lock(key = "k", ttl = 30)]
async fn settle() -> Result<(), dblock::LockError> {
    Ok(())
}

fn main() {}
