#[dblock::distributed_lock(key = "k")]
struct Settlement {
    order_id: u64,
}

fn main() {
    let _ = Settlement { order_id: 1 }.order_id;
}
