//! Four workers race to settle the same ten orders. The lock makes each order settle exactly
//! once; each settlement records the fencing token it ran under.
//!
//! Runs on SQLite with no server: `cargo run --example settle_orders`.
//! Point it at a server with `DBLOCK_URL=postgres://… cargo run --all-features --example settle_orders`.

use std::time::Duration;

use dblock::{LockError, Locker};
use sqlx::AssertSqlSafe;

const WORKERS: usize = 4;
const ORDERS: u32 = 10;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let default_url = format!(
        "sqlite://{}?mode=rwc",
        std::env::temp_dir()
            .join("dblock-settle-orders.db")
            .display()
    );
    let url = std::env::var("DBLOCK_URL").unwrap_or(default_url);
    let locker = Locker::connect(&url).await?;
    locker.migrate().await?;

    // The "business" table the lock protects, in a SQLite file next to the locks.
    let db = sqlx::SqlitePool::connect(&format!(
        "sqlite://{}?mode=rwc",
        std::env::temp_dir()
            .join("dblock-settle-orders-ledger.db")
            .display()
    ))
    .await?;
    sqlx::raw_sql(
        "DROP TABLE IF EXISTS settlements;
         CREATE TABLE settlements (order_id INTEGER NOT NULL, worker INTEGER NOT NULL, token INTEGER NOT NULL);",
    )
    .execute(&db)
    .await?;

    let workers: Vec<_> = (0..WORKERS)
        .map(|worker| {
            let (locker, db) = (locker.clone(), db.clone());
            tokio::spawn(async move { work(worker, locker, db).await })
        })
        .collect();
    for w in workers {
        w.await??;
    }

    let rows: Vec<(i64, i64, i64)> = sqlx::query_as(AssertSqlSafe(
        "SELECT order_id, worker, token FROM settlements ORDER BY order_id",
    ))
    .fetch_all(&db)
    .await?;
    println!("\norder  settled by  fencing token");
    for (order, worker, token) in &rows {
        println!("{order:>5}  worker {worker:<4}  {token}");
    }
    let once = (1..=i64::from(ORDERS)).all(|o| rows.iter().filter(|r| r.0 == o).count() == 1);
    println!(
        "\n{} orders, {} settlements: {}",
        ORDERS,
        rows.len(),
        if once {
            "each order settled exactly once"
        } else {
            "DOUBLE SETTLEMENT"
        }
    );
    if !once {
        std::process::exit(1);
    }
    Ok(())
}

/// Every worker tries every order; whoever gets the lock first settles it, the rest see it done.
async fn work(worker: usize, locker: Locker, db: sqlx::SqlitePool) -> Result<(), LockError> {
    for order in 1..=ORDERS {
        let guard = match locker
            .lock(format!("order:{order}"))
            .ttl(Duration::from_secs(30))
            .wait(Duration::from_secs(5))
            .await
        {
            Ok(guard) => guard,
            Err(LockError::Busy { .. }) => continue,
            Err(e) => return Err(e),
        };
        // Inside the lock: check, then act. Without the lock, two workers could both see
        // "not settled" here.
        let done: i64 = sqlx::query_scalar("SELECT count(*) FROM settlements WHERE order_id = ?")
            .bind(order)
            .fetch_one(&db)
            .await?;
        if done == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await; // the "payment call"
            sqlx::query("INSERT INTO settlements (order_id, worker, token) VALUES (?, ?, ?)")
                .bind(order)
                .bind(worker as i64)
                .bind(guard.fencing_token() as i64)
                .execute(&db)
                .await?;
            println!(
                "worker {worker} settled order {order:>2} (fencing token {})",
                guard.fencing_token()
            );
        }
        guard.release().await?;
    }
    Ok(())
}
