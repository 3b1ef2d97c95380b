#[dblock::distributed_lock(key = "order:{nope}", ttl = "5parsecs", colour = "blue", wait = "1s", wait = "2s")]
fn settle(order_id: u64) -> Result<(), dblock::LockError> {
    let _ = order_id;
    Ok(())
}

fn main() {}
