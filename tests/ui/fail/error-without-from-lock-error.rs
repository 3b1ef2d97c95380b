/// An application error that cannot be built from a `dblock::LockError`.
#[derive(Debug)]
pub struct AppError;

#[dblock::distributed_lock(key = "k")]
async fn settle() -> Result<(), AppError> {
    Ok(())
}

fn main() {}
