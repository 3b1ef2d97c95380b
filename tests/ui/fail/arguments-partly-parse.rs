// An argument that does not parse is reported, and so is every error of the others: an
// unknown bare word, a bad duration, a duplicate of the refused argument, a name without its
// value, a missing comma.
#[dblock::distributed_lock(key = "k", nowait, ttl = "5x", ttl = "1s", renew, wait = "1s" fair = true)]
async fn settle() -> Result<(), dblock::LockError> {
    Ok(())
}

fn main() {}
