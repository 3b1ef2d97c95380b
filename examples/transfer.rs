//! A transfer between two accounts: two locks taken together (`key = [...]`, in one canonical
//! order, so transfers both ways never deadlock) and a `fence` in the transaction, so the
//! money moves only while both leases are still ours — and stay ours until the commit.
//!
//! Eight tasks move money both ways between two accounts; the total never changes.
//! Runs on SQLite with no server: `cargo run --example transfer`.

use dblock::{distributed_lock, LockError, Locker};
use sqlx::SqlitePool;

#[derive(Debug, thiserror::Error)]
enum TransferError {
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

#[distributed_lock(key = ["acct:{from}", "acct:{to}"], ttl = "10s", wait = "10s")]
async fn transfer(db: &SqlitePool, from: i64, to: i64, cents: i64) -> Result<(), TransferError> {
    // SQLite: IMMEDIATE takes the database's write lock now. A DEFERRED transaction reads a
    // snapshot first and fails with SQLITE_BUSY at its first write if any other connection
    // (another worker's lock statement, say) wrote in between.
    let mut tx = db.begin_with("BEGIN IMMEDIATE").await?;
    let (balance,): (i64,) = sqlx::query_as("SELECT cents FROM accounts WHERE id = ?")
        .bind(from)
        .fetch_one(&mut *tx)
        .await?;
    if balance >= cents {
        sqlx::query("UPDATE accounts SET cents = cents - ? WHERE id = ?")
            .bind(cents)
            .bind(from)
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE accounts SET cents = cents + ? WHERE id = ?")
            .bind(cents)
            .bind(to)
            .execute(&mut *tx)
            .await?;
    }
    // Both leases still ours, live, and kept so until this transaction ends. Had either run
    // out (a long pause, say), this fails with `Lost` and the `?` rolls the transaction back.
    dblock::fence(&mut *tx).await?;
    tx.commit().await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    // The locks and the accounts in one database file: that is what makes `fence` possible.
    let path = std::env::temp_dir().join("dblock-example-transfer.db");
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let locker = Locker::connect(&url).await?;
    locker.migrate().await?;
    dblock::set_default(locker);

    let db = SqlitePool::connect(&url).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS accounts (id INTEGER PRIMARY KEY, cents INTEGER NOT NULL)",
    )
    .execute(&db)
    .await?;
    sqlx::query("INSERT OR REPLACE INTO accounts (id, cents) VALUES (1, 10000), (2, 10000)")
        .execute(&db)
        .await?;

    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..8i64 {
        let db = db.clone();
        tasks.spawn(async move {
            // Half the tasks move 1 -> 2, the other half 2 -> 1.
            let (from, to) = if i % 2 == 0 { (1, 2) } else { (2, 1) };
            for n in 0..10 {
                transfer(&db, from, to, 100 + i * 10 + n).await?;
            }
            Ok::<_, TransferError>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }

    let rows: Vec<(i64, i64)> = sqlx::query_as("SELECT id, cents FROM accounts ORDER BY id")
        .fetch_all(&db)
        .await?;
    let total: i64 = rows.iter().map(|(_, c)| c).sum();
    println!("80 transfers both ways, balances now {rows:?}, total {total}");
    if total != 20000 {
        return Err(format!("money was created or lost: total {total}").into());
    }
    println!("no deadlock, nothing lost");
    Ok(())
}
