//! A lock table that was never migrated: every path (lock, lock_all, read, semaphore, fair,
//! leader, the operator's reads) answers at once with a `Config` error that names the missing
//! table and the fix, on every backend, instead of a raw "relation does not exist" or a wait.

mod common;

use std::time::{Duration, Instant};

use dblock::{LockError, Locker};

/// `err` names `table` (or, for the semaphore's and the queue's tables, a table of its name)
/// and says how to create it.
fn names_the_fix(db: &str, path: &str, err: &LockError, table: &str) {
    let text = err.to_string();
    assert!(err.is_not_migrated(), "{db}: {path}: {err:?}");
    assert!(matches!(err, LockError::Config(_)), "{db}: {path}: {err:?}");
    assert!(
        text.contains(table) && text.contains("migrate()") && text.contains("dblock migrate"),
        "{db}: {path}: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_path_names_the_missing_table_and_the_fix() {
    let (dbs, _dir) = common::all("never_migrated").await;
    for db in &dbs {
        let table = common::table_for("never_migrated");
        let l: Locker = common::as_named(db.name, db.locker.table(&table));
        // A wait: none of these may spend it retrying what cannot work.
        let wait = Duration::from_secs(10);
        let started = Instant::now();
        let name = db.name;

        let err = l.lock("k").wait(wait).await.unwrap_err();
        names_the_fix(name, "lock", &err, &table);
        let err = l.lock_all(["a", "b"]).wait(wait).await.unwrap_err();
        names_the_fix(name, "lock_all", &err, &table);
        let err = l.lock("k").fair().wait(wait).await.unwrap_err();
        names_the_fix(name, "fair", &err, &table);
        let err = l.read("k").wait(wait).await.unwrap_err();
        names_the_fix(name, "read", &err, &table);
        let err = l.semaphore("k", 3).wait(wait).await.unwrap_err();
        names_the_fix(name, "semaphore", &err, &table);
        let err = tokio::time::timeout(wait, l.leader("k").campaign())
            .await
            .expect("a campaign on a table never migrated ends at once")
            .unwrap_err();
        names_the_fix(name, "leader", &err, &table);
        let err = l.inspect("k").await.unwrap_err();
        names_the_fix(name, "inspect", &err, &table);
        let err = l.held().await.unwrap_err();
        names_the_fix(name, "held", &err, &table);
        let err = l.purge(Duration::ZERO).await.unwrap_err();
        names_the_fix(name, "purge", &err, &table);
        assert!(
            started.elapsed() < Duration::from_secs(8),
            "{name}: the paths took {:?}: some waited instead of answering",
            started.elapsed()
        );

        // And `migrate()` is the fix, as the message says.
        l.migrate().await.unwrap();
        l.lock("k").await.unwrap().release().await.unwrap();
    }
}
