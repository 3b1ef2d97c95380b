//! Part 7 of the benchmark, **series** (`DBLOCK_BENCH_PARTS=series`; it runs only when named):
//! the figures `docs/benchmarks.md` gives, each as a Markdown table with its method and as an
//! SVG chart, written to `benches/results/series.md` and `benches/results/series-*.svg`.
//!
//! - (a) [`uncontended`]: one owner's lock + release, p50/p99, against one raw round trip
//!   (`SELECT 1`) on a pool of the same kind;
//! - (b) [`throughput`]: distinct-key cycles/s at 1 to 1,000 owners, coalesced and
//!   `coalesce(false)`, beside pgbench, the servers' session locks and Redis;
//! - (c) [`handoff`]: release → the next waiter's grant on one contended key, waiters in one
//!   process and in separate processes;
//! - (d) [`crash`]: a holder process killed → a waiter's grant (ttl 5 s);
//! - (e) [`dead_waiter`]: what a killed `fair()` waiter's ticket costs the next waiter;
//! - (f) [`leader`]: `resign()` → the other process's `campaign()` returning, and `observe()`
//!   seeing it.
//!
//! Backends: SQLite (a file), PostgreSQL, PostgreSQL through PgBouncer (transaction mode),
//! MariaDB; `DBLOCK_BENCH_ONLY` limits them as for the other parts (`redis` for the Redis
//! peer). `DBLOCK_BENCH_SERIES=a,b` runs only those series, `DBLOCK_BENCH_OWNERS=1,8` only
//! those owner counts in (b). `DBLOCK_BENCH_SECS` (default 5) scales the measured time of (a),
//! (b) and (c) and the repetitions of (d), (e) and (f); the whole part takes about 8 minutes at
//! the default.
//! Processes that must die or wait apart are this benchmark binary, started with
//! `DBLOCK_BENCH_SERIES_CHILD` set ([`child::child`]).

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use dblock::{ConnectOptions, LockError, Locker};

mod chart;
pub(crate) mod child;
mod crash;
mod dead_waiter;
mod handoff;
mod leader;
mod throughput;
mod uncontended;

/// The series' own lock table (and its `_queue`), dropped at the start of a run.
pub(crate) const TABLE: &str = "dblock_bench_series";

/// A backend the series run on.
#[derive(Clone)]
pub(crate) struct Target {
    pub(crate) name: &'static str,
    pub(crate) url: String,
    /// PostgreSQL through a transaction pooler: `pooler(true)`.
    pub(crate) pooler: bool,
    /// Where the table is dropped and its queue read: the server itself (PgBouncer's target
    /// reaches the same database through the pooler).
    pub(crate) direct: String,
}

impl Target {
    /// The defaults, and `pooler(true)` through PgBouncer.
    pub(crate) fn options(&self) -> ConnectOptions {
        if self.pooler {
            ConnectOptions::new().pooler(true)
        } else {
            ConnectOptions::new()
        }
    }

    /// A locker of its own (its own pool) on the series' table, migrated: the table is made
    /// again should something else have dropped it meanwhile (on a shared test server, a
    /// run once lost it between two series).
    pub(crate) async fn locker(&self) -> Result<Locker, LockError> {
        let locker = Locker::connect_with(&self.url, self.options())
            .await?
            .table(TABLE);
        locker.migrate().await?;
        Ok(locker)
    }

    pub(crate) fn is_postgres(&self) -> bool {
        self.direct.starts_with("postgres")
    }
}

/// The servers' URLs, as the other parts take them.
pub(crate) struct Urls {
    pub(crate) postgres: String,
    pub(crate) pgbouncer: String,
    pub(crate) mysql: String,
    pub(crate) redis: String,
}

/// The `p` quantile (nearest rank) of `v`; 0 when empty.
pub(crate) fn pct(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v.get(i).copied().unwrap_or_default()
}

pub(crate) fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

/// Milliseconds with the precision their size needs.
pub(crate) fn ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0} ms")
    } else if v >= 10.0 {
        format!("{v:.1} ms")
    } else {
        format!("{v:.2} ms")
    }
}

pub(crate) fn ms_of(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The results: printed as they come and kept for `series.md`, which is rewritten after each
/// series (a run cut short keeps what it measured).
pub(crate) struct Report {
    head: String,
    body: String,
    /// A short run (`DBLOCK_BENCH_SECS` < 5): its charts say so too.
    short: bool,
}

const RESULTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/results");

impl Report {
    pub(crate) fn section(&mut self, title: &str, method: &str) {
        println!();
        println!("## {title}");
        println!();
        println!("{method}");
        println!();
        let _ = write!(self.body, "\n## {title}\n\n{method}\n\n");
    }

    pub(crate) fn header(&mut self, columns: &[&str]) {
        let line = format!(
            "| {} |\n|{}",
            columns.join(" | "),
            "---|".repeat(columns.len())
        );
        println!("{line}");
        self.body.push_str(&line);
        self.body.push('\n');
    }

    pub(crate) fn row(&mut self, cells: &[String]) {
        let line = format!("| {} |", cells.join(" | "));
        println!("{line}");
        self.body.push_str(&line);
        self.body.push('\n');
    }

    pub(crate) fn note(&mut self, text: &str) {
        println!();
        println!("{text}");
        let _ = write!(self.body, "\n{text}\n");
    }

    /// Writes the chart and links it below the table.
    pub(crate) fn chart(&mut self, file: &str, svg: &str) {
        std::fs::create_dir_all(RESULTS).unwrap();
        let path = format!("{RESULTS}/{file}");
        let svg = if self.short {
            chart::mark_short(svg)
        } else {
            svg.to_owned()
        };
        std::fs::write(&path, svg).unwrap();
        println!();
        println!("Chart written to {path}");
        let _ = write!(self.body, "\n![{file}]({file})\n");
        self.save();
    }

    fn save(&self) {
        std::fs::create_dir_all(RESULTS).unwrap();
        std::fs::write(
            format!("{RESULTS}/series.md"),
            format!("{}{}", self.head, self.body),
        )
        .unwrap();
    }
}

/// PostgreSQL (the test server runs with `autovacuum = off`): `VACUUM` of the series' table
/// and queue, outside any timing, so earlier rows' dead versions do not slow what follows.
pub(crate) async fn vacuum(target: &Target) {
    if !target.is_postgres() {
        return;
    }
    let vacuumed = async {
        let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&target.direct).await?;
        // One statement per query: several would run as one transaction, where VACUUM cannot.
        for table in [TABLE.to_owned(), format!("{TABLE}_queue")] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("VACUUM {table}")))
                .execute(&mut conn)
                .await?;
        }
        sqlx::Connection::close(conn).await
    };
    if let Err(e) = vacuumed.await {
        eprintln!("{}: VACUUM {TABLE}: {e}", target.name);
    }
}

/// The series named in `DBLOCK_BENCH_SERIES` (all by default).
fn wanted(letter: &str) -> bool {
    std::env::var("DBLOCK_BENCH_SERIES").map_or(true, |s| s.split(',').any(|x| x == letter))
}

/// Part 7: every series on every backend `only` lets through.
pub(crate) async fn series(urls: &Urls, only: &dyn Fn(&str) -> bool, secs: f64) {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let sqlite = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("series.db").display()
    );
    let candidates = [
        ("sqlite", sqlite.clone(), false, sqlite.clone()),
        (
            "postgres",
            urls.postgres.clone(),
            false,
            urls.postgres.clone(),
        ),
        (
            "postgres-pgbouncer",
            urls.pgbouncer.clone(),
            true,
            urls.postgres.clone(),
        ),
        ("mariadb", urls.mysql.clone(), false, urls.mysql.clone()),
    ];
    let mut targets = Vec::new();
    let mut skipped = Vec::new();
    let mut dropped = Vec::new();
    for (name, url, pooler, direct) in candidates {
        if !only(name) {
            continue;
        }
        let target = Target {
            name,
            url,
            pooler,
            direct,
        };
        // Reachable? (Dropping the table would panic on a server that is not.)
        if let Err(e) = Locker::connect_with(&target.url, target.options()).await {
            skipped.push(format!("{name}: {e}"));
            continue;
        }
        if !dropped.contains(&target.direct) {
            crate::drop_table(&target.direct, TABLE).await;
            dropped.push(target.direct.clone());
        }
        if let Err(e) = target.locker().await {
            skipped.push(format!("{name}: {e}"));
            continue;
        }
        targets.push(target);
    }
    let redis = only("redis").then_some(urls.redis.as_str());

    let mut report = Report {
        head: head(&targets, redis, secs).await,
        body: String::new(),
        short: secs < 5.0,
    };
    print!("{}", report.head);
    for s in &skipped {
        report.note(&format!("Skipped {s}"));
    }
    report.save();

    let mut took = Vec::new();
    let mut timed = Instant::now();
    let mut lap = |letter: &str, took: &mut Vec<String>| {
        took.push(format!("({letter}) {:.0} s", timed.elapsed().as_secs_f64()));
        timed = Instant::now();
    };
    if wanted("a") {
        uncontended::run(&targets, &mut report, secs).await;
        lap("a", &mut took);
    }
    if wanted("b") {
        throughput::run(&targets, redis, &mut report, secs).await;
        lap("b", &mut took);
    }
    if wanted("c") {
        handoff::run(&targets, redis, &mut report, secs).await;
        lap("c", &mut took);
    }
    if wanted("d") {
        crash::run(&targets, &mut report, secs).await;
        lap("d", &mut took);
    }
    if wanted("e") {
        dead_waiter::run(&targets, &mut report, secs).await;
        lap("e", &mut took);
    }
    if wanted("f") {
        leader::run(&targets, &mut report, secs).await;
        lap("f", &mut took);
    }
    report.note(&format!(
        "The run took {:.0} s: {}.",
        started.elapsed().as_secs_f64(),
        took.join(", ")
    ));
    report.save();
    println!();
    println!("Tables written to {RESULTS}/series.md");
}

/// The file's head: machine, date, servers, command.
async fn head(targets: &[Target], redis: Option<&str>, secs: f64) -> String {
    let mut h = String::from("# dblock benchmark series\n\n");
    let _ = writeln!(h, "- Machine: {}", machine());
    let _ = writeln!(
        h,
        "- Date: {}",
        command_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"])
    );
    for v in versions(targets, redis).await {
        let _ = writeln!(h, "- {v}");
    }
    let mut env = String::from("DBLOCK_BENCH_PARTS=series");
    for var in ["DBLOCK_BENCH_SERIES", "DBLOCK_BENCH_ONLY"] {
        if let Ok(v) = std::env::var(var) {
            let _ = write!(env, " {var}={v}");
        }
    }
    let _ = writeln!(
        h,
        "- Command: `{env} DBLOCK_BENCH_SECS={secs} cargo bench -p dblock-bench --bench lock_cycle` \
         (release build; the benchmark's tokio runtime has 2 worker threads)"
    );
    let _ = writeln!(
        h,
        "- Percentiles are nearest-rank over all samples of a cell; latencies in milliseconds."
    );
    if secs < 5.0 {
        let _ = writeln!(
            h,
            "- **A short run** (`DBLOCK_BENCH_SECS` {secs} < 5): figures to check the harness \
             by, not to publish."
        );
    }
    h
}

fn command_line(cmd: &str, args: &[&str]) -> String {
    std::process::Command::new(cmd)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|e| format!("({cmd}: {e})"))
}

/// `lscpu`'s model name and counts, the memory and the kernel.
fn machine() -> String {
    let lscpu = command_line("lscpu", &[]);
    let field = |name: &str| {
        lscpu
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == name).then(|| v.trim().to_owned())
            })
            .unwrap_or_else(|| "?".into())
    };
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            let kb: f64 = m
                .lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()?;
            Some(format!("{:.1} GiB RAM", kb / 1024.0 / 1024.0))
        })
        .unwrap_or_default();
    format!(
        "{} ({} CPUs: {} socket(s) × {} core(s) × {} thread(s)), {mem}, Linux {}",
        field("Model name"),
        field("CPU(s)"),
        field("Socket(s)"),
        field("Core(s) per socket"),
        field("Thread(s) per core"),
        command_line("uname", &["-r"])
    )
}

/// The servers' versions and the settings the figures depend on.
async fn versions(targets: &[Target], redis: Option<&str>) -> Vec<String> {
    let mut out = Vec::new();
    for t in targets {
        let v: Result<String, sqlx::Error> = async {
            match t.name {
                "sqlite" => {
                    let mut c = <sqlx::SqliteConnection as sqlx::Connection>::connect(&t.url).await?;
                    let v: String = sqlx::query_scalar("SELECT sqlite_version()")
                        .fetch_one(&mut c)
                        .await?;
                    Ok(format!(
                        "SQLite {v} (sqlx's bundled library; a file in a temporary directory, WAL)"
                    ))
                }
                "postgres" => {
                    let mut c = <sqlx::PgConnection as sqlx::Connection>::connect(&t.url).await?;
                    let mut v = Vec::new();
                    for what in ["server_version", "max_connections", "synchronous_commit", "fsync", "autovacuum"] {
                        let s: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SHOW {what}")))
                            .fetch_one(&mut c)
                            .await?;
                        v.push(s);
                    }
                    Ok(format!(
                        "PostgreSQL {} (max_connections {}, synchronous_commit {}, fsync {}, autovacuum {}: \
                         the series' table is vacuumed before each series and each round of (b))",
                        v[0], v[1], v[2], v[3], v[4]
                    ))
                }
                "postgres-pgbouncer" => Ok(format!(
                    "PgBouncer in transaction mode in front of the same PostgreSQL (at {}); dblock with `pooler(true)`",
                    t.url.rsplit('@').next().unwrap_or("?")
                )),
                _ => {
                    let mut c = <sqlx::MySqlConnection as sqlx::Connection>::connect(&t.url).await?;
                    let v: String = sqlx::query_scalar("SELECT VERSION()")
                        .fetch_one(&mut c)
                        .await?;
                    let flush: String =
                        sqlx::query_scalar("SELECT CAST(@@innodb_flush_log_at_trx_commit AS CHAR)")
                            .fetch_one(&mut c)
                            .await?;
                    Ok(format!(
                        "MariaDB {v} (innodb_flush_log_at_trx_commit {flush})"
                    ))
                }
            }
        }
        .await;
        out.push(v.unwrap_or_else(|e| format!("{}: version unknown ({e})", t.name)));
    }
    if let Some(url) = redis {
        let v: Result<String, redis::RedisError> = async {
            let client = redis::Client::open(url)?;
            let mut conn = client.get_multiplexed_async_connection().await?;
            let info: String = redis::cmd("INFO")
                .arg("server")
                .query_async(&mut conn)
                .await?;
            Ok(info
                .lines()
                .find_map(|l| l.strip_prefix("redis_version:"))
                .unwrap_or("?")
                .trim()
                .to_owned())
        }
        .await;
        out.push(match v {
            Ok(v) => format!("Redis {v} (one server, default persistence settings)"),
            Err(e) => format!("Redis: version unknown ({e})"),
        });
    }
    out
}
