// A return type that breaks the rule is reported in the same build as the attribute's own
// errors (here a missing key), not only once they are fixed.
#[dblock::distributed_lock(ttl = "1s")]
async fn settle(order_id: u64) -> u64 {
    order_id
}

fn main() {}
