// A syntax error in the body is reported once, by rustc, where it is; the attribute adds no
// second error of its own.
#[dblock::distributed_lock(key = "k")]
pub async fn settle() -> Result<(), dblock::LockError> {
    let x = ;
    Ok(())
}

fn main() {}
