// `shared = true`: a shared (read) hold; `shared = false` is the lock.
#[dblock::distributed_lock(key = "config:{region}", shared = true, ttl = "10s", wait = "5s")]
async fn read_config(region: &str) -> Result<u64, dblock::LockError> {
    let _ = region;
    Ok(dblock::current().map_or(0, |h| h.fencing_token))
}

#[dblock::distributed_lock(key = "config:{region}", shared = false, wait = "5s")]
async fn write_config(region: &str) -> Result<(), dblock::LockError> {
    let _ = region;
    Ok(())
}

fn main() {
    let _ = read_config("eu");
    let _ = write_config("eu");
}
