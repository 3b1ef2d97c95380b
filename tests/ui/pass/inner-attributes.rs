//! Inner attributes at the top of a body stay inside the function and apply to the body.
#![deny(warnings)]

use dblock::{distributed_lock, LockError};

#[distributed_lock(key = "k:{x}")]
async fn allows_inside(x: u32) -> Result<u32, LockError> {
    #![allow(unused_variables)]
    let never_read = 1;
    Ok(x)
}

#[distributed_lock(key = "doc")]
async fn two_inner() -> Result<(), LockError> {
    #![allow(unused_mut)]
    #![allow(clippy::let_and_return)]
    let mut value = ();
    Ok(value)
}

fn main() {
    drop(allows_inside(1));
    drop(two_inner());
}
