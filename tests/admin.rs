//! The `dblock-admin` binary against real tables: list, show, release, purge.

#![cfg_attr(not(feature = "admin"), allow(unused))]

mod common;

use std::process::Command;
use std::time::Duration;

#[cfg(not(feature = "admin"))]
#[test]
#[ignore = "the dblock-admin tests need `--features admin` (or --all-features)"]
fn admin_tool_needs_the_admin_feature() {}

/// Runs the tool on `db`'s server and `table`, whatever its exit status.
#[cfg(feature = "admin")]
fn admin_on(db: &common::Db, table: &str, args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dblock-admin"));
    cmd.arg(&db.url);
    if db.name == common::PGBOUNCER {
        cmd.arg("--pooler");
    }
    cmd.args(["--table", table]).args(args).output().unwrap()
}

/// Runs the tool on `db`'s table; its stdout, after checking it succeeded.
#[cfg(feature = "admin")]
fn admin(db: &common::Db, args: &[&str]) -> String {
    let out = admin_on(db, db.locker.table_name(), args);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{}: {args:?} failed: {}{text}",
        db.name,
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// A semaphore in the operator's view: each permit a row of kind `permit i/n`, a line per
/// semaphore with the permits in use, `release KEY` frees them all, `purge` deletes them.
#[cfg(feature = "admin")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphores_show_their_permits_in_use() {
    let (dbs, _dir) = common::all("admin_semaphore").await;
    for db in dbs.iter().filter(|d| d.name != "mysql8-path") {
        let a = db
            .locker
            .semaphore("exports", 3)
            .holder("export-a")
            .await
            .unwrap();
        let b = db
            .locker
            .semaphore("exports", 3)
            .holder("export-b")
            .await
            .unwrap();
        let in_use = db.locker.permits("exports").await.unwrap();
        assert_eq!(in_use.len(), 2, "{}", db.name);
        assert!(in_use
            .iter()
            .all(|p| p.key == "exports"
                && matches!(p.kind, dblock::LockKind::Permit { permits: 3, .. })));
        assert_eq!(
            db.locker.held().await.unwrap().len(),
            2,
            "{}: held() lists the permits",
            db.name
        );

        let list = admin(db, &["list"]);
        assert!(list.contains("permit "), "{}: {list}", db.name);
        assert!(
            list.contains("export-a") && list.contains("export-b"),
            "{}: {list}",
            db.name
        );
        assert!(
            list.contains("semaphore \"exports\": 2 of 3 permits in use"),
            "{}: {list}",
            db.name
        );
        let show = admin(db, &["show", "exports"]);
        assert!(show.contains("2 of 3 permits"), "{}: {show}", db.name);

        let out = admin(db, &["release", "exports"]);
        assert!(out.contains("released"), "{}: {out}", db.name);
        assert!(
            db.locker.permits("exports").await.unwrap().is_empty(),
            "{}",
            db.name
        );
        assert!(
            a.release().await.is_err(),
            "{}: a released permit still held",
            db.name
        );
        assert!(b.release().await.is_err(), "{}", db.name);
        let out = admin(db, &["purge", "0s"]);
        assert!(out.contains("purged 2 rows"), "{}: {out}", db.name);
    }
}

#[cfg(feature = "admin")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_releases_and_purges() {
    let (dbs, _dir) = common::all("admin_bin").await;
    for db in dbs.iter().filter(|d| d.name != "mysql8-path") {
        let g = db
            .locker
            .lock("job:nightly")
            .holder("nightly-report")
            .await
            .unwrap();
        db.locker
            .lock("old")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();

        let list = admin(db, &["list"]);
        assert!(list.contains("job:nightly"), "{}: {list}", db.name);
        assert!(
            list.contains(g.owner().id()),
            "{}: owner missing: {list}",
            db.name
        );
        assert!(
            list.contains("nightly-report"),
            "{}: holder missing: {list}",
            db.name
        );
        assert!(
            list.contains(&g.fencing_token().to_string()),
            "{}: token missing: {list}",
            db.name
        );
        assert!(list.contains("1 held"), "{}: {list}", db.name);
        assert!(
            !list.contains("old "),
            "{}: free lock listed: {list}",
            db.name
        );

        let show = admin(db, &["show", "old"]);
        assert!(
            show.contains("old") && show.contains(" no "),
            "{}: {show}",
            db.name
        );

        let out = admin(db, &["release", "job:nightly"]);
        assert!(out.contains("released"), "{}: {out}", db.name);
        assert!(
            !db.locker
                .inspect("job:nightly")
                .await
                .unwrap()
                .unwrap()
                .held,
            "{}",
            db.name
        );
        assert!(
            g.release().await.is_err(),
            "{}: old holder still thinks it holds",
            db.name
        );

        // The operator's release is recorded as a failure; reset forgets it.
        let show = admin(db, &["show", "job:nightly"]);
        assert!(show.contains("failed"), "{}: {show}", db.name);
        let show = admin(db, &["show", "old"]);
        assert!(show.contains("succeeded"), "{}: {show}", db.name);
        let out = admin(db, &["reset", "job:nightly"]);
        assert!(out.contains("reset"), "{}: {out}", db.name);
        assert_eq!(
            db.locker
                .inspect("job:nightly")
                .await
                .unwrap()
                .unwrap()
                .last_outcome,
            None
        );

        let out = admin(db, &["purge", "0s"]);
        assert!(out.contains("purged 2 rows"), "{}: {out}", db.name);
        assert!(db.locker.inspect("old").await.unwrap().is_none());
    }
}

#[cfg(feature = "admin")]
#[test]
fn bad_arguments_fail_with_usage() {
    let out = Command::new(env!("CARGO_BIN_EXE_dblock-admin"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let out = Command::new(env!("CARGO_BIN_EXE_dblock-admin"))
        .args(["ftp://x", "list"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unsupported database URL"));
}

/// Nothing matched is a failure, as with other tools: `show` of a key without a row exits 1 and
/// says so on stderr.
#[cfg(feature = "admin")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_of_a_missing_key_fails() {
    let (dbs, _dir) = common::all("admin_show_missing").await;
    for db in dbs.iter().filter(|d| d.name != "mysql8-path") {
        let out = admin_on(db, db.locker.table_name(), &["show", "never-taken"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}: {stderr}", db.name);
        assert!(
            stderr.contains("no lock row for key \"never-taken\"")
                && stderr.contains(db.locker.table_name()),
            "{}: {stderr}",
            db.name
        );
    }
}

/// A table that is not there (never migrated, or a wrong `--table`) is named with the way to
/// create it, not left as the database's bare "relation does not exist".
#[cfg(feature = "admin")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_is_explained() {
    let (dbs, _dir) = common::all("admin_no_table").await;
    for db in dbs.iter().filter(|d| d.name != "mysql8-path") {
        let missing = common::table_for("admin_never_made");
        for args in [&["list"][..], &["show", "k"], &["release", "k"], &["purge"]] {
            let out = admin_on(db, &missing, args);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(
                out.status.code(),
                Some(1),
                "{}: {args:?}: {stderr}",
                db.name
            );
            for needle in [
                format!("no lock table \"{missing}\""),
                "migrate()".to_owned(),
                format!("migrations/{}/", db.locker.backend_name()),
                "--table".to_owned(),
            ] {
                assert!(
                    stderr.contains(&needle),
                    "{}: {args:?}: no `{needle}` in: {stderr}",
                    db.name
                );
            }
        }
    }
}

/// Every column of `list` starts where its header does, also when a value is wider than the
/// column's usual width (a long key, a host name with a long label).
#[cfg(feature = "admin")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_columns_line_up_with_the_header() {
    let (dbs, _dir) = common::all("admin_align").await;
    for db in dbs.iter().filter(|d| d.name != "mysql8-path") {
        let long_key = "tenant:0042/report:monthly-revenue-by-region/2026-11";
        let label = "billing-monthly-revenue-report-worker";
        db.locker
            .lock("short")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        db.locker
            .lock(long_key)
            .holder(label)
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        let short = db.locker.lock("short").await.unwrap();
        let long = db.locker.lock(long_key).holder(label).await.unwrap();

        let list = admin(db, &["list"]);
        let lines: Vec<&str> = list.lines().collect();
        let header = lines
            .iter()
            .find(|l| l.starts_with("KEY "))
            .unwrap_or_else(|| panic!("{}: no header: {list}", db.name));
        for (key, guard) in [("short", &short), (long_key, &long)] {
            let row = lines
                .iter()
                .find(|l| l.starts_with(&format!("{key} ")))
                .unwrap_or_else(|| panic!("{}: no row for {key}: {list}", db.name));
            // Each left-aligned value starts where its column's name does.
            for (column, value) in [
                ("HELD", "yes"),
                ("OWNER", guard.owner().id()),
                ("LAST", "succeeded"),
            ] {
                assert_eq!(
                    row.find(value),
                    header.find(column),
                    "{}: {column} does not line up:\n{list}",
                    db.name
                );
            }
        }
        drop((short, long));
    }
}

/// `migration_status` reports every migration pending on a table that is not there, and
/// applied once `migrate` ran; a table made with the first migration only (a team that applied
/// `0001_dblock_locks.sql` with its own tool) has exactly that one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_status_follows_the_schema() {
    let (dbs, _dir) = common::all("admin_migrations").await;
    for db in dbs.iter().filter(|d| d.name != "mysql8-path") {
        let status = db.locker.migration_status().await.unwrap();
        let versions: Vec<u32> = status.iter().map(|m| m.version).collect();
        assert_eq!(versions, [1, 2, 3, 4, 5, 6], "{}", db.name);
        assert_eq!(
            status.iter().map(|m| m.name).collect::<Vec<_>>(),
            [
                "dblock_locks",
                "outcomes",
                "exactly_once",
                "fair_queue",
                "permits",
                "shared"
            ]
        );
        assert!(status.iter().all(|m| m.applied), "{}: {status:?}", db.name);

        let fresh = db.locker.table(&common::table_for("admin_fresh"));
        let status = fresh.migration_status().await.unwrap();
        assert!(status.iter().all(|m| !m.applied), "{}: {status:?}", db.name);

        let old = common::table_for("admin_0001");
        common::create_with_0001(db, &old).await;
        let status = db.locker.table(&old).migration_status().await.unwrap();
        let applied: Vec<bool> = status.iter().map(|m| m.applied).collect();
        assert_eq!(
            applied,
            [true, false, false, false, false, false],
            "{}",
            db.name
        );

        fresh.migrate().await.unwrap();
        db.locker.table(&old).migrate().await.unwrap();
        for locker in [&fresh, &db.locker.table(&old)] {
            let status = locker.migration_status().await.unwrap();
            assert!(status.iter().all(|m| m.applied), "{}: {status:?}", db.name);
        }
    }
}

/// `waiters` lists the fair waiters of a key in ticket order, with their owners and live ticket
/// leases, filtered by prefix; a waiter that got the key has left the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_the_fair_queue() {
    let (dbs, _dir) = common::all("admin_waiters").await;
    for db in dbs.iter().filter(|d| d.name != "mysql8-path") {
        assert!(db.locker.waiters("").await.unwrap().is_empty());
        let held = db.locker.lock("queue:k").await.unwrap();
        let mut tasks = Vec::new();
        let mut owners = Vec::new();
        for _ in 0..2 {
            let owner = dblock::Owner::new();
            owners.push(owner.id().to_owned());
            let locker = db.locker.clone();
            tasks.push(tokio::spawn(async move {
                let g = locker
                    .lock("queue:k")
                    .owner(&owner)
                    .fair()
                    .wait(Duration::from_secs(60))
                    .await
                    .unwrap();
                g.release().await.unwrap();
            }));
            // One after the other: the second takes its ticket after the first.
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while db.locker.waiters("queue:").await.unwrap().len() < owners.len() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{}: waiter never queued",
                    db.name
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let waiters = db.locker.waiters("queue:").await.unwrap();
        assert_eq!(
            waiters.iter().map(|w| w.owner.clone()).collect::<Vec<_>>(),
            owners,
            "{}",
            db.name
        );
        assert!(waiters[0].ticket < waiters[1].ticket, "{}", db.name);
        for w in &waiters {
            assert_eq!(w.key, "queue:k");
            assert!(w.time_left > Duration::ZERO, "{}: {w:?}", db.name);
            assert!(w.expires_at > std::time::SystemTime::UNIX_EPOCH);
        }
        assert!(db.locker.waiters("other:").await.unwrap().is_empty());

        held.release().await.unwrap();
        for t in tasks {
            t.await.unwrap();
        }
        assert!(
            db.locker.waiters("").await.unwrap().is_empty(),
            "{}",
            db.name
        );
    }
}
