#[dblock::distributed_lock(key = "k", ttl = "30x")]
async fn settle() -> Result<(), dblock::LockError> {
    Ok(())
}

fn main() {}
