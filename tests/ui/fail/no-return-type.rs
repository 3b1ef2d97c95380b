#[dblock::distributed_lock(key = "k")]
async fn settle() {}

fn main() {}
