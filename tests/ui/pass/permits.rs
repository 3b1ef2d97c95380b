// `permits = N`: a permit of a counting semaphore, as a literal or any `u32` expression.
use std::time::Duration;

const EXPORTS: u32 = 3;

#[dblock::distributed_lock(key = "exports:{region}", permits = 3, ttl = "1m", wait = "30s")]
async fn export(region: &str) -> Result<(), dblock::LockError> {
    let _ = region;
    Ok(())
}

#[dblock::distributed_lock(key = "exports", permits = EXPORTS, ttl = Duration::from_secs(5), renew = false)]
async fn export_all() -> Result<u64, dblock::LockError> {
    Ok(dblock::current().map_or(0, |h| h.fencing_token))
}

fn main() {
    let _ = export("eu");
    let _ = export_all();
}
