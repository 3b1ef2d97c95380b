#[dblock::distributed_lock(key = "k", ttl = std::time::Duration::from_secs(30).as_secs())]
async fn settle() -> Result<(), dblock::LockError> {
    Ok(())
}

fn main() {}
