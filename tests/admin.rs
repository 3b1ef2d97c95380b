//! The `dblock-admin` binary against real tables: list, show, release, purge.

#![cfg_attr(not(feature = "admin"), allow(unused))]

mod common;

use std::process::Command;

#[cfg(not(feature = "admin"))]
#[test]
#[ignore = "the dblock-admin tests need `--features admin` (or --all-features)"]
fn admin_tool_needs_the_admin_feature() {}

#[cfg(feature = "admin")]
fn admin(db: &common::Db, args: &[&str]) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dblock-admin"));
    cmd.arg(&db.url);
    if db.name == common::PGBOUNCER {
        cmd.arg("--pooler");
    }
    let out = cmd
        .args(["--table", db.locker.table_name()])
        .args(args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{}: {args:?} failed: {}{text}",
        db.name,
        String::from_utf8_lossy(&out.stderr)
    );
    text
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
