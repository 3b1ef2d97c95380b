//! The generated future is `Send` when the body is, so locked calls can be spawned.
use dblock::{distributed_lock, LockError, Locker};

#[distributed_lock(key = "job:{id}", locker = locker, wait = "1s")]
async fn job(locker: &Locker, id: u64) -> Result<u64, LockError> {
    tokio::task::yield_now().await;
    Ok(id)
}

struct Svc {
    locks: Locker,
}

impl Svc {
    #[distributed_lock(key = "svc", locker = self.locks)]
    async fn run(&self) -> Result<(), LockError> {
        tokio::task::yield_now().await;
        Ok(())
    }
}

fn assert_send<T: Send>(_: &T) {}

fn main() {
    let locker: Option<Locker> = None;
    if let Some(l) = locker {
        let fut = job(&l, 1);
        assert_send(&fut);
        drop(fut);
        let svc = Svc { locks: l };
        let fut = svc.run();
        assert_send(&fut);
    }
}
