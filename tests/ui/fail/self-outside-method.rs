#[dblock::distributed_lock(key = "tenant:{self.tenant}")]
async fn settle(order_id: u64) -> Result<(), dblock::LockError> {
    let _ = order_id;
    Ok(())
}

fn main() {}
