#[dblock::distributed_lock(key = "k")]
async fn settle() -> u64 {
    7
}

fn main() {}
