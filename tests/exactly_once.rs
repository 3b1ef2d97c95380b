//! Exactly once with the app's transaction (`succeed_in`), `purge` keeping done `once` keys, and
//! a process that exits as soon as a shutdown ends its body. The children that get SIGKILLed or
//! exit are this test binary itself, started with `DBLOCK_CHILD` set to run only `child_entry`.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dblock::{LockError, Locker, Outcome};

/// Runs `$body` with `$pool` bound to the sqlx pool type of the backend called `$name` (work in
/// the lock's own database needs the backend's own connection type).
macro_rules! with_pool {
    ($name:expr, $pool:ident => $body:expr) => {
        match $name {
            #[cfg(feature = "sqlite")]
            "sqlite" => {
                type $pool = sqlx::SqlitePool;
                $body
            }
            #[cfg(feature = "postgres")]
            b if common::is_postgres(b) => {
                type $pool = sqlx::PgPool;
                $body
            }
            #[cfg(feature = "mysql")]
            _ => {
                type $pool = sqlx::MySqlPool;
                $body
            }
            #[allow(unreachable_patterns)]
            other => panic!("no backend {other} in this build"),
        }
    };
}

/// The lease of the child's `once` hold: the parent waits past it before trying again.
const TTL_MS: u64 = 1500;

/// Runs only inside a child process (ignored in normal runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "child process entry point, started by the other tests"]
async fn child_entry() {
    let (role, locker) = common::child_locker().await;
    let work_url = std::env::var("DBLOCK_CHILD_WORK_URL").unwrap();
    let name = std::env::var("DBLOCK_CHILD_BACKEND").unwrap();
    let table = locker.table_name().to_owned();
    match role.as_str() {
        // Commits the work (and, for "recorded", its success in the same transaction), says so,
        // and hangs until killed: the release never comes.
        "recorded" | "unrecorded" => {
            let record = role == "recorded";
            let result = migrate_once(&locker, &name, &work_url, &table, record).await;
            panic!("the body returned before it was killed: {result:?}");
        }
        // A shutdown ends the body; the process exits the moment the body returns, as a
        // service's `main` does when its last task ends.
        "exit-on-shutdown" => {
            let l = locker.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                l.shutdown().await;
            });
            let ended = long_job(&locker).await;
            println!("BODY ENDED {ended:?}");
            std::io::stdout().flush().unwrap();
            std::process::exit(0);
        }
        other => panic!("unknown role {other}"),
    }
}

#[dblock::distributed_lock(key = "migration:7", locker = locker, once = true, ttl = "1500ms", renew = false)]
async fn migrate_once(
    locker: &Locker,
    backend: &str,
    work_url: &str,
    table: &str,
    record: bool,
) -> Result<(), LockError> {
    work(backend, work_url, &work_table(table), record)
        .await
        .map_err(|e| LockError::Config(e.to_string()))?;
    println!("COMMITTED");
    std::io::stdout().flush().unwrap();
    tokio::time::sleep(Duration::from_secs(120)).await;
    Ok(())
}

#[dblock::distributed_lock(key = "long-job", locker = locker, ttl = "30s")]
async fn long_job(locker: &Locker) -> Result<(), LockError> {
    tokio::time::sleep(Duration::from_secs(120)).await;
    Ok(())
}

fn work_table(table: &str) -> String {
    format!("w_{}", table.trim_start_matches("t_"))
}

/// One row of "work" in a transaction of the lock's own database, with the body's success
/// recorded in it when `record`; committed.
async fn work(backend: &str, url: &str, table: &str, record: bool) -> Result<(), sqlx::Error> {
    let insert = format!("INSERT INTO {table} (id) VALUES (1)");
    with_pool!(backend, Pool => {
        let pool = Pool::connect(url).await?;
        let mut tx = pool.begin().await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(insert.as_str()))
            .execute(&mut *tx)
            .await?;
        if record {
            dblock::succeed_in(&mut *tx)
                .await
                .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
        }
        tx.commit().await
    })
}

fn child(db: &common::Db, role: &str) -> Command {
    let mut cmd = common::child_command(db, role);
    cmd.env("DBLOCK_CHILD_WORK_URL", common::direct_url(db))
        .stdout(Stdio::piped());
    cmd
}

/// A `once` body commits its work and its success in one transaction, and is SIGKILLed right
/// after the commit, before any release: the key is done. Past the lease, the next `once` call
/// does not run again, and the work happened once. The control: the same crash without
/// `succeed_in` runs the work again (at-least-once), so the test can tell the two apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_is_exactly_once_when_the_holder_is_killed_after_its_commit() {
    let (dbs, _dir) = common::all("exactly_once").await;
    for db in &dbs {
        let work_url = common::direct_url(db);
        let table = work_table(db.locker.table_name());
        common::run_sql(db.name, &work_url, &format!("DROP TABLE IF EXISTS {table}")).await;
        common::run_sql(
            db.name,
            &work_url,
            &format!("CREATE TABLE {table} (id BIGINT)"),
        )
        .await;
        for (role, key_done) in [("recorded", true), ("unrecorded", false)] {
            common::run_sql(db.name, &work_url, &format!("DELETE FROM {table}")).await;
            db.locker.reset("migration:7").await.unwrap();
            let mut c = child(db, role).spawn().unwrap();
            common::read_marker(&mut c, "COMMITTED").await;
            let killed = Instant::now();
            c.kill().unwrap(); // SIGKILL: no release, no destructor
            c.wait().unwrap();
            assert_eq!(
                common::run_sql(db.name, &work_url, &format!("SELECT COUNT(*) FROM {table}")).await,
                1,
                "{}: the work did not commit",
                db.name
            );
            tokio::time::sleep(
                Duration::from_millis(TTL_MS + 200).saturating_sub(killed.elapsed()),
            )
            .await;
            let again = db
                .locker
                .lock("migration:7")
                .once()
                .wait(Duration::from_secs(3))
                .await;
            let info = db.locker.inspect("migration:7").await.unwrap().unwrap();
            if key_done {
                assert!(
                    matches!(again, Err(LockError::AlreadyDone { .. })),
                    "{}: a success committed with the work did not stand after a crash: {again:?}",
                    db.name
                );
                assert_eq!(info.last_outcome, Some(Outcome::Succeeded), "{}", db.name);
            } else {
                let g = again.unwrap_or_else(|e| {
                    panic!(
                        "{}: without succeed_in the crashed run is a failure: {e}",
                        db.name
                    )
                });
                g.release_failed().await.unwrap();
            }
        }
    }
}

/// `succeed_in` in one process: the success stands against a later `release_failed`, rolls back
/// with its transaction, is refused when the lease is no longer ours, and is an error outside
/// a locked body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn succeed_in_commits_and_rolls_back_with_the_work() {
    let (dbs, _dir) = common::all("succeed_in").await;
    for db in &dbs {
        let work_url = common::direct_url(db);
        // A table of its own per backend ("mysql8-path" shares MariaDB's).
        let locker = common::own_table(db, "succeed_in").await;
        let db = &common::Db {
            name: db.name,
            url: db.url.clone(),
            locker,
        };
        with_pool!(db.name, Pool => {
            let pool = Pool::connect(&work_url).await.unwrap();
            // Committed, then the hold released as failed: the success stands.
            let g = db.locker.lock("a").once().await.unwrap();
            let mut tx = pool.begin().await.unwrap();
            g.succeed_in(&mut *tx).await.unwrap();
            tx.commit().await.unwrap();
            g.release_failed().await.unwrap();
            let info = db.locker.inspect("a").await.unwrap().unwrap();
            assert_eq!(info.last_outcome, Some(Outcome::Succeeded), "{}", db.name);
            assert!(
                matches!(
                    db.locker.lock("a").once().await,
                    Err(LockError::AlreadyDone { .. })
                ),
                "{}",
                db.name
            );
            // Rolled back: nothing recorded; the release says how the hold ended.
            let g = db.locker.lock("b").once().await.unwrap();
            let mut tx = pool.begin().await.unwrap();
            g.succeed_in(&mut *tx).await.unwrap();
            tx.rollback().await.unwrap();
            g.release_failed().await.unwrap();
            let info = db.locker.inspect("b").await.unwrap().unwrap();
            assert_eq!(info.last_outcome, Some(Outcome::Failed), "{}", db.name);
            db.locker
                .lock("b")
                .once()
                .await
                .unwrap()
                .release()
                .await
                .unwrap();
            // A lease that ran out: refused, nothing recorded.
            let g = db
                .locker
                .lock("c")
                .ttl(Duration::from_millis(500))
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(700)).await;
            let mut tx = pool.begin().await.unwrap();
            let refused = g.succeed_in(&mut *tx).await;
            assert!(
                matches!(refused, Err(LockError::Lost { .. })),
                "{}: {refused:?}",
                db.name
            );
            tx.rollback().await.unwrap();
            let mut conn = pool.acquire().await.unwrap();
            assert!(
                matches!(
                    dblock::succeed_in(&mut *conn).await,
                    Err(LockError::Config(_))
                ),
                "{}: succeed_in outside a locked body",
                db.name
            );
        });
    }
}

/// `purge` never forgets a `once` key whose last hold succeeded (released, or committed with
/// `succeed_in` and then crashed); it does delete other free rows, failed `once` keys, and a
/// done key once an operator `reset` it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_keeps_done_once_keys_until_they_are_reset() {
    let (dbs, _dir) = common::all("purge_once").await;
    for db in &dbs {
        // A table of its own per backend ("mysql8-path" shares MariaDB's).
        let l = &common::own_table(db, "purge_once").await;
        l.lock("done")
            .once()
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        l.lock("failed")
            .once()
            .await
            .unwrap()
            .release_failed()
            .await
            .unwrap();
        l.lock("plain").await.unwrap().release().await.unwrap();
        // A crashed holder whose success committed: its lease runs out unreleased. The work's
        // connection is opened before the lease starts (a connect inside a 200 ms lease was
        // the slowest part of it on a loaded machine).
        let work_url = common::direct_url(db);
        with_pool!(db.name, Pool => {
            let pool = Pool::connect(&work_url).await.unwrap();
            let mut tx = pool.begin().await.unwrap();
            let g = l
                .lock("crashed")
                .once()
                .ttl(Duration::from_secs(1))
                .await
                .unwrap();
            g.succeed_in(&mut *tx).await.unwrap();
            tx.commit().await.unwrap();
            std::mem::forget(g); // as a SIGKILL would: no release
        });
        tokio::time::sleep(Duration::from_millis(1300)).await;

        let purged = l.purge(Duration::ZERO).await.unwrap();
        assert_eq!(purged, 2, "{}: purged {purged} rows", db.name);
        for (key, kept) in [
            ("done", true),
            ("crashed", true),
            ("failed", false),
            ("plain", false),
        ] {
            assert_eq!(
                l.inspect(key).await.unwrap().is_some(),
                kept,
                "{}: {key}",
                db.name
            );
        }
        for key in ["done", "crashed"] {
            assert!(
                matches!(l.lock(key).once().await, Err(LockError::AlreadyDone { .. })),
                "{}: {key} ran again after purge",
                db.name
            );
        }
        // The operator forgets one on purpose: then purge takes it, and it runs again.
        assert!(l.reset("done").await.unwrap(), "{}", db.name);
        assert_eq!(l.purge(Duration::ZERO).await.unwrap(), 1, "{}", db.name);
        assert!(l.inspect("done").await.unwrap().is_none(), "{}", db.name);
        l.lock("done")
            .once()
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
}

/// A shutdown ends a locked body, and the process exits the moment the body returns: its
/// release is already done, so another instance gets the key at once, not after the ttl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_exits_when_shutdown_ends_its_body_leaves_the_key_free() {
    let (dbs, _dir) = common::all("exit_on_shutdown").await;
    for db in &dbs {
        for run in 0..3 {
            let mut c = child(db, "exit-on-shutdown").spawn().unwrap();
            let ended = common::read_marker(&mut c, "BODY ENDED").await;
            assert!(
                ended.contains("Lost"),
                "{}: the body ended with {ended}",
                db.name
            );
            let status = c.wait().unwrap();
            assert!(status.success(), "{}: child failed: {status}", db.name);
            // The ttl is 30 s: the key is free at once only if the release was done.
            let g =
                db.locker.lock("long-job").await.unwrap_or_else(|e| {
                    panic!("{} run {run}: still held after exit: {e}", db.name)
                });
            g.release().await.unwrap();
        }
    }
}
