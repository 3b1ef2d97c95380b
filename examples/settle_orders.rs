//! Four workers race to settle the same ten orders. `#[distributed_lock]` makes each order settle
//! exactly once; each settlement records the fencing token it ran under.
//!
//! Runs on SQLite with no server: `cargo run --example settle_orders`.
//! Against a server: `DBLOCK_URL=postgres://… cargo run --all-features --example settle_orders`.

use std::time::Duration;

use dblock::{distributed_lock, LockError, Locker};
use sqlx::SqlitePool;

const WORKERS: u32 = 4;
const ORDERS: u32 = 10;

#[derive(Debug, thiserror::Error)]
enum SettleError {
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error(transparent)]
    Ledger(#[from] sqlx::Error),
}

/// Check-then-act on the ledger: safe only because no two callers run it at once for an order.
#[distributed_lock(key = "order:{order_id}", ttl = "30s", wait = "5s")]
async fn settle(
    ledger: &SqlitePool,
    order_id: u32,
    worker: u32,
) -> Result<Option<u64>, SettleError> {
    let done: i64 = sqlx::query_scalar("SELECT count(*) FROM settlements WHERE order_id = ?")
        .bind(order_id)
        .fetch_one(ledger)
        .await?;
    if done > 0 {
        return Ok(None); // someone settled it first
    }
    tokio::time::sleep(Duration::from_millis(5)).await; // the payment call
    let token = dblock::current().expect("inside the lock").fencing_token;
    sqlx::query("INSERT INTO settlements (order_id, worker, token) VALUES (?, ?, ?)")
        .bind(order_id)
        .bind(worker)
        .bind(i64::try_from(token).unwrap_or(i64::MAX))
        .execute(ledger)
        .await?;
    Ok(Some(token))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let tmp = std::env::temp_dir();
    let url = std::env::var("DBLOCK_URL").unwrap_or_else(|_| {
        format!(
            "sqlite://{}?mode=rwc",
            tmp.join("dblock-example-locks.db").display()
        )
    });
    let locker = Locker::connect(&url).await?;
    locker.migrate().await?;
    dblock::set_default(locker);

    // The table the lock protects, in a SQLite file of its own.
    let ledger = SqlitePool::connect(&format!(
        "sqlite://{}?mode=rwc",
        tmp.join("dblock-example-ledger.db").display()
    ))
    .await?;
    sqlx::raw_sql(
        "DROP TABLE IF EXISTS settlements;
         CREATE TABLE settlements (order_id INTEGER NOT NULL, worker INTEGER NOT NULL, token INTEGER NOT NULL);",
    )
    .execute(&ledger)
    .await?;

    let workers: Vec<_> = (1..=WORKERS)
        .map(|worker| {
            let ledger = ledger.clone();
            tokio::spawn(async move {
                for order_id in 1..=ORDERS {
                    match settle(&ledger, order_id, worker).await {
                        Ok(Some(token)) => println!(
                            "worker {worker} settled order {order_id:>2} (fencing token {token})"
                        ),
                        Ok(None) | Err(SettleError::Lock(LockError::Busy { .. })) => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(())
            })
        })
        .collect();
    for w in workers {
        w.await??;
    }

    let rows: Vec<(i64, i64, i64)> =
        sqlx::query_as("SELECT order_id, worker, token FROM settlements ORDER BY order_id")
            .fetch_all(&ledger)
            .await?;
    println!("\norder  settled by  fencing token");
    for (order, worker, token) in &rows {
        println!("{order:>5}  worker {worker:<4}  {token}");
    }
    let exactly_once =
        (1..=i64::from(ORDERS)).all(|o| rows.iter().filter(|r| r.0 == o).count() == 1);
    if !exactly_once {
        return Err(format!("DOUBLE OR MISSED SETTLEMENT: {rows:?}").into());
    }
    println!(
        "\n{ORDERS} orders, {} settlements: each order settled exactly once",
        rows.len()
    );
    Ok(())
}
