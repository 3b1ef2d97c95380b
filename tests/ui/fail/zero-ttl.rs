#[dblock::distributed_lock(key = "k", ttl = "0s")]
async fn settle() -> Result<(), dblock::LockError> {
    Ok(())
}

fn main() {}
