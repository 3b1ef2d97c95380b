#[dblock::distributed_lock(key = "k", wait = "-1s")]
async fn settle() -> Result<(), dblock::LockError> {
    Ok(())
}

fn main() {}
