//! Shared set-up for the integration tests: one locker per reachable backend, each on a table
//! of its own so tests running in parallel never see each other's rows.

#![allow(dead_code)]

use std::time::Duration;

use dblock::{ConnectOptions, Locker};

pub mod cluster;
pub mod fenced;
pub mod history;
pub mod proxy;

pub const POSTGRES_DEFAULT: &str = "postgres://postgres@127.0.0.1:5432/test";
pub const MYSQL_DEFAULT: &str = "mysql://root@127.0.0.1:3306/test";
/// PgBouncer in transaction pooling mode in front of the PostgreSQL above (`.ci/pgbouncer`).
pub const PGBOUNCER_DEFAULT: &str = "postgres://postgres@127.0.0.1:6432/test";

/// The name of the backend that is PostgreSQL through PgBouncer in transaction pooling mode.
pub const PGBOUNCER: &str = "postgres-pgbouncer";

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

pub fn pgbouncer_url() -> String {
    std::env::var("DBLOCK_PGBOUNCER_URL").unwrap_or_else(|_| PGBOUNCER_DEFAULT.into())
}

/// Whether the backend called `name` in [`all`] is PostgreSQL (directly or through PgBouncer).
pub fn is_postgres(name: &str) -> bool {
    name == "postgres" || name == PGBOUNCER
}

/// How a locker of the backend called `name` connects: with the plain URL, PgBouncer too
/// (the locker finds out that it is a transaction pooler; `tests/poolers.rs`).
pub fn options_for(name: &str) -> ConnectOptions {
    let _ = name;
    ConnectOptions::new()
}

/// Another locker on `db`'s server, connected as the backend's own (pooler mode through
/// PgBouncer, the MySQL 8 statements for "mysql8-path"), on the default table.
pub async fn connect(db: &Db) -> Locker {
    as_named(db.name, connect_patiently(db.name, &db.url).await)
}

/// A locker of the backend called `name` at `url`, asked again while connecting times out for
/// up to 60 s: under a loaded CI machine (chaos runs, trybuild's compiles) the 3 s of the first
/// connection ran out in a child process (a CI run failed so). Any other error panics at once.
pub async fn connect_patiently(name: &str, url: &str) -> Locker {
    let start = std::time::Instant::now();
    loop {
        match Locker::connect_with(url, options_for(name)).await {
            Ok(locker) => return locker,
            Err(dblock::LockError::Database(sqlx::Error::Io(e)))
                if e.kind() == std::io::ErrorKind::TimedOut && start.elapsed().as_secs() < 60 =>
            {
                eprintln!("{name}: connecting again after: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("{name}: connect: {e}"),
        }
    }
}

/// A URL on which a test may run its own prepared statements to look at `db`'s rows: the
/// server itself when `db` goes through PgBouncer (same database, same tables).
pub fn direct_url(db: &Db) -> String {
    if db.name == PGBOUNCER {
        postgres_url()
    } else {
        db.url.clone()
    }
}

/// A pool of the test's own on a backend's URL. For PostgreSQL it leaves out the start-up
/// parameter PgBouncer refuses (sqlx's `extra_float_digits`), so it works through PgBouncer
/// too; a test using it there must then send only simple queries (`sqlx::raw_sql`) outside a
/// transaction.
#[allow(async_fn_in_trait)]
pub trait TestPool: Sized {
    async fn open(url: &str) -> Self;
}

#[cfg(feature = "postgres")]
impl TestPool for sqlx::PgPool {
    async fn open(url: &str) -> Self {
        use std::str::FromStr;
        let options = sqlx::postgres::PgConnectOptions::from_str(url)
            .unwrap()
            .extra_float_digits(None);
        sqlx::postgres::PgPoolOptions::new()
            .connect_with(options)
            .await
            .unwrap()
    }
}

#[cfg(feature = "mysql")]
impl TestPool for sqlx::MySqlPool {
    async fn open(url: &str) -> Self {
        sqlx::MySqlPool::connect(url).await.unwrap()
    }
}

#[cfg(feature = "sqlite")]
impl TestPool for sqlx::SqlitePool {
    async fn open(url: &str) -> Self {
        sqlx::SqlitePool::connect(url).await.unwrap()
    }
}

/// Creates `table` with the first migration only (the schema before `0002_outcomes.sql`), the
/// way a team that ran it with its own tool has it.
pub async fn create_with_0001(db: &Db, table: &str) {
    let file = match db.name {
        "postgres" | PGBOUNCER => {
            include_str!("../../dblock/migrations/postgres/0001_dblock_locks.sql")
        }
        "sqlite" => include_str!("../../dblock/migrations/sqlite/0001_dblock_locks.sql"),
        _ => include_str!("../../dblock/migrations/mysql/0001_dblock_locks.sql"),
    };
    run_sql(db.name, &db.url, &file.replace("dblock_locks", table)).await;
}

/// `host:port` of a database URL (what a fault proxy forwards to).
pub fn host_of(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let after_user = rest.rsplit_once('@').map_or(rest, |(_, hp)| hp);
    after_user
        .split('/')
        .next()
        .unwrap_or(after_user)
        .to_owned()
}

/// `db`'s locker on a fresh table of its own, migrated: for a test whose rows must not meet
/// another backend's ("mysql8-path" shares MariaDB's table) or another test's.
pub async fn own_table(db: &Db, test: &str) -> Locker {
    let l = db.locker.table(&table_for(test));
    l.migrate().await.unwrap();
    l
}

/// A table name unique to this test and process.
pub fn table_for(test: &str) -> String {
    format!("t_{}_{}_{}", test, std::process::id(), fastrand::u32(..))
        .chars()
        .take(60)
        .collect()
}

/// Says something the test harness must not swallow: libtest captures `eprintln!` of passing
/// tests, but not a direct write to the process's stderr.
pub fn shout(msg: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "\n!!!!! {msg}\n");
}

/// Once per test binary: the backends this build leaves out (cargo features), so a
/// default-features `cargo test` says loudly what it did not run.
pub fn report_missing_features() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let missing: Vec<&str> = [
            ("postgres", cfg!(feature = "postgres")),
            ("mysql", cfg!(feature = "mysql")),
            ("sqlite", cfg!(feature = "sqlite")),
        ]
        .into_iter()
        .filter(|(_, on)| !on)
        .map(|(name, _)| name)
        .collect();
        if !missing.is_empty() {
            shout(&format!(
                "SKIPPING the {} backend tests of this binary: dblock was built without {}. \
                 Run `cargo nextest run --workspace --all-features` for every backend.",
                missing.join(" and "),
                missing
                    .iter()
                    .map(|f| format!("the `{f}` feature"))
                    .collect::<Vec<_>>()
                    .join(" and "),
            ));
        }
    });
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn server(name: &'static str, url: String, test: &str) -> Option<Db> {
    let connected = if require_servers() {
        Ok(connect_patiently(name, &url).await)
    } else {
        Locker::connect_with(&url, options_for(name)).await
    };
    match connected {
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

/// `locker` as the backend called `name` in [`all`] runs it (the MySQL 8 statements for
/// "mysql8-path").
pub fn as_named(name: &str, locker: Locker) -> Locker {
    #[cfg(feature = "_test-util")]
    if name == "mysql8-path" {
        return dblock::test_util::mysql8_statements(&locker);
    }
    let _ = name;
    locker
}

/// A SQLite file in a temp dir (kept alive by the returned handle).
#[cfg(feature = "sqlite")]
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

/// PostgreSQL on a fresh table, if this build has the backend and the server is reachable.
pub async fn postgres(test: &str) -> Option<Db> {
    report_missing_features();
    #[cfg(feature = "postgres")]
    return server("postgres", postgres_url(), test).await;
    #[cfg(not(feature = "postgres"))]
    {
        let _ = test;
        None
    }
}

/// PostgreSQL through PgBouncer in transaction pooling mode (`.ci/pgbouncer`), the locker in
/// pooler mode, on a fresh table, if this build has the backend and PgBouncer is reachable.
pub async fn pgbouncer(test: &str) -> Option<Db> {
    report_missing_features();
    #[cfg(feature = "postgres")]
    return server(PGBOUNCER, pgbouncer_url(), test).await;
    #[cfg(not(feature = "postgres"))]
    {
        let _ = test;
        None
    }
}

/// MariaDB on a fresh table, if this build has the backend and the server is reachable.
pub async fn mysql(test: &str) -> Option<Db> {
    report_missing_features();
    #[cfg(feature = "mysql")]
    return server("mariadb", mysql_url(), test).await;
    #[cfg(not(feature = "mysql"))]
    {
        let _ = test;
        None
    }
}

/// Every backend this build has and this machine can reach: SQLite on a temp file, PostgreSQL,
/// PostgreSQL through PgBouncer in transaction pooling mode (the locker in pooler mode),
/// MariaDB with RETURNING, and (with the private `_test-util` feature, as `--all-features`
/// has) MariaDB through the MySQL 8 statements (no RETURNING).
pub async fn all(test: &str) -> (Vec<Db>, tempfile::TempDir) {
    report_missing_features();
    #[allow(unused_mut)]
    let mut dbs = Vec::new();
    #[cfg(feature = "sqlite")]
    let dir = {
        let (lite, dir) = sqlite(test).await;
        dbs.push(lite);
        dir
    };
    #[cfg(not(feature = "sqlite"))]
    let dir = tempfile::tempdir().expect("tempdir");
    if let Some(pg) = postgres(test).await {
        dbs.push(pg);
    }
    if let Some(bouncer) = pgbouncer(test).await {
        dbs.push(bouncer);
    }
    if let Some(my) = mysql(test).await {
        // The MySQL 8 statements, run against MariaDB through a test hook.
        #[cfg(feature = "_test-util")]
        let compat = Db {
            name: "mysql8-path",
            url: my.url.clone(),
            locker: dblock::test_util::mysql8_statements(&my.locker),
        };
        dbs.push(my);
        #[cfg(feature = "_test-util")]
        dbs.push(compat);
    }
    (dbs, dir)
}

/// Polls until `key` is free for a fresh owner, returning how long that took. It watches with
/// reads (`inspect`), not acquire attempts: on SQLite every attempt takes the file's write lock,
/// and a 2 ms stream of them starves the release being measured in SQLite's busy handler.
pub async fn time_until_free(locker: &Locker, key: &str, limit: Duration) -> Option<Duration> {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        let free = locker
            .inspect(key)
            .await
            .expect("inspect")
            .is_none_or(|info| !info.held);
        if free {
            if let Ok(g) = locker.lock(key).await {
                let took = start.elapsed();
                g.release().await.expect("release");
                return Some(took);
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    None
}

/// A child process of the running test binary that runs only its ignored `child_entry` test, as
/// `role`, against `db` (its URL, table and backend in `DBLOCK_CHILD_*`; see [`child_locker`]).
pub fn child_command(db: &Db, role: &str) -> std::process::Command {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "child_entry",
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("DBLOCK_CHILD", role)
    .env("DBLOCK_CHILD_URL", &db.url)
    .env("DBLOCK_CHILD_TABLE", db.locker.table_name())
    .env("DBLOCK_CHILD_BACKEND", db.name);
    cmd
}

/// Inside a child started by [`child_command`]: its role, and a locker as the parent's `db`
/// (same backend and table).
pub async fn child_locker() -> (String, Locker) {
    let role = std::env::var("DBLOCK_CHILD").expect("DBLOCK_CHILD");
    let url = std::env::var("DBLOCK_CHILD_URL").unwrap();
    let table = std::env::var("DBLOCK_CHILD_TABLE").unwrap();
    let name = std::env::var("DBLOCK_CHILD_BACKEND").unwrap();
    let locker = as_named(&name, connect_patiently(&name, &url).await.table(&table));
    (role, locker)
}

/// Waits for `marker` on a child's piped stdout and returns what follows it on that line
/// (libtest may have printed "test child_entry ... " before it).
pub async fn read_marker(child: &mut std::process::Child, marker: &'static str) -> String {
    let stdout = child.stdout.take().expect("the child's stdout is piped");
    tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find_map(|l| l.split_once(marker).map(|(_, rest)| rest.trim().to_owned()))
    })
    .await
    .unwrap()
    .unwrap_or_else(|| panic!("the child never said {marker}"))
}

/// Runs `sql` on the database of the backend called `name` at `url` (a pool of the test's own,
/// [`TestPool`]): a `SELECT`'s one `BIGINT` value, or 0 after any other statements (sent as
/// one simple query, so through PgBouncer too). For set-ups and checks of the tables themselves.
pub async fn run_sql(name: &str, url: &str, sql: &str) -> i64 {
    let sql = sqlx::AssertSqlSafe(sql.to_owned());
    let select = sql.0.starts_with("SELECT");
    macro_rules! on {
        ($pool:ty) => {{
            let pool = <$pool as TestPool>::open(url).await;
            let value = if select {
                sqlx::query_scalar::<_, i64>(sql)
                    .fetch_one(&pool)
                    .await
                    .unwrap()
            } else {
                sqlx::raw_sql(sql).execute(&pool).await.unwrap();
                0
            };
            pool.close().await;
            value
        }};
    }
    match name {
        #[cfg(feature = "sqlite")]
        "sqlite" => on!(sqlx::SqlitePool),
        #[cfg(feature = "postgres")]
        n if is_postgres(n) => on!(sqlx::PgPool),
        #[cfg(feature = "mysql")]
        "mariadb" | "mysql8-path" => on!(sqlx::MySqlPool),
        other => panic!("no backend {other} in this build"),
    }
}
