//! Shared set-up of the `dblock` binary's tests: a locker on a table of the test's own on every
//! backend this machine reaches (as `tests/common/mod.rs` of the library does: the same URLs,
//! `DBLOCK_POSTGRES_URL`, `DBLOCK_PGBOUNCER_URL`, `DBLOCK_MYSQL_URL`, and a loud SKIPPING for a
//! server that is not there, a failure with `DBLOCK_REQUIRE_SERVERS=1`), and ways to run the
//! binary on it.

#![allow(dead_code)]

use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use dblock::Locker;

pub const POSTGRES_DEFAULT: &str = "postgres://postgres@127.0.0.1:5432/test";
pub const MYSQL_DEFAULT: &str = "mysql://root@127.0.0.1:3306/test";
/// PgBouncer in transaction pooling mode in front of the PostgreSQL above (`.ci/pgbouncer`).
pub const PGBOUNCER_DEFAULT: &str = "postgres://postgres@127.0.0.1:6432/test";

/// The backend that is PostgreSQL through PgBouncer, reached with the plain URL: the tool
/// must find out that it is a transaction pooler by itself.
pub const PGBOUNCER: &str = "postgres-pgbouncer";

/// A locker of the test's own on a fresh, migrated table, and how the tool reaches it.
pub struct Db {
    pub name: &'static str,
    pub url: String,
    pub locker: Locker,
}

impl Db {
    pub fn table(&self) -> &str {
        self.locker.table_name()
    }

    /// A URL on which the test may run its own statements on `self`'s database (PgBouncer
    /// refuses sqlx's start-up parameters: its server directly).
    pub fn direct_url(&self) -> String {
        if self.name == PGBOUNCER {
            postgres_url()
        } else {
            self.url.clone()
        }
    }
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

pub fn pgbouncer_url() -> String {
    std::env::var("DBLOCK_PGBOUNCER_URL").unwrap_or_else(|_| PGBOUNCER_DEFAULT.into())
}

/// Says something the test harness must not swallow (libtest captures `eprintln!`).
pub fn shout(msg: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "\n!!!!! {msg}\n");
}

/// A table name unique to this test and process (`t_cli_...`: CI drops `t_%` tables of
/// earlier runs).
pub fn table_for(test: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "t_cli_{test}_{}_{}_{nanos:x}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
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
            shout(&format!(
                "SKIPPING {name} for `{test}`: cannot reach the server ({e}).\n\
                 !!!!! Start it, or set DBLOCK_REQUIRE_SERVERS=1 to make this a failure."
            ));
            None
        }
        Err(e) => panic!("{name} unreachable and DBLOCK_REQUIRE_SERVERS=1: {e}"),
    }
}

/// A SQLite file in a temp dir (kept while the returned handle lives), migrated.
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

/// Every backend this machine reaches: SQLite on a temp file, PostgreSQL, PostgreSQL through
/// PgBouncer in transaction pooling mode (the plain URL), MariaDB.
pub async fn all(test: &str) -> (Vec<Db>, tempfile::TempDir) {
    let (lite, dir) = sqlite(test).await;
    let mut dbs = vec![lite];
    for (name, url) in [
        ("postgres", postgres_url()),
        (PGBOUNCER, pgbouncer_url()),
        ("mariadb", mysql_url()),
    ] {
        if let Some(db) = server(name, url, test).await {
            dbs.push(db);
        }
    }
    (dbs, dir)
}

/// The binary, with no `DATABASE_URL` of the environment the tests run in.
pub fn cmd() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dblock"));
    cmd.env_remove("DATABASE_URL");
    cmd
}

/// Runs the tool on `db`'s database (`DATABASE_URL`) and `table`, whatever its exit status.
pub fn run_on(db: &Db, table: &str, args: &[&str]) -> Output {
    cmd()
        .env("DATABASE_URL", &db.url)
        .args(["--table", table])
        .args(args)
        .output()
        .expect("run dblock")
}

/// Runs the tool on `db`'s table.
pub fn run(db: &Db, args: &[&str]) -> Output {
    run_on(db, db.table(), args)
}

pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs the tool on `db`'s table, checks it exited `code`, returns its stdout.
pub fn expect(db: &Db, args: &[&str], code: i32) -> String {
    let out = run(db, args);
    assert_eq!(
        out.status.code(),
        Some(code),
        "{}: dblock {args:?}: stdout: {}\nstderr: {}",
        db.name,
        stdout(&out),
        stderr(&out)
    );
    stdout(&out)
}

/// Runs the tool on `db`'s table with `--json`-style output, checks it exited `code`, parses
/// its stdout.
pub fn expect_json(db: &Db, args: &[&str], code: i32) -> serde_json::Value {
    let text = expect(db, args, code);
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{}: dblock {args:?}: not JSON ({e}): {text}", db.name))
}

/// An RFC 3339 UTC time as the tool writes it (`2026-11-27T03:20:12.123456Z`), in seconds since
/// the Unix epoch.
pub fn rfc3339_secs(s: &str) -> f64 {
    let b = s.as_bytes();
    assert!(
        s.len() == 27 && b[4] == b'-' && b[10] == b'T' && b[19] == b'.' && s.ends_with('Z'),
        "not an RFC 3339 UTC time with microseconds: {s}"
    );
    let n = |from: usize, to: usize| -> i64 { s[from..to].parse().unwrap() };
    let (y, m, d) = (n(0, 4), n(5, 7), n(8, 10));
    // Days from the civil date (proleptic Gregorian), counting from 1970-01-01.
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + n(11, 13) * 3600 + n(14, 16) * 60 + n(17, 19);
    secs as f64 + n(20, 26) as f64 / 1e6
}

/// A `SystemTime` in seconds since the Unix epoch.
pub fn secs(t: std::time::SystemTime) -> f64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}
