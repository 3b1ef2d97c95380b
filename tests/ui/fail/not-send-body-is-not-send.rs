use std::rc::Rc;

#[dblock::distributed_lock(key = "k")]
async fn settle() -> Result<(), dblock::LockError> {
    let not_send = Rc::new(1);
    tokio::task::yield_now().await;
    let _ = not_send;
    Ok(())
}

fn assert_send<T: Send>(_: T) {}

fn main() {
    // The generated future is Send exactly when the body's is: here it is not.
    assert_send(settle());
}
