// An inner attribute at the top of a body applies to the body: `#![deny(..)]` there turns the
// unused variable into an error inside the function.
#[dblock::distributed_lock(key = "k")]
async fn settle() -> Result<(), dblock::LockError> {
    #![deny(unused_variables)]
    let never_read = 1;
    Ok(())
}

fn main() {}
