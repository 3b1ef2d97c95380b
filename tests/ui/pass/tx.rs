//! `tx = ..`: the body's transaction (a `&mut Transaction`, a connection, an owned transaction)
//! takes the key; the body uses the parameter as written; a key list and a proof are allowed.
#![deny(warnings)]

use dblock::sqlx::{self, Sqlite, SqliteConnection, Transaction};
use dblock::{distributed_lock, LockError};

#[derive(Debug)]
struct AppError;
impl From<LockError> for AppError {
    fn from(_: LockError) -> Self {
        AppError
    }
}
impl From<sqlx::Error> for AppError {
    fn from(_: sqlx::Error) -> Self {
        AppError
    }
}

#[distributed_lock(key = "order:{id}", tx = tx, wait = "2s")]
async fn borrowed(tx: &mut Transaction<'_, Sqlite>, id: i64) -> Result<u64, AppError> {
    sqlx::query("SELECT ?").bind(id).execute(&mut **tx).await?;
    Ok(dblock::current().map_or(0, |l| l.fencing_token))
}

#[distributed_lock(key = ["acct:{from}", "acct:{to}"], tx = conn, proof = held)]
async fn connection(conn: &mut SqliteConnection, from: i64, to: i64) -> Result<(), AppError> {
    held.fence(&mut *conn).await?;
    let _ = (from, to);
    Ok(())
}

#[distributed_lock(key = "job", tx = tx)]
async fn owned(mut tx: Transaction<'static, Sqlite>) -> Result<(), AppError> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(())
}

fn main() {
    let _ = borrowed;
    let _ = connection;
    let _ = owned;
}
