#[dblock::distributed_lock(key = "k")]
async fn settle() -> Result<(), String> {
    Ok(())
}

fn main() {}
