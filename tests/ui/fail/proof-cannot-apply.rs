use dblock::{distributed_lock, LockError};

struct NotAMarker;

// The proof's name would hide a parameter.
#[distributed_lock(key = "k:{held}", proof = held)]
async fn shadows(held: u64) -> Result<(), LockError> {
    Ok(())
}

// Not a name.
#[distributed_lock(key = "k", proof = "held")]
async fn not_a_name() -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "k", proof = self)]
async fn not_self() -> Result<(), LockError> {
    Ok(())
}

// A marker that was not declared with `dblock::lock_kind!`.
#[distributed_lock(key = "k", proof = held: NotAMarker)]
async fn bad_marker() -> Result<(), LockError> {
    Ok(())
}

fn main() {}
