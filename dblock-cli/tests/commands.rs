//! Every command of the `dblock` binary on every backend: what it prints, its `--json` read
//! back field by field, and its exit status in each case (0 done, 1 error, 2 bad command line,
//! 3 nothing to do / not found).

mod common;

use std::time::Duration;

use common::{expect, expect_json, rfc3339_secs, run, run_on, secs, stderr, stdout};
use serde_json::{json, Value};

/// The lease of every hold a test expects to stay held across several runs of the tool: long
/// enough for a busy machine.
const LONG: Duration = Duration::from_secs(300);

/// `lock` (a JSON lock object) against the library's view of the same row, field by field.
fn check_lock(db: &str, lock: &Value, info: &dblock::LockInfo) {
    assert_eq!(lock["key"], json!(info.key), "{db}");
    assert_eq!(lock["held"], json!(info.held), "{db}");
    assert_eq!(lock["owner"], json!(info.owner), "{db}");
    assert_eq!(lock["holder"], json!(info.holder), "{db}");
    assert_eq!(lock["hold_count"], json!(info.hold_count), "{db}");
    assert_eq!(lock["fencing_token"], json!(info.fencing_token), "{db}");
    assert_eq!(lock["renewals"], json!(info.renewals), "{db}");
    for (field, at) in [
        ("expires_at", info.expires_at),
        ("acquired_at", info.acquired_at),
    ] {
        let shown = rfc3339_secs(lock[field].as_str().unwrap());
        assert!(
            (shown - secs(at)).abs() < 0.000_01,
            "{db}: {field} {} for {at:?}",
            lock[field]
        );
    }
    match info.finished_at {
        Some(at) => assert!(
            (rfc3339_secs(lock["finished_at"].as_str().unwrap()) - secs(at)).abs() < 0.000_01,
            "{db}"
        ),
        None => assert_eq!(lock["finished_at"], Value::Null, "{db}"),
    }
    let left = lock["time_left_secs"].as_f64().unwrap();
    if info.held {
        assert!(left > 0.0 && left <= LONG.as_secs_f64(), "{db}: {left}");
    } else {
        assert_eq!(left, 0.0, "{db}");
    }
    let keys: Vec<&String> = lock.as_object().unwrap().keys().collect();
    assert_eq!(
        keys.len(),
        13,
        "{db}: one schema, no field more or less: {keys:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_shows_held_locks_in_a_table_and_in_json() {
    let (dbs, _dir) = common::all("list").await;
    for db in &dbs {
        let g = db
            .locker
            .lock("job:nightly")
            .holder("nightly-report")
            .ttl(LONG)
            .await
            .unwrap();
        db.locker
            .lock("old")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();

        let list = expect(db, &["list"], 0);
        for needle in [
            "job:nightly",
            g.owner().id(),
            "nightly-report",
            &g.fencing_token().to_string(),
            "1 held",
            " in ",   // expires in 59s (03:21:12Z): relative ...
            " ago (", // acquired 0s ago (03:20:12Z): ... and absolute
            "Z)",
        ] {
            assert!(
                list.contains(needle),
                "{}: no {needle:?} in:\n{list}",
                db.name
            );
        }
        assert!(
            !list.contains("old "),
            "{}: a free lock listed:\n{list}",
            db.name
        );

        let only = expect(db, &["list", "--prefix", "job:"], 0);
        assert!(only.contains("job:nightly"), "{}: {only}", db.name);
        let none = expect(db, &["list", "--prefix", "zzz"], 0);
        assert!(
            !none.contains("job:nightly") && none.contains("0 held"),
            "{}: {none}",
            db.name
        );

        // By holder: the label, this machine and process, or nobody.
        let here = format!("/{}/", std::process::id());
        for (holder, listed) in [
            ("nightly-report", true),
            (here.as_str(), true),
            ("nobody", false),
        ] {
            let by = expect(db, &["list", "--holder", holder], 0);
            assert_eq!(
                by.contains("job:nightly"),
                listed,
                "{}: {holder}: {by}",
                db.name
            );
        }
        let v = expect_json(db, &["list", "--json", "--holder", "nobody"], 0);
        assert_eq!(v["locks"], json!([]), "{}", db.name);

        let v = expect_json(db, &["list", "--json"], 0);
        assert_eq!(v["table"], json!(db.table()), "{}", db.name);
        let locks = v["locks"].as_array().unwrap();
        assert_eq!(locks.len(), 1, "{}: {v}", db.name);
        let info = db.locker.inspect("job:nightly").await.unwrap().unwrap();
        check_lock(db.name, &locks[0], &info);
        assert_eq!(locks[0]["kind"], json!({"type": "lock"}), "{}", db.name);
        assert_eq!(locks[0]["owner"], json!(g.owner().id()));
        assert_eq!(locks[0]["fencing_token"], json!(g.fencing_token()));
        assert_eq!(locks[0]["last_outcome"], Value::Null);
        let v = expect_json(db, &["list", "--json", "--prefix", "zzz"], 0);
        assert_eq!(v["locks"], json!([]), "{}", db.name);
        g.release().await.unwrap();
    }
}

/// Every column of `list` starts where its header does, also when a value is wider than the
/// header (a long key, a long holder label).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_columns_line_up_with_the_header() {
    let (dbs, _dir) = common::all("align").await;
    for db in &dbs {
        let long_key = "tenant:0042/report:monthly-revenue-by-region/2026-11";
        let label = "billing-monthly-revenue-report-worker";
        for key in ["short", long_key] {
            db.locker.lock(key).await.unwrap().release().await.unwrap();
        }
        let short = db.locker.lock("short").ttl(LONG).await.unwrap();
        let long = db
            .locker
            .lock(long_key)
            .holder(label)
            .ttl(LONG)
            .await
            .unwrap();

        let list = expect(db, &["list"], 0);
        let lines: Vec<&str> = list.lines().collect();
        let header = lines[0];
        assert!(header.starts_with("KEY "), "{}: {list}", db.name);
        for (key, guard) in [("short", &short), (long_key, &long)] {
            let row = lines
                .iter()
                .find(|l| l.starts_with(&format!("{key} ")))
                .unwrap_or_else(|| panic!("{}: no row for {key}: {list}", db.name));
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_prints_a_row_held_or_not_and_exits_3_without_one() {
    let (dbs, _dir) = common::all("show").await;
    for db in &dbs {
        let g = db
            .locker
            .lock("held")
            .holder("worker-1")
            .ttl(LONG)
            .await
            .unwrap();
        db.locker
            .lock("done")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();

        let show = expect(db, &["show", "held"], 0);
        assert!(
            show.contains("held") && show.contains(" yes ") && show.contains("worker-1"),
            "{}: {show}",
            db.name
        );
        let show = expect(db, &["show", "done"], 0);
        assert!(
            show.contains(" no ") && show.contains("succeeded") && show.contains("ago ("),
            "{}: {show}",
            db.name
        );

        for key in ["held", "done"] {
            let v = expect_json(db, &["show", key, "--json"], 0);
            assert_eq!(v["table"], json!(db.table()));
            assert_eq!(v["key"], json!(key));
            assert_eq!(v["permits"], json!([]));
            let info = db.locker.inspect(key).await.unwrap().unwrap();
            check_lock(db.name, &v["lock"], &info);
        }
        // A guard dropped without a word: its outcome is "dropped" (the release runs in the
        // background, so the row is waited for).
        drop(db.locker.lock("dropped").await.unwrap());
        let start = std::time::Instant::now();
        while db.locker.inspect("dropped").await.unwrap().unwrap().held {
            assert!(start.elapsed() < Duration::from_secs(60), "{}", db.name);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let v = expect_json(db, &["show", "dropped", "--json"], 0);
        assert_eq!(v["lock"]["last_outcome"], json!("dropped"), "{}", db.name);
        let show = expect(db, &["show", "dropped"], 0);
        assert!(show.contains(" dropped "), "{}: {show}", db.name);

        let v = expect_json(db, &["show", "done", "--json"], 0);
        assert_eq!(v["lock"]["held"], json!(false));
        assert_eq!(v["lock"]["owner"], Value::Null);
        assert_eq!(v["lock"]["hold_count"], json!(0));
        assert_eq!(v["lock"]["last_outcome"], json!("succeeded"), "{}", db.name);
        assert!(v["lock"]["finished_at"].is_string(), "{}", db.name);

        // Nothing found: exit 3, a word on stderr; with --json the object still comes.
        let out = run(db, &["show", "never-taken"]);
        assert_eq!(out.status.code(), Some(3), "{}", db.name);
        assert!(stdout(&out).is_empty(), "{}", db.name);
        let err = stderr(&out);
        assert!(
            err.contains("no lock row for key \"never-taken\"") && err.contains(db.table()),
            "{}: {err}",
            db.name
        );
        let v = expect_json(db, &["show", "never-taken", "--json"], 3);
        assert_eq!(
            v,
            json!({"table": db.table(), "key": "never-taken", "lock": null, "permits": []})
        );
        drop(g);
    }
}

/// Permits and read holds in the operator's view: a row per permit (`permit i/n`, JSON
/// `{"type": "permit", ...}`), a line per semaphore, `release KEY` frees them all; readers as
/// one row of kind `read`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphores_and_readers() {
    let (dbs, _dir) = common::all("kinds").await;
    for db in &dbs {
        let a = db
            .locker
            .semaphore("exports", 3)
            .holder("export-a")
            .ttl(LONG)
            .await
            .unwrap();
        let b = db
            .locker
            .semaphore("exports", 3)
            .holder("export-b")
            .ttl(LONG)
            .await
            .unwrap();
        let r = db
            .locker
            .read("config")
            .holder("reader")
            .ttl(LONG)
            .await
            .unwrap();

        let list = expect(db, &["list"], 0);
        for needle in [
            "permit ",
            "export-a",
            "export-b",
            "semaphore \"exports\": 2 of 3 permits in use",
            "config",
            " read ",
            "3 held",
        ] {
            assert!(
                list.contains(needle),
                "{}: no {needle:?} in:\n{list}",
                db.name
            );
        }
        let show = expect(db, &["show", "exports"], 0);
        assert!(show.contains("2 of 3 permits"), "{}: {show}", db.name);

        let v = expect_json(db, &["show", "exports", "--json"], 0);
        assert_eq!(v["lock"], Value::Null, "{}", db.name);
        let permits = v["permits"].as_array().unwrap();
        assert_eq!(permits.len(), 2, "{}: {v}", db.name);
        let mut slots = Vec::new();
        for p in permits {
            assert_eq!(p["key"], json!("exports"));
            assert_eq!(p["kind"]["type"], json!("permit"));
            assert_eq!(p["kind"]["permits"], json!(3));
            slots.push(p["kind"]["slot"].as_u64().unwrap());
            assert_eq!(p["held"], json!(true));
        }
        slots.sort_unstable();
        slots.dedup();
        assert_eq!(slots.len(), 2, "{}: {v}", db.name);

        let v = expect_json(db, &["list", "--json", "--prefix", "config"], 0);
        let reader = &v["locks"][0];
        assert_eq!(
            reader["kind"],
            json!({"type": "read", "writer_waiting": false}),
            "{}",
            db.name
        );
        assert_eq!(reader["hold_count"], json!(1));

        let out = expect(db, &["release", "exports"], 0);
        assert!(out.contains("released \"exports\""), "{}: {out}", db.name);
        assert!(db.locker.permits("exports").await.unwrap().is_empty());
        assert!(a.release().await.is_err() && b.release().await.is_err());
        r.release().await.unwrap();
    }
}

/// `release KEY --owner UUID` frees only that owner's hold; `release --holder TEXT` frees the
/// locks and permits of the holders that contain TEXT, each only while its listed owner holds
/// it, and leaves other holders' keys and read locks alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_by_owner_and_by_holder_frees_only_those_holds() {
    let (dbs, _dir) = common::all("release_owner").await;
    for db in &dbs {
        let (l, name) = (&db.locker, db.name);
        let dead = l.lock("a").holder("dead-job").ttl(LONG).await.unwrap();
        let other = l.lock("b").holder("live-job").ttl(LONG).await.unwrap();
        let permit = l
            .semaphore("s", 2)
            .holder("dead-job")
            .ttl(LONG)
            .await
            .unwrap();
        let read = l.read("r").holder("dead-job").ttl(LONG).await.unwrap();

        // --owner: another owner's id frees nothing (exit 3), the holder's own frees it.
        let stranger = dblock::Owner::new();
        let out = run(db, &["release", "b", "--owner", stranger.id()]);
        assert_eq!(out.status.code(), Some(3), "{name}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("was not held by"),
            "{name}: {}",
            stderr(&out)
        );
        assert!(l.inspect("b").await.unwrap().unwrap().held, "{name}");
        let out = expect(db, &["release", "b", "--owner", other.owner().id()], 0);
        assert!(out.contains("released \"b\""), "{name}: {out}");
        assert!(other.release().await.is_err(), "{name}");

        // --holder: the dead job's lock and permit, not its read lock.
        let out = expect(db, &["release", "--holder", "/dead-job"], 0);
        assert!(
            out.contains("released \"a\"") && out.contains("released \"s\""),
            "{name}: {out}"
        );
        assert!(out.contains("2 released"), "{name}: {out}");
        assert!(!l.inspect("a").await.unwrap().unwrap().held, "{name}");
        assert!(l.permits("s").await.unwrap().is_empty(), "{name}");
        assert!(
            l.inspect("r").await.unwrap().unwrap().held,
            "{name}: a read lock freed"
        );
        assert!(
            dead.release().await.is_err() && permit.release().await.is_err(),
            "{name}"
        );
        // Nothing left of that holder but its read lock: exit 3.
        let out = run(db, &["release", "--holder", "/dead-job"]);
        assert_eq!(out.status.code(), Some(3), "{name}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("a read lock"),
            "{name}: {}",
            stderr(&out)
        );
        read.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_and_reset_exit_3_when_there_is_nothing_to_do() {
    let (dbs, _dir) = common::all("release").await;
    for db in &dbs {
        let g = db.locker.lock("stuck").ttl(LONG).await.unwrap();

        // reset of a held key: refused, says why.
        let out = run(db, &["reset", "stuck"]);
        assert_eq!(out.status.code(), Some(3), "{}", db.name);
        assert!(
            stderr(&out).contains("is held"),
            "{}: {}",
            db.name,
            stderr(&out)
        );

        let out = expect(db, &["release", "stuck"], 0);
        assert!(out.contains("released \"stuck\""), "{}: {out}", db.name);
        assert!(!db.locker.inspect("stuck").await.unwrap().unwrap().held);
        assert!(
            g.release().await.is_err(),
            "{}: old holder still holds",
            db.name
        );

        // Released already, and never taken: nothing to release.
        for key in ["stuck", "never-taken"] {
            let out = run(db, &["release", key]);
            assert_eq!(out.status.code(), Some(3), "{}: {key}", db.name);
            assert!(
                stderr(&out).contains("was not held"),
                "{}: {}",
                db.name,
                stderr(&out)
            );
        }

        // The operator's release is recorded as a failure; reset forgets it.
        let v = expect_json(db, &["show", "stuck", "--json"], 0);
        assert_eq!(v["lock"]["last_outcome"], json!("failed"), "{}", db.name);
        let out = expect(db, &["reset", "stuck"], 0);
        assert!(out.contains("reset \"stuck\""), "{}: {out}", db.name);
        let info = db.locker.inspect("stuck").await.unwrap().unwrap();
        assert_eq!(info.last_outcome, None, "{}", db.name);
        let v = expect_json(db, &["show", "stuck", "--json"], 0);
        assert_eq!(v["lock"]["last_outcome"], Value::Null, "{}", db.name);

        // A `once` key whose work is done runs again after reset.
        db.locker
            .lock("payout:9")
            .once()
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        assert!(db.locker.lock("payout:9").once().await.is_err());
        expect(db, &["reset", "payout:9"], 0);
        let again = db.locker.lock("payout:9").once().await.unwrap();
        again.release().await.unwrap();

        let out = run(db, &["reset", "never-taken"]);
        assert_eq!(out.status.code(), Some(3), "{}", db.name);
        assert!(
            stderr(&out).contains("no lock row for key \"never-taken\""),
            "{}: {}",
            db.name,
            stderr(&out)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_deletes_free_rows_only() {
    let (dbs, _dir) = common::all("purge").await;
    for db in &dbs {
        let g = db.locker.lock("held").ttl(LONG).await.unwrap();
        for key in ["free-1", "free-2"] {
            db.locker
                .lock(key)
                .await
                .unwrap()
                .release_failed()
                .await
                .unwrap();
        }
        // Nothing has been free for a day.
        let out = expect(db, &["purge"], 0);
        assert!(out.contains("purged 0 rows"), "{}: {out}", db.name);
        let out = expect(db, &["purge", "--older-than", "1h"], 0);
        assert!(out.contains("purged 0 rows"), "{}: {out}", db.name);
        let out = expect(db, &["purge", "--older-than", "0s"], 0);
        assert!(out.contains("purged 2 rows"), "{}: {out}", db.name);
        assert!(db.locker.inspect("free-1").await.unwrap().is_none());
        assert!(db.locker.inspect("held").await.unwrap().unwrap().held);
        // Nothing left to purge is no failure: purge runs from cron.
        let out = expect(db, &["purge", "--older-than", "0s"], 0);
        assert!(out.contains("purged 0 rows"), "{}: {out}", db.name);
        // An age under a second is said back as given.
        let out = expect(db, &["purge", "--older-than", "500ms"], 0);
        assert!(out.contains("longer than 500ms"), "{}: {out}", db.name);
        g.release().await.unwrap();
    }
}

fn applied(v: &Value) -> Vec<bool> {
    v["migrations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["applied"].as_bool().unwrap())
        .collect()
}

/// On a table that is not there: `migrate status` says every migration is pending (exit 0),
/// reads fail with what to do (exit 1), `migrate` applies all, then status says applied, and
/// a second `migrate` has nothing to do (still exit 0: deploy scripts run it every time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_a_fresh_table_and_its_status() {
    let (dbs, _dir) = common::all("migrate").await;
    for db in &dbs {
        let fresh = common::table_for("migrate_fresh");
        let on = |args: &[&str], code: i32| {
            let out = run_on(db, &fresh, args);
            assert_eq!(
                out.status.code(),
                Some(code),
                "{}: {args:?}: {}{}",
                db.name,
                stdout(&out),
                stderr(&out)
            );
            out
        };

        let v: Value =
            serde_json::from_slice(&on(&["migrate", "status", "--json"], 0).stdout).unwrap();
        assert_eq!(v["table"], json!(fresh));
        let backend = match db.name {
            "sqlite" => "sqlite",
            "mariadb" => "mysql",
            _ => "postgres",
        };
        assert_eq!(v["backend"], json!(backend));
        let names: Vec<(u64, &str)> = v["migrations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m["version"].as_u64().unwrap(), m["name"].as_str().unwrap()))
            .collect();
        assert_eq!(
            names,
            [
                (1, "dblock_locks"),
                (2, "outcomes"),
                (3, "exactly_once"),
                (4, "fair_queue"),
                (5, "permits"),
                (6, "shared"),
                (7, "renewals")
            ]
        );
        assert_eq!(applied(&v), [false; 7], "{}", db.name);
        let status = stdout(&on(&["migrate", "status"], 0));
        assert!(
            status.contains("0001    dblock_locks pending") && status.contains("7 pending"),
            "{}: {status}",
            db.name
        );

        // Every read and write explains the missing table.
        for args in [
            &["list"][..],
            &["show", "k"],
            &["release", "k"],
            &["reset", "k"],
            &["purge"],
            &["watch", "--json"],
        ] {
            let err = stderr(&on(args, 1));
            for needle in [
                format!("no lock table \"{fresh}\""),
                format!("dblock --table {fresh} migrate"),
                "Locker::migrate()".to_owned(),
                format!("migrations/{backend}/"),
                "--table NAME".to_owned(),
            ] {
                assert!(
                    err.contains(&needle),
                    "{}: {args:?}: no `{needle}` in: {err}",
                    db.name
                );
            }
        }

        let out = stdout(&on(&["migrate"], 0));
        assert!(
            out.contains("applied 0001_dblock_locks, 0002_outcomes, 0003_exactly_once, 0004_fair_queue, 0005_permits, 0006_shared, 0007_renewals"),
            "{}: {out}",
            db.name
        );
        let v: Value =
            serde_json::from_slice(&on(&["migrate", "status", "--json"], 0).stdout).unwrap();
        assert_eq!(applied(&v), [true; 7], "{}", db.name);
        assert!(stdout(&on(&["migrate", "status"], 0)).contains("all applied"));
        for again in [&["migrate"][..], &["migrate", "run"]] {
            let out = stdout(&on(again, 0));
            assert!(out.contains("is up to date"), "{}: {out}", db.name);
        }
        let v: Value = serde_json::from_slice(&on(&["list", "--json"], 0).stdout).unwrap();
        assert_eq!(v["locks"], json!([]));
    }
}

/// A table made by a team's own tool from `0001_dblock_locks.sql` only: status shows 0001
/// applied and the rest pending; a read names the missing migrations; `migrate` brings it up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_behind_the_library_is_explained_and_migrated() {
    let (dbs, _dir) = common::all("behind").await;
    for db in &dbs {
        let table = common::table_for("behind_0001");
        let (file, name) = match db.name {
            "sqlite" => (
                include_str!("../../dblock/migrations/sqlite/0001_dblock_locks.sql"),
                "sqlite",
            ),
            "mariadb" => (
                include_str!("../../dblock/migrations/mysql/0001_dblock_locks.sql"),
                "mysql",
            ),
            _ => (
                include_str!("../../dblock/migrations/postgres/0001_dblock_locks.sql"),
                "postgres",
            ),
        };
        let ddl = dblock::sqlx::AssertSqlSafe(file.replace("dblock_locks", &table));
        let url = db.direct_url();
        match name {
            "sqlite" => {
                let pool = dblock::sqlx::SqlitePool::connect(&url).await.unwrap();
                dblock::sqlx::raw_sql(ddl).execute(&pool).await.unwrap();
                pool.close().await;
            }
            "mysql" => {
                let pool = dblock::sqlx::MySqlPool::connect(&url).await.unwrap();
                dblock::sqlx::raw_sql(ddl).execute(&pool).await.unwrap();
                pool.close().await;
            }
            _ => {
                let pool = dblock::sqlx::PgPool::connect(&url).await.unwrap();
                dblock::sqlx::raw_sql(ddl).execute(&pool).await.unwrap();
                pool.close().await;
            }
        }

        let out = run_on(db, &table, &["migrate", "status", "--json"]);
        assert_eq!(out.status.code(), Some(0), "{}: {}", db.name, stderr(&out));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            applied(&v),
            [true, false, false, false, false, false, false],
            "{}",
            db.name
        );

        let out = run_on(db, &table, &["list"]);
        assert_eq!(out.status.code(), Some(1), "{}", db.name);
        let err = stderr(&out);
        assert!(
            err.contains(&format!(
                "the lock table \"{table}\" is missing migrations 0002_outcomes, 0003_exactly_once"
            )) && err.contains("migrate"),
            "{}: {err}",
            db.name
        );

        let out = run_on(db, &table, &["migrate"]);
        assert_eq!(out.status.code(), Some(0), "{}: {}", db.name, stderr(&out));
        assert!(
            stdout(&out).contains("applied 0002_outcomes, 0003_exactly_once"),
            "{}: {}",
            db.name,
            stdout(&out)
        );
        assert_eq!(run_on(db, &table, &["list"]).status.code(), Some(0));
    }
}

/// `--pooler` forces pooler mode (simple statements): it works through PgBouncer and against
/// the server itself; without it PgBouncer is found out (every other test runs the plain URL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooler_mode_can_be_forced() {
    let (dbs, _dir) = common::all("pooler").await;
    for db in dbs.iter().filter(|d| d.name.starts_with("postgres")) {
        let g = db.locker.lock("via-pooler").ttl(LONG).await.unwrap();
        let v = expect_json(db, &["--pooler", "list", "--json"], 0);
        assert_eq!(v["locks"][0]["key"], json!("via-pooler"), "{}", db.name);
        let v = expect_json(db, &["list", "--json", "--pooler"], 0);
        assert_eq!(v["locks"][0]["key"], json!("via-pooler"), "{}", db.name);
        expect(db, &["--pooler", "release", "via-pooler"], 0);
        drop(g);
    }
}

#[test]
fn bad_command_lines_exit_2_and_help_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("never.db");
    let url = format!("sqlite://{}?mode=rwc", file.display());
    let long_key = "k".repeat(256);
    for args in [
        &[][..],
        &["bogus"],
        &["show"],
        &["purge", "--older-than", "3x"],
        &["purge", "1d"],
        &["watch", "--interval", "soon"],
        &["watch", "--interval", "0s"],
        &["release", "k", "--json"],
        &["release"],
        &["release", "--owner", "x"],
        &["release", "k", "--holder", "web-3/"],
        &["release", "--holder", ""],
        &["release", "--holder", "/"],
        &["list", "--frobnicate"],
        &["migrate", "sideways"],
        // What the library would refuse is refused here, before any connection.
        &["show", ""],
        &["release", ""],
        &["reset", ""],
        &["steal", ""],
        &["show", &long_key],
        &["steal", "k", "--ttl", "0s"],
        &["steal", "k", "--ttl", "36501d"],
    ] {
        // A database that connecting would create: it is still not there after.
        let out = common::cmd()
            .args(args)
            .env("DATABASE_URL", &url)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stdout(&out).is_empty(), "{args:?}");
        assert!(!file.exists(), "{args:?} connected");
    }
    // The edges that are allowed pass the command line (and fail later, if at all).
    for args in [
        &["show", &"k".repeat(255)][..],
        &["steal", "k", "--ttl", "36500d"],
        &["purge", "--older-than", "110000000d"],
    ] {
        let out = common::cmd()
            .args(args)
            .env("DATABASE_URL", "sqlite::memory:")
            .output()
            .unwrap();
        assert_ne!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
    }
    for args in [&["--help"][..], &["list", "--help"], &["help", "watch"]] {
        let out = common::cmd().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        assert!(stdout(&out).contains("Usage: dblock"), "{args:?}");
    }
    // Global options go before or after the command (docs/cli.md): --version too.
    for args in [
        &["--version"][..],
        &["-V"],
        &["list", "--version"],
        &["watch", "-V"],
    ] {
        let out = common::cmd().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
        // `dblock 0.1.0`; after a command clap names it: `dblock-list 0.1.0`.
        let version = stdout(&out);
        assert!(
            version.starts_with("dblock") && version.trim().ends_with(env!("CARGO_PKG_VERSION")),
            "{args:?}: {version}"
        );
    }
}

#[test]
fn configuration_errors_exit_1() {
    // No database at all.
    let out = common::cmd().arg("list").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("DATABASE_URL"), "{}", stderr(&out));
    // A scheme the library does not know.
    let out = common::cmd()
        .args(["--database-url", "ftp://x", "list"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("unsupported database URL"),
        "{}",
        stderr(&out)
    );
    // A table name that is no identifier.
    let out = common::cmd()
        .args([
            "--database-url",
            "sqlite::memory:",
            "--table",
            "x; DROP",
            "list",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("invalid table name"),
        "{}",
        stderr(&out)
    );
    // `watch` without a terminal (and without --json).
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("w.db").display());
    assert_eq!(
        common::cmd()
            .args(["--database-url", &url, "migrate"])
            .output()
            .unwrap()
            .status
            .code(),
        Some(0)
    );
    let out = common::cmd()
        .args(["--database-url", &url, "watch"])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("needs a terminal"),
        "{}",
        stderr(&out)
    );
}

/// `steal KEY` takes a held key with a larger fencing token and keeps it after the command
/// exits (for --ttl); the old holder has lost it; `release` frees it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steal_takes_a_held_key_and_keeps_it() {
    let (dbs, _dir) = common::all("steal").await;
    for db in &dbs {
        let g = db.locker.lock("runaway").ttl(LONG).await.unwrap();
        let out = expect(db, &["steal", "runaway", "--ttl", "10m"], 0);
        assert!(out.contains("stole \"runaway\""), "{}: {out}", db.name);
        assert!(out.contains("held for 10m"), "{}: {out}", db.name);
        let info = db.locker.inspect("runaway").await.unwrap().unwrap();
        assert!(info.held, "{}: released when the command exited", db.name);
        assert!(info.fencing_token > g.fencing_token(), "{}", db.name);
        assert!(
            info.holder
                .as_deref()
                .is_some_and(|h| h.ends_with("dblock steal")),
            "{}: {:?}",
            db.name,
            info.holder
        );
        assert!(
            info.time_left > Duration::from_secs(9 * 60),
            "{}: {:?}",
            db.name,
            info.time_left
        );
        let e = g.extend(LONG).await.unwrap_err();
        assert!(e.is_lost(), "{}: {e:?}", db.name);
        drop(g);
        expect(db, &["release", "runaway"], 0);
        // A free key is simply taken.
        expect(db, &["steal", "free-key", "--ttl", "1m"], 0);
        assert!(db.locker.inspect("free-key").await.unwrap().unwrap().held);
        expect(db, &["release", "free-key"], 0);
    }
}
