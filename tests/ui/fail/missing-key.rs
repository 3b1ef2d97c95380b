#[dblock::distributed_lock(ttl = "30s")]
async fn settle(order_id: u64) -> Result<(), dblock::LockError> {
    let _ = order_id;
    Ok(())
}

fn main() {}
