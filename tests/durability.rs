//! Lazily durable releases (the default, `ConnectOptions::durable_release(false)`) across a
//! crash: a crash may lose releases, which leaves their keys held by the old owner until the
//! lease ends, and never a grant or a fencing token.
//!
//! - PostgreSQL: a cluster of the test's own (never the shared server), with
//!   `wal_writer_delay = 10s`, so nothing flushes the releases' WAL in the background: what a
//!   crash (`pg_ctl stop -m immediate`) finds unflushed is exactly what it loses. Owners cycle
//!   lock/unlock on a few keys while the server is crashed under them, then it recovers.
//! - SQLite: a child process cycles on a file and is killed with SIGKILL mid-cycle.
//!
//! The checker, per key: the row's token is at least every token a `lock()` returned (no
//! acknowledged grant lost); a row still held belongs to an owner that was given (or was being
//! given) exactly that tenure, and stays held only until its lease ends; the next owner's token
//! is larger than every token ever returned (none reused).

// A build with only one of the two backends has only one of the crash tests.
#![cfg_attr(not(all(feature = "postgres", feature = "sqlite")), allow(unused))]

mod common;

use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, SystemTime};

use dblock::{LockError, Locker, Owner};

const KEYS: usize = 6;
const TTL: Duration = Duration::from_secs(3);

/// What the owners did: per key, the tokens `lock()` returned, and every owner that tried.
#[derive(Default, Debug)]
struct History {
    /// key → (owner, token) of every acknowledged grant.
    granted: HashMap<String, Vec<(String, u64)>>,
    /// Owners that sent an acquire (acknowledged or not).
    tried: Vec<String>,
    /// Acknowledged releases.
    released: usize,
}

impl History {
    fn parse(text: &str) -> History {
        let mut h = History::default();
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            match f.as_slice() {
                ["TRY", owner] => h.tried.push(owner.to_string()),
                ["GOT", key, owner, token] => h
                    .granted
                    .entry(key.to_string())
                    .or_default()
                    .push((owner.to_string(), token.parse().unwrap())),
                ["REL", ..] => h.released += 1,
                _ => {}
            }
        }
        h
    }
}

/// PostgreSQL: from now on, every write to `table` also records the hold count it left, the
/// `synchronous_commit` its transaction committed with and the server process that ran it. A
/// deferred trigger: it runs at commit, after the whole statement (the release statement turns
/// the setting off in its last step), so it sees what the commit itself saw.
#[cfg(feature = "postgres")]
async fn record_synchronous_commit(pool: &sqlx::PgPool, table: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {table}_sync (n serial PRIMARY KEY, hold_count int, sync text, pid int);
         CREATE FUNCTION {table}_sync() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           INSERT INTO {table}_sync (hold_count, sync, pid)
           VALUES (NEW.hold_count, current_setting('synchronous_commit'), pg_backend_pid());
           RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER {table}_sync AFTER INSERT OR UPDATE ON {table}
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {table}_sync();"
    )))
    .execute(pool)
    .await
    .unwrap();
}

/// Everything [`record_synchronous_commit`] recorded, oldest first: (hold count left,
/// `synchronous_commit`, server pid). Read-only, so it commits nothing that would flush the WAL.
#[cfg(feature = "postgres")]
async fn recorded(pool: &sqlx::PgPool, table: &str) -> Vec<(i32, String, i32)> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT hold_count, sync, pid FROM {table}_sync ORDER BY n"
    )))
    .fetch_all(pool)
    .await
    .unwrap()
}

/// (hold count, setting) of each recorded write, without the pid.
#[cfg(feature = "postgres")]
fn settings(rows: &[(i32, String, i32)]) -> Vec<(i32, &str)> {
    rows.iter().map(|(n, s, _)| (*n, s.as_str())).collect()
}

#[cfg(feature = "postgres")]
/// Cycles lock/unlock on the keys as fresh owners until `until`, logging each step; stops at
/// the first error (the server went away).
async fn cycle(locker: Locker, worker: usize, log: std::sync::Arc<std::sync::Mutex<String>>) {
    let mut i = worker;
    loop {
        let key = format!("key{}", i % KEYS);
        i += 1;
        let owner = Owner::new();
        log.lock().unwrap().push_str(&format!("TRY {owner}\n"));
        let g = match locker
            .lock(&key)
            .owner(&owner)
            .ttl(TTL)
            .wait(Duration::from_millis(200))
            .await
        {
            Ok(g) => g,
            Err(LockError::Busy { .. }) => continue,
            Err(_) => return,
        };
        log.lock()
            .unwrap()
            .push_str(&format!("GOT {key} {owner} {}\n", g.fencing_token()));
        if g.release().await.is_err() {
            return;
        }
        log.lock().unwrap().push_str(&format!("REL {key}\n"));
    }
}

/// The checker (see the module docs). Returns how many keys a crash left held.
async fn check(name: &str, locker: &Locker, history: &History, min_grants: usize) -> usize {
    assert!(
        history.granted.values().map(Vec::len).sum::<usize>() >= min_grants,
        "{name}: too few grants before the crash to say anything: {history:?}"
    );
    let mut left_held = 0;
    for (key, grants) in &history.granted {
        let newest = grants.iter().map(|g| g.1).max().unwrap();
        let info = locker
            .inspect(key)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{name}: the row of {key} is gone: a grant was lost"));
        assert!(
            info.fencing_token >= newest,
            "{name}: {key}: an acknowledged grant was lost: token {newest} was returned, \
             the row says {}",
            info.fencing_token
        );
        if info.held {
            left_held += 1;
            let owner = info.owner.clone().unwrap();
            assert!(
                history.tried.contains(&owner),
                "{name}: {key} is held by an owner nobody used: {info:?}"
            );
            // Held only until its lease ends: then anyone takes it.
            let left = info
                .expires_at
                .duration_since(SystemTime::now())
                .unwrap_or_default();
            assert!(
                left <= TTL,
                "{name}: {key}: lease longer than the ttl: {info:?}"
            );
        }
        // The next owner: at once if free, otherwise once the lease has ended; its token is
        // larger than every token returned before the crash.
        let next = locker
            .lock(key.as_str())
            .wait(TTL + Duration::from_secs(3))
            .await
            .unwrap_or_else(|e| panic!("{name}: {key} did not become free after its ttl: {e}"));
        assert!(
            next.fencing_token() > newest.max(info.fencing_token),
            "{name}: {key}: token {} reused or older than {newest}",
            next.fencing_token()
        );
        next.release().await.unwrap();
    }
    left_held
}

#[cfg(not(feature = "postgres"))]
#[test]
#[ignore = "the PostgreSQL crash test needs `--features postgres` (or --all-features)"]
fn postgres_crash_needs_the_postgres_feature() {}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_crash_loses_at_most_releases() {
    let Some(pg) = common::cluster::PrivatePg::start(
        "the PostgreSQL crash test",
        &["wal_writer_delay = '10s'"],
    ) else {
        return;
    };
    let locker = Locker::connect(&pg.url()).await.unwrap();
    locker.migrate().await.unwrap();
    let probe = sqlx::PgPool::connect(&pg.url()).await.unwrap();
    record_synchronous_commit(&probe, locker.table_name()).await;

    // 1. Deterministic: every key granted (durable), then released (lazily), then a crash.
    let mut held = Vec::new();
    let mut log = String::new();
    for k in 0..KEYS {
        let owner = Owner::new();
        let g = locker
            .lock(format!("key{k}"))
            .owner(&owner)
            .ttl(TTL)
            .await
            .unwrap();
        log.push_str(&format!(
            "TRY {owner}\nGOT {} {owner} {}\n",
            g.key(),
            g.fencing_token()
        ));
        held.push(g);
    }
    for g in held {
        g.release().await.unwrap();
    }
    // The lazy path really ran: each grant committed with synchronous_commit on, each release
    // with it off. (How many releases the crash then loses depends on when the WAL writer
    // woke, so that count is only reported.) Nothing durable may commit between the releases
    // and the crash: its flush would cover them.
    let written = recorded(&probe, locker.table_name()).await;
    let mut expected = vec![(1, "on"); KEYS];
    expected.extend(vec![(0, "off"); KEYS]);
    assert_eq!(settings(&written), expected, "{written:?}");
    probe.close().await;
    pg.crash();
    pg.restart();
    let left = check(
        "postgres, release then crash",
        &locker,
        &History::parse(&log),
        KEYS,
    )
    .await;
    eprintln!("postgres, release then crash: {left} of {KEYS} releases lost, every grant kept");

    // 2. Owners cycling while the server crashes under them.
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let workers: Vec<_> = (0..4)
        .map(|w| tokio::spawn(cycle(locker.clone(), w, log.clone())))
        .collect();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    pg.crash();
    for w in workers {
        w.await.unwrap();
    }
    pg.restart();
    let history = History::parse(&log.lock().unwrap());
    let left = check("postgres, crash under load", &locker, &history, 20).await;
    eprintln!(
        "postgres, crash under load: {} grants and {} releases acknowledged; {left} keys left \
         held until their ttl (releases lost), no grant lost",
        history.granted.values().map(Vec::len).sum::<usize>(),
        history.released
    );
}

/// PostgreSQL (the shared server, directly and through PgBouncer): a grant commits with
/// `synchronous_commit` on and a release with it off, or on with `durable_release(true)`; and
/// the setting belongs to the release's own transaction: on a pool of one connection, that
/// connection is back at `on` right after a release that ran on it with `off`, and the next
/// grant on it commits durably.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_releases_alone_commit_lazily_and_leak_nothing() {
    use common::TestPool;
    let (dbs, _dir) = common::all("durability_sync").await;
    for db in dbs.iter().filter(|d| common::is_postgres(d.name)) {
        let table = common::table_for("sync");
        let lazy = db.locker.table(&table);
        lazy.migrate().await.unwrap();
        let direct = <sqlx::PgPool as TestPool>::open(&common::direct_url(db)).await;
        record_synchronous_commit(&direct, &table).await;

        lazy.lock("k").await.unwrap().release().await.unwrap();
        let written = recorded(&direct, &table).await;
        assert_eq!(
            settings(&written[..]),
            [(1, "on"), (0, "off")],
            "{}: {written:?}",
            db.name
        );

        let options = common::options_for(db.name).durable_release(true);
        let durable = Locker::connect_with(&db.url, options)
            .await
            .unwrap()
            .table(&table);
        durable.lock("k").await.unwrap().release().await.unwrap();
        let written = recorded(&direct, &table).await;
        assert_eq!(
            settings(&written[2..]),
            [(1, "on"), (0, "on")],
            "{}: durable_release(true): {written:?}",
            db.name
        );

        // Through PgBouncer a client connection has no server session of its own to look at.
        if db.name != "postgres" {
            continue;
        }
        let one = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&db.url)
            .await
            .unwrap();
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&one)
            .await
            .unwrap();
        let mine = Locker::postgres(one.clone()).table(&table);
        for round in 0..2 {
            mine.lock("k").await.unwrap().release().await.unwrap();
            let sync: String = sqlx::query_scalar("SHOW synchronous_commit")
                .fetch_one(&one)
                .await
                .unwrap();
            assert_eq!(
                sync, "on",
                "round {round}: the release's setting stayed on its pooled connection"
            );
        }
        let written = recorded(&direct, &table).await;
        let written = &written[4..];
        assert_eq!(
            settings(written),
            [(1, "on"), (0, "off"), (1, "on"), (0, "off")],
            "{written:?}"
        );
        assert!(
            written.iter().all(|(_, _, p)| *p == pid),
            "not all on the pool's one connection {pid}: {written:?}"
        );
    }
}

/// The SQLite child: cycles on the file until killed, logging each step to a file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "child process entry point, started by the SQLite crash test"]
async fn sqlite_child() {
    let url = std::env::var("DBLOCK_DURABILITY_URL").expect("DBLOCK_DURABILITY_URL");
    let path = std::env::var("DBLOCK_DURABILITY_LOG").unwrap();
    let locker = Locker::connect(&url).await.unwrap();
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap();
    let mut i = 0;
    loop {
        let key = format!("key{}", i % KEYS);
        i += 1;
        let owner = Owner::new();
        file.write_all(format!("TRY {owner}\n").as_bytes()).unwrap();
        let Ok(g) = locker.lock(&key).owner(&owner).ttl(TTL).await else {
            continue;
        };
        file.write_all(format!("GOT {key} {owner} {}\n", g.fencing_token()).as_bytes())
            .unwrap();
        g.release().await.unwrap();
        file.write_all(format!("REL {key}\n").as_bytes()).unwrap();
    }
}

/// A holder killed mid-cycle loses no grant and leaves no key held past its ttl.
///
/// SIGKILL cannot lose a lazily durable release here: `synchronous = NORMAL` only skips the
/// fsync, every commit is still written into the WAL file, and the kernel's page cache outlives
/// the killed process (only an OS crash or a power cut drops it). So this test never sees a
/// lost release; that releases really skip their fsync is checked by
/// `sqlite_releases_alone_run_at_synchronous_normal`.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_holder_killed_mid_cycle_loses_no_grant() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("locks.db").display()
    );
    let locker = Locker::connect(&url).await.unwrap();
    locker.migrate().await.unwrap();
    let log = dir.path().join("history");
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["sqlite_child", "--exact", "--ignored", "--test-threads=1"])
        .env("DBLOCK_DURABILITY_URL", &url)
        .env("DBLOCK_DURABILITY_LOG", &log)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Until it has done enough, then SIGKILL mid-cycle.
    let started = std::time::Instant::now();
    while std::fs::read_to_string(&log)
        .map(|t| t.matches("GOT").count())
        .unwrap_or(0)
        < 200
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "child too slow"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let history = History::parse(&std::fs::read_to_string(&log).unwrap());
    let left = check("sqlite, holder killed", &locker, &history, 200).await;
    eprintln!(
        "sqlite, holder killed: {} grants, {} releases acknowledged; {left} keys left held until their ttl",
        history.granted.values().map(Vec::len).sum::<usize>(),
        history.released
    );
}

/// SQLite: the `PRAGMA synchronous` of the connection that ran each write to `table`, recorded
/// by triggers (pragma_synchronous reads the connection's own setting).
#[cfg(feature = "sqlite")]
async fn record_synchronous(pool: &sqlx::SqlitePool, table: &str) {
    let record = |event: &str| {
        format!(
            "CREATE TRIGGER {table}_sync_{event} AFTER {event} ON {table} BEGIN
               INSERT INTO {table}_sync (hold_count, sync)
               SELECT NEW.hold_count, synchronous FROM pragma_synchronous;
             END;"
        )
    };
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {table}_sync (n INTEGER PRIMARY KEY, hold_count INTEGER, sync INTEGER);
         {}{}",
        record("INSERT"),
        record("UPDATE")
    )))
    .execute(pool)
    .await
    .unwrap();
}

/// What [`record_synchronous`] recorded since the last call, oldest first: (hold count left,
/// `synchronous`: 1 NORMAL, 2 FULL).
#[cfg(feature = "sqlite")]
async fn recorded_synchronous(pool: &sqlx::SqlitePool, table: &str) -> Vec<(i64, i64)> {
    let rows = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT hold_count, sync FROM {table}_sync ORDER BY n"
    )))
    .fetch_all(pool)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM {table}_sync")))
        .execute(pool)
        .await
        .unwrap();
    rows
}

/// SQLite: `Locker::connect` grants on connections at `synchronous = FULL` (2) and releases on
/// connections of their own at NORMAL (1), or at FULL with `durable_release(true)`.
/// `Locker::sqlite(pool)` runs both on the caller's connections, at the caller's setting, and
/// leaves it as it was.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_releases_alone_run_at_synchronous_normal() {
    let (db, _dir) = common::sqlite("durability_sync").await;
    let table = db.locker.table_name();
    let pool = sqlx::SqlitePool::connect(&db.url).await.unwrap();
    record_synchronous(&pool, table).await;

    for _ in 0..2 {
        db.locker.lock("k").await.unwrap().release().await.unwrap();
    }
    // The first grant inserts the row, the second updates it.
    assert_eq!(
        recorded_synchronous(&pool, table).await,
        [(1, 2), (0, 1), (1, 2), (0, 1)]
    );

    let options = dblock::ConnectOptions::new().durable_release(true);
    let durable = Locker::connect_with(&db.url, options)
        .await
        .unwrap()
        .table(table);
    durable.lock("k").await.unwrap().release().await.unwrap();
    assert_eq!(recorded_synchronous(&pool, table).await, [(1, 2), (0, 2)]);

    let one = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(
            <sqlx::sqlite::SqliteConnectOptions as std::str::FromStr>::from_str(&db.url)
                .unwrap()
                .synchronous(sqlx::sqlite::SqliteSynchronous::Normal),
        )
        .await
        .unwrap();
    let mine = Locker::sqlite(one.clone()).table(table);
    mine.lock("k").await.unwrap().release().await.unwrap();
    assert_eq!(recorded_synchronous(&pool, table).await, [(1, 1), (0, 1)]);
    let left: i64 = sqlx::query_scalar("PRAGMA synchronous")
        .fetch_one(&one)
        .await
        .unwrap();
    assert_eq!(left, 1, "the caller's connection was changed");
}
