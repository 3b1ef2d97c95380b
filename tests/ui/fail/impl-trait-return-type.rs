// A return type with `impl Trait` in it is checked on the type the body infers; the error still
// points at the declared type.
use std::fmt::Display;

#[dblock::distributed_lock(key = "k")]
async fn report() -> Result<impl Display, String> {
    Ok(1)
}

fn main() {}
