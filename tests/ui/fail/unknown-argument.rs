#[dblock::distributed_lock(key = "k", tll = "30s")]
async fn settle() -> Result<(), dblock::LockError> {
    Ok(())
}

fn main() {}
