//! PostgreSQL restarted while locks are held (renewed handle, locked body): nothing panics,
//! renewals resume (or report `Lost`), and new acquisitions work once the server is back.
//!
//! Runs on a PostgreSQL cluster of its own (`common::cluster`: own data directory and port), so
//! stopping it never touches the shared server the other tests use.

#![cfg_attr(not(feature = "postgres"), allow(unused))]

mod common;

use std::time::{Duration, Instant};

use dblock::{distributed_lock, LockError, Locker};

#[distributed_lock(key = "through-restart", locker = locker, ttl = "6s")]
async fn long_body(locker: &Locker) -> Result<(), LockError> {
    tokio::time::sleep(Duration::from_secs(8)).await;
    Ok(())
}

#[cfg(not(feature = "postgres"))]
#[test]
#[ignore = "the PostgreSQL restart test needs `--features postgres` (or --all-features)"]
fn restart_needs_the_postgres_feature() {}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_survive_a_postgres_restart() {
    let Some(pg) = common::cluster::PrivatePg::start("the PostgreSQL restart test", &[]) else {
        return;
    };
    let locker = Locker::connect(&pg.url()).await.expect("private cluster");
    let locker = locker.table(&common::table_for("restart"));
    locker.migrate().await.unwrap();

    let renewed = locker
        .lock("renewed")
        .ttl(Duration::from_secs(6))
        .await
        .unwrap()
        .auto_renew();
    let l = locker.clone();
    let body = tokio::spawn(async move { long_body(&l).await });
    tokio::time::sleep(Duration::from_millis(500)).await;

    pg.stop();
    // While it is down: errors, not panics.
    let down = locker.lock("while-down").await;
    assert!(matches!(down, Err(LockError::Database(_))), "{down:?}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    pg.restart();

    // New acquisitions work again once the server is back.
    let started = Instant::now();
    let fresh = loop {
        match locker.lock("after-restart").await {
            Ok(g) => break g,
            Err(e) if started.elapsed() < Duration::from_secs(30) => {
                eprintln!("waiting for the server: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("no acquisition after restart: {e}"),
        }
    };
    fresh.release().await.unwrap();

    // The body either kept its lease through the restart (renewals resumed) or was told Lost.
    match body.await.expect("no panic in the locked body") {
        Ok(()) | Err(LockError::Lost { .. }) => {}
        Err(e) => panic!("unexpected outcome: {e}"),
    }
    // The renewed handle: renewals resumed, so it is still held and releases normally.
    tokio::time::sleep(Duration::from_secs(2)).await;
    if renewed.is_lost() {
        assert!(renewed.release().await.is_err());
    } else {
        let info = locker.inspect("renewed").await.unwrap().unwrap();
        assert!(info.held, "not lost, yet not held: {info:?}");
        renewed.release().await.unwrap();
    }
}
