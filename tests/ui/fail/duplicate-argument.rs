#[dblock::distributed_lock(key = "k", ttl = "30s", ttl = "10s")]
async fn settle() -> Result<(), dblock::LockError> {
    Ok(())
}

fn main() {}
