//! PostgreSQL restarted while locks are held (renewed handle, locked body): nothing panics,
//! renewals resume (or report `Lost`), and new acquisitions work once the server is back.
//!
//! Restarts the local cluster with `pg_ctlcluster`, so it runs only when
//! `DBLOCK_RESTART_SERVERS=1` (as `.ci/run` sets); otherwise it says so and skips.

#![cfg_attr(not(feature = "postgres"), allow(unused))]

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use dblock::{distributed_lock, LockError, Locker};

#[distributed_lock(key = "through-restart", locker = locker, ttl = "6s")]
async fn long_body(locker: &Locker) -> Result<(), LockError> {
    tokio::time::sleep(Duration::from_secs(8)).await;
    Ok(())
}

fn pg_ctl(action: &str) {
    let version = std::fs::read_dir("/etc/postgresql")
        .expect("/etc/postgresql")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .next()
        .expect("a cluster");
    let status = Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", &version, "main", action])
        .status()
        .expect("pg_ctlcluster");
    assert!(status.success(), "pg_ctlcluster {action} failed");
}

#[cfg(not(feature = "postgres"))]
#[test]
#[ignore = "the PostgreSQL restart test needs `--features postgres` (or --all-features)"]
fn restart_needs_the_postgres_feature() {}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_survive_a_postgres_restart() {
    if std::env::var("DBLOCK_RESTART_SERVERS").as_deref() != Ok("1") {
        common::shout("SKIPPING the PostgreSQL restart test: set DBLOCK_RESTART_SERVERS=1 to allow it to restart the local cluster.");
        return;
    }
    let Ok(locker) = Locker::connect(&common::postgres_url()).await else {
        panic!("PostgreSQL unreachable");
    };
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

    pg_ctl("stop");
    // While it is down: errors, not panics.
    let down = locker.lock("while-down").await;
    assert!(matches!(down, Err(LockError::Database(_))), "{down:?}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    pg_ctl("start");

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
