// A key list is checked key by key: an empty list, a list inside the list, an unknown name in
// one of the templates. Every error at once, each at its place.

#[dblock::distributed_lock(key = [])]
async fn empty() -> Result<(), dblock::LockError> {
    Ok(())
}

#[dblock::distributed_lock(key = ["a:{from}", ["b"]])]
async fn nested(from: u64) -> Result<(), dblock::LockError> {
    let _ = from;
    Ok(())
}

#[dblock::distributed_lock(key = ["acct:{from}", "acct:{too}"])]
async fn typo(from: u64, to: u64) -> Result<(), dblock::LockError> {
    let _ = (from, to);
    Ok(())
}

fn main() {}
