#[dblock::distributed_lock(key = "k")]
fn settle() -> Result<(), dblock::LockError> {
    Ok(())
}

fn main() {}
