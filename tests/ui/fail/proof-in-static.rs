use std::sync::Mutex;

use dblock::{distributed_lock, Held, LockError};

static LAST: Mutex<Option<Held<'static>>> = Mutex::new(None);

// A `static` outlives every lock: the proof cannot be stored there.
#[distributed_lock(key = "k", proof = held)]
async fn keep() -> Result<(), LockError> {
    *LAST.lock().unwrap() = Some(held);
    Ok(())
}

fn main() {
    drop(keep());
}
