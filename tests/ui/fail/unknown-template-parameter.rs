#[dblock::distributed_lock(key = "order:{order}")]
async fn settle(order_id: u64, amount: u64) -> Result<(), dblock::LockError> {
    let _ = (order_id, amount);
    Ok(())
}

fn main() {}
