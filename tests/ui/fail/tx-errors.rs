// `tx = ..` names a parameter of the function that is a transaction or a connection, and takes
// none of a lease's options.
use dblock::distributed_lock;
use dblock::sqlx::{Sqlite, Transaction};

#[distributed_lock(key = "order:{id}", tx = txn)]
async fn no_such_parameter(tx: &mut Transaction<'_, Sqlite>, id: u64) -> Result<(), dblock::LockError> {
    let _ = (tx, id);
    Ok(())
}

#[distributed_lock(key = "order:{id}", tx = tx, ttl = "10s", once = true)]
async fn lease_options(tx: &mut Transaction<'_, Sqlite>, id: u64) -> Result<(), dblock::LockError> {
    let _ = (tx, id);
    Ok(())
}

#[distributed_lock(key = "order:{id}", tx = tx, shared = true)]
async fn another_kind(tx: &mut Transaction<'_, Sqlite>, id: u64) -> Result<(), dblock::LockError> {
    let _ = (tx, id);
    Ok(())
}

#[distributed_lock(key = "order:{id}", tx = "tx")]
async fn not_a_name(tx: &mut Transaction<'_, Sqlite>, id: u64) -> Result<(), dblock::LockError> {
    let _ = (tx, id);
    Ok(())
}

#[distributed_lock(key = "order:{id}", tx = tx)]
async fn not_a_transaction(tx: &mut String, id: u64) -> Result<(), dblock::LockError> {
    let _ = (tx, id);
    Ok(())
}

fn main() {}
