//! Shared set-up for the integration tests: one locker per reachable backend, each on a table
//! of its own so tests running in parallel never see each other's rows.

#![allow(dead_code)]

use std::time::Duration;

use dblock::Locker;

pub const POSTGRES_DEFAULT: &str = "postgres://postgres@127.0.0.1:5432/test";
pub const MYSQL_DEFAULT: &str = "mysql://root@127.0.0.1:3306/test";

/// A locker on a fresh table, and what to call it in assertion messages.
pub struct Db {
    pub name: &'static str,
    pub url: String,
    pub locker: Locker,
}

pub fn require_servers() -> bool {
    std::env::var("DBLOCK_REQUIRE_SERVERS").is_ok_and(|v| v == "1")
}

pub fn postgres_url() -> String {
    std::env::var("DBLOCK_POSTGRES_URL").unwrap_or_else(|_| POSTGRES_DEFAULT.into())
}

pub fn mysql_url() -> String {
    std::env::var("DBLOCK_MYSQL_URL").unwrap_or_else(|_| MYSQL_DEFAULT.into())
}

/// A table name unique to this test and process.
pub fn table_for(test: &str) -> String {
    format!("t_{}_{}_{}", test, std::process::id(), fastrand::u32(..))
        .chars()
        .take(60)
        .collect()
}

async fn server(name: &'static str, url: String, test: &str) -> Option<Db> {
    match Locker::connect(&url).await {
        Ok(locker) => {
            let locker = locker.table(&table_for(test));
            locker.migrate().await.expect("migrate");
            Some(Db { name, url, locker })
        }
        Err(e) if !require_servers() => {
            eprintln!(
                "\n!!!!! SKIPPING {name} for `{test}`: cannot reach the server ({e}).\n\
                 !!!!! Start it, or set DBLOCK_REQUIRE_SERVERS=1 to make this a failure.\n"
            );
            None
        }
        Err(e) => panic!("{name} unreachable and DBLOCK_REQUIRE_SERVERS=1: {e}"),
    }
}

/// A SQLite file in a temp dir (kept alive by the returned handle).
pub async fn sqlite(test: &str) -> (Db, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("locks.db").display()
    );
    let locker = Locker::connect(&url).await.expect("sqlite connect");
    let locker = locker.table(&table_for(test));
    locker.migrate().await.expect("migrate");
    (
        Db {
            name: "sqlite",
            url,
            locker,
        },
        dir,
    )
}

/// Every backend this machine can reach: SQLite on a temp file, PostgreSQL, MariaDB with
/// RETURNING, and MariaDB through the MySQL 8 statements (no RETURNING).
pub async fn all(test: &str) -> (Vec<Db>, tempfile::TempDir) {
    let (lite, dir) = sqlite(test).await;
    let mut dbs = vec![lite];
    if let Some(pg) = server("postgres", postgres_url(), test).await {
        dbs.push(pg);
    }
    if let Some(my) = server("mariadb", mysql_url(), test).await {
        let compat = Db {
            name: "mysql8-path",
            url: my.url.clone(),
            locker: my.locker.__without_returning(),
        };
        dbs.push(my);
        dbs.push(compat);
    }
    (dbs, dir)
}

/// Polls until `key` is free for a fresh owner, returning how long that took.
pub async fn time_until_free(locker: &Locker, key: &str, limit: Duration) -> Option<Duration> {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if let Ok(g) = locker.lock(key).await {
            let took = start.elapsed();
            g.release().await.expect("release");
            return Some(took);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    None
}
