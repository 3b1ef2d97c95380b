// An argument list that does not parse is one error, at the place it stops parsing: no
// "missing `key`" beside it.
#[dblock::distributed_lock(key "order:{order_id}", ttl = "30s")]
async fn settle(order_id: u64) -> Result<(), dblock::LockError> {
    let _ = order_id;
    Ok(())
}

fn main() {}
