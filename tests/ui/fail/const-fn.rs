#[dblock::distributed_lock(key = "k")]
const fn settle() -> Result<(), dblock::LockError> {
    Ok(())
}

fn main() {}
