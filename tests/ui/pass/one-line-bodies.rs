//! One-line bodies compile without warnings: `{ Ok(x) }` must not become `{ { Ok(x) } }`, which
//! rustc flags as `unused_braces` (with a suggested fix that does not compile).
#![deny(warnings)]

use dblock::{distributed_lock, LockError};

#[distributed_lock(key = "k:{x}")]
async fn one_line(x: u32) -> Result<u32, LockError> { Ok(x) }

#[distributed_lock(key = "unit")]
async fn unit() -> Result<(), LockError> { Ok(()) }

#[distributed_lock(key = "early:{x}")]
async fn early_return(x: u32) -> Result<u32, LockError> { if x > 9 { return Ok(9); } Ok(x) }

fn main() {
    drop(one_line(1));
    drop(unit());
    drop(early_return(2));
}
