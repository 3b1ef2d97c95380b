#[dblock::distributed_lock(key = "k")]
async extern "C" fn settle() -> Result<(), dblock::LockError> {
    Ok(())
}

fn main() {}
