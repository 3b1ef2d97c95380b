struct OrderId(u64);

#[dblock::distributed_lock(key = "order:{id}")]
async fn settle(id: OrderId) -> Result<u64, dblock::LockError> {
    Ok(id.0)
}

fn main() {}
