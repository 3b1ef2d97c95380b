#[dblock::distributed_lock(key = "order:{order_id}")]
async fn settle(order_id: u64) -> Result<String, dblock::LockError> {
    let _ = order_id;
    // Generated locals are invisible to the body.
    Ok(__dblock_key.clone())
}

fn main() {}
