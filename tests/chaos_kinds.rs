//! A chaos run for the other kinds of hold, on PostgreSQL and MariaDB: worker processes (this
//! test binary, on an ignored entry point), each through a fault proxy of its own, take read
//! holds and the write lock of one key, the same key with `lock_in` inside transactions of
//! their own (on the proxied connections too), and permits of a semaphore of 2, while the
//! parent loses replies, drops sends, delays replies past the ttl and blackholes connections.
//! Every worker logs each hold as the span in which it was surely live: a lease from the
//! grant's arrival to the earlier of the release's start and the call's start plus the ttl (a
//! lease ends no earlier: its statement ran after the call began); a `lock_in` from its answer
//! to the start of a commit that succeeded (the server held the row lock from before the
//! answer until the commit; a transaction whose commit failed may have ended any time, and is
//! not logged). The checker then requires, from the logs: never a reader beside a writer or
//! two writers (a transaction's hold counts as a writer), never more than 2 permit holders, and
//! no untyped error. A last test plants each violation and shows the checker catches it.

#![cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(unused))]

mod common;

use std::time::{Duration, Instant};

use common::history::{self, now_us};
use common::proxy::{Mode, Proxy};
use dblock::Locker;

const WORKERS: usize = 3;
const RUN: Duration = Duration::from_secs(12);
const TTL: Duration = Duration::from_secs(2);
const PERMITS: u32 = 2;
/// No fault in the last seconds of the run; then the workers linger so background releases
/// finish on the healed network.
const QUIET: Duration = Duration::from_secs(2);
const LINGER: Duration = Duration::from_secs(3);

#[cfg(not(any(feature = "postgres", feature = "mysql")))]
#[test]
#[ignore = "the chaos run needs `--features postgres` and/or `--features mysql` (or --all-features)"]
fn chaos_needs_a_server_backend() {}

/// The worker: runs only inside a child process (ignored in normal runs).
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "chaos worker entry point, started by the chaos test"]
async fn kinds_worker() {
    let url = std::env::var("DBLOCK_CHAOS_URL").expect("DBLOCK_CHAOS_URL");
    let table = std::env::var("DBLOCK_CHAOS_TABLE").unwrap();
    let log = std::env::var("DBLOCK_CHAOS_LOG").unwrap();
    let options = dblock::ConnectOptions::new()
        .max_connections(2)
        .statement_timeout(Duration::from_secs(4));
    let locker = Locker::connect_with(&url, options)
        .await
        .unwrap()
        .table(&table);
    let pid = std::process::id();
    let line = |text: String| {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&log)
            .unwrap();
        f.write_all(format!("{pid} {text}\n").as_bytes()).unwrap();
    };
    let app = App::connect(&url);
    let end = Instant::now() + RUN;
    while Instant::now() < end {
        let kind = match fastrand::u32(0..12) {
            0..=3 => "read",
            4..=5 => "write",
            6..=7 => "tx",
            _ => "permit",
        };
        let call_us = now_us();
        let wait = Duration::from_secs(3);
        if kind == "tx" {
            match app.hold_in(&locker, wait).await {
                Ok(Some((token, from, to))) => line(format!("HOLD tx {token} {from} {to}")),
                Ok(None) => {}
                Err(e) if pool_exhausted(&e) => {}
                Err(e) => {
                    if let Err(untyped) = history::error_kind(&e) {
                        line(format!("BAD tx {}", untyped.replace(' ', "_")));
                        panic!("untyped lock_in error: {untyped}");
                    }
                }
            }
            continue;
        }
        let taken = match kind {
            "read" => locker.read("doc").ttl(TTL).wait(wait).await,
            "write" => locker.lock("doc").ttl(TTL).wait(wait).await,
            _ => locker.semaphore("pool", PERMITS).ttl(TTL).wait(wait).await,
        };
        match taken {
            Ok(guard) => {
                let from = now_us();
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..40))).await;
                let to = now_us().min(call_us + TTL.as_micros() as i64);
                line(format!("HOLD {kind} {} {from} {to}", guard.fencing_token()));
                let released = guard.release().await;
                if let Err(e) = released {
                    if let Err(untyped) = history::error_kind(&e) {
                        line(format!("BAD release {}", untyped.replace(' ', "_")));
                        panic!("untyped release error: {untyped}");
                    }
                }
            }
            Err(e) if pool_exhausted(&e) => {}
            Err(e) => {
                if let Err(untyped) = history::error_kind(&e) {
                    line(format!("BAD {kind} {}", untyped.replace(' ', "_")));
                    panic!("untyped {kind} error: {untyped}");
                }
            }
        }
    }
    tokio::time::sleep(LINGER).await;
    line("EXIT".into());
}

/// The worker's own application pool (through its proxy, as the locker's), on which it takes the
/// key with `lock_in` in transactions.
#[cfg(any(feature = "postgres", feature = "mysql"))]
enum App {
    #[cfg(feature = "postgres")]
    Pg(sqlx::PgPool),
    #[cfg(feature = "mysql")]
    My(sqlx::MySqlPool),
}

/// One transaction holding the key: `lock_in` within `wait`, a statement of the app's own with
/// the token, a short hold, a commit. Only `lock_in`'s error is the worker's to check: the app's
/// own statements failing under the faults end the transaction (`None`).
macro_rules! hold_in {
    ($pool:expr, $locker:expr, $wait:expr, $prepare:expr, $write:expr) => {{
        let app = async {
            let mut conn = $pool.acquire().await.ok()?;
            sqlx::raw_sql($prepare).execute(&mut *conn).await.ok()?;
            Some(conn)
        };
        let Some(mut conn) = app.await else {
            return Ok(None);
        };
        let Ok(mut tx) = sqlx::Connection::begin(&mut *conn).await else {
            return Ok(None);
        };
        let lock = $locker.lock_in(&mut *tx, "doc").wait($wait).await?;
        let from = now_us();
        let token = lock.fencing_token() as i64;
        if sqlx::query($write)
            .bind(token)
            .execute(&mut *tx)
            .await
            .is_err()
        {
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..40))).await;
        let to = now_us();
        Ok(tx.commit().await.ok().map(|()| (token, from, to)))
    }};
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl App {
    fn connect(url: &str) -> App {
        fn options<DB: sqlx::Database>() -> sqlx::pool::PoolOptions<DB> {
            sqlx::pool::PoolOptions::new()
                .max_connections(2)
                .acquire_timeout(Duration::from_secs(4))
        }
        #[cfg(feature = "postgres")]
        if url.starts_with("postgres") {
            return App::Pg(options().connect_lazy(url).unwrap());
        }
        #[cfg(feature = "mysql")]
        return App::My(options().connect_lazy(url).unwrap());
        #[allow(unreachable_code)]
        {
            unreachable!("no backend for {url}")
        }
    }

    /// A transaction that held the key and committed: its token and the span in which it
    /// surely held it; `None` when its commit failed (or the whole call hung past its bound).
    async fn hold_in(
        &self,
        locker: &Locker,
        wait: Duration,
    ) -> Result<Option<(i64, i64, i64)>, dblock::LockError> {
        let run = async {
            match self {
                // A transaction's statements on the proxied connection may hang with it: the
                // locker's statement timeout bounds `lock_in`, 4 s bound the app's own.
                #[cfg(feature = "postgres")]
                App::Pg(pool) => hold_in!(
                    pool,
                    locker,
                    wait,
                    "SET statement_timeout = 4000",
                    "SELECT $1::bigint"
                ),
                // Half the transactions at READ COMMITTED, where a busy `lock_in` waits for the
                // row; the others at MariaDB's REPEATABLE READ, where it is `Busy` at once.
                #[cfg(feature = "mysql")]
                App::My(pool) => hold_in!(
                    pool,
                    locker,
                    wait,
                    if fastrand::bool() {
                        "SET SESSION max_statement_time = 4; \
                         SET TRANSACTION ISOLATION LEVEL READ COMMITTED"
                    } else {
                        "SET SESSION max_statement_time = 4"
                    },
                    "SELECT ?"
                ),
            }
        };
        match tokio::time::timeout(Duration::from_secs(8), run).await {
            Ok(held) => held,
            Err(_) => Ok(None),
        }
    }
}

/// The worker's pool has two connections, and a fault that delays replies by more than the ttl
/// can keep both busy past the call that used them (sqlx pings each connection on its way back
/// to the pool, and that ping waits for the delayed bytes too). A call then finds the pool
/// exhausted while the server accepts new connections, and says so: `PoolTimedOut`, a typed
/// answer and no broken promise of the kinds (seen once in a full run of the suite,
/// 2026-11-26, on a read). Every other error must still be typed.
fn pool_exhausted(e: &dblock::LockError) -> bool {
    matches!(e, dblock::LockError::Database(sqlx::Error::PoolTimedOut))
}

/// One hold of the history: the kind, and the span in which it was surely live (µs).
#[derive(Debug, Clone, PartialEq)]
struct Span {
    kind: String,
    from: i64,
    to: i64,
}

fn spans(history: &str) -> Vec<Span> {
    history
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f.get(1) == Some(&"HOLD")).then(|| Span {
                kind: f[2].to_owned(),
                from: f[4].parse().unwrap(),
                to: f[5].parse().unwrap(),
            })
        })
        .collect()
}

/// The violations among `spans`: a writer beside a reader or another writer (pairs), and the
/// most permit holders at one instant.
fn violations(spans: &[Span]) -> (usize, usize) {
    let overlap = |a: &Span, b: &Span| a.from < b.to && b.from < a.to;
    let writer = |s: &Span| s.kind == "write" || s.kind == "tx";
    let doc: Vec<&Span> = spans.iter().filter(|s| s.kind != "permit").collect();
    let mut beside = 0;
    for (i, a) in doc.iter().enumerate() {
        for b in &doc[i + 1..] {
            if (writer(a) || writer(b)) && overlap(a, b) {
                beside += 1;
            }
        }
    }
    let mut edges: Vec<(i64, i32)> = spans
        .iter()
        .filter(|s| s.kind == "permit" && s.from < s.to)
        .flat_map(|s| [(s.from, 1), (s.to, -1)])
        .collect();
    edges.sort();
    let (mut now, mut most) = (0, 0);
    for (_, d) in edges {
        now += d;
        most = most.max(now);
    }
    (beside, most as usize)
}

#[test]
fn the_checker_catches_every_planted_violation() {
    let s = |kind: &str, from, to| Span {
        kind: kind.into(),
        from,
        to,
    };
    let clean = vec![
        s("read", 0, 10),
        s("read", 5, 15),
        s("write", 15, 20),
        s("tx", 20, 30),
        s("read", 30, 35),
        s("permit", 0, 10),
        s("permit", 0, 10),
        s("permit", 10, 20),
    ];
    assert_eq!(violations(&clean), (0, 2));
    let mut reader_beside_writer = clean.clone();
    reader_beside_writer.push(s("read", 16, 18));
    assert_eq!(violations(&reader_beside_writer).0, 1);
    let mut two_writers = clean.clone();
    two_writers.push(s("write", 16, 17));
    assert_eq!(violations(&two_writers).0, 1);
    let mut read_in_a_transaction = clean.clone();
    read_in_a_transaction.push(s("read", 29, 31));
    assert_eq!(violations(&read_in_a_transaction).0, 1);
    let mut lease_beside_transaction = clean.clone();
    lease_beside_transaction.push(s("write", 25, 26));
    assert_eq!(violations(&lease_beside_transaction).0, 1);
    let mut two_transactions = clean.clone();
    two_transactions.push(s("tx", 29, 31));
    assert_eq!(violations(&two_transactions).0, 2);
    let mut three_permits = clean;
    three_permits.push(s("permit", 9, 11));
    assert_eq!(violations(&three_permits).1, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_writers_and_permits_keep_their_promises_through_faults() {
    #[allow(unused_mut)]
    let mut targets: Vec<(&str, String)> = Vec::new();
    #[cfg(feature = "postgres")]
    if common::postgres("chaos_kinds").await.is_some() {
        targets.push(("postgres", common::postgres_url()));
    }
    #[cfg(feature = "mysql")]
    if common::mysql("chaos_kinds").await.is_some() {
        targets.push(("mariadb", common::mysql_url()));
    }
    for (name, direct) in targets {
        run(name, &direct).await;
    }
}

async fn run(name: &str, direct: &str) {
    let table = common::table_for("chaos_kinds");
    let observer = Locker::connect(direct).await.unwrap().table(&table);
    observer.migrate().await.unwrap();
    let work = tempfile::tempdir().unwrap();
    let log = work.path().join("history");
    let mut proxies = Vec::new();
    let mut children = Vec::new();
    for _ in 0..WORKERS {
        let proxy = Proxy::start(&common::host_of(direct)).await;
        children.push(
            history::worker_command("kinds_worker", &proxy.url(direct), &table, &log, false)
                .spawn()
                .unwrap(),
        );
        proxies.push(proxy);
    }
    // Faults, one worker at a time, until the quiet end of the run.
    let faults = [
        Mode::HoldReplies,
        Mode::DropSends,
        Mode::DelayReplies(TTL + Duration::from_millis(500)),
        Mode::Blackhole,
    ];
    let start = Instant::now();
    let mut injected = 0;
    while start.elapsed() < RUN - QUIET {
        tokio::time::sleep(Duration::from_millis(fastrand::u64(300..900))).await;
        let proxy = &proxies[fastrand::usize(..WORKERS)];
        let mode = faults[fastrand::usize(..faults.len())];
        proxy.set(mode);
        tokio::time::sleep(Duration::from_millis(fastrand::u64(200..800))).await;
        if mode == Mode::HoldReplies {
            // A lost reply: the held bytes never arrive, the connection breaks.
            proxy.set(Mode::Refuse);
            proxy.reset_all();
        }
        proxy.set(Mode::Pass);
        injected += 1;
    }
    for status in history::wait_all(children).await {
        assert!(status.success(), "{name}: a worker failed: {status:?}");
    }
    let text = std::fs::read_to_string(&log).unwrap();
    history::assert_no_untyped_errors(name, &text);
    let all = spans(&text);
    let count = |k: &str| all.iter().filter(|s| s.kind == k).count();
    let (beside, most) = violations(&all);
    println!(
        "{name}: {injected} faults; {} reads, {} writes, {} transactions, {} permits held; \
         {beside} writer overlaps, at most {most} of {PERMITS} permits at once",
        count("read"),
        count("write"),
        count("tx"),
        count("permit")
    );
    assert_eq!(beside, 0, "{name}: a writer beside another holder");
    assert!(most <= PERMITS as usize, "{name}: {most} permit holders");
    assert!(
        count("read") > 0 && count("write") > 0 && count("tx") > 0 && count("permit") > 0,
        "{name}"
    );
    assert_eq!(
        text.lines().filter(|l| l.ends_with("EXIT")).count(),
        WORKERS,
        "{name}"
    );
}
