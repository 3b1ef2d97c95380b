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
//!
//! A second run, through the same faults, mixes leases, **steals** and `lock_in` transactions of
//! one key, each writing its fencing token into a table of the app's in a transaction that fences
//! it (a steal, or a lease running out, may land between a holder's grant and its fence, or while
//! its transaction is open): the committed writes' tokens must only grow in the order they were
//! written (the table's key, taken after the fence). A stolen holder's spans would overlap its
//! stealer's by design; what steal promises is this order.

#![cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(unused))]

mod common;

use std::time::{Duration, Instant};

use common::fenced::{self, out_of_order};
#[cfg(any(feature = "postgres", feature = "mysql"))]
use common::fenced::{pool_exhausted, App, Take, Worker};
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
    let Worker {
        url, locker, line, ..
    } = Worker::start().await;
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
            match app.hold_in(Take::LockIn(&locker, wait), None).await {
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
    // The clean history with one more hold.
    let with = |extra: Span| {
        let mut spans = clean.clone();
        spans.push(extra);
        violations(&spans)
    };
    assert_eq!(with(s("read", 16, 18)).0, 1, "a reader beside a writer");
    assert_eq!(with(s("write", 16, 17)).0, 1, "two writers");
    assert_eq!(
        with(s("read", 29, 31)).0,
        1,
        "a reader in a transaction's span"
    );
    assert_eq!(
        with(s("write", 25, 26)).0,
        1,
        "a lease beside a transaction"
    );
    assert_eq!(
        with(s("tx", 29, 31)).0,
        2,
        "two transactions (and the reader after)"
    );
    assert_eq!(with(s("permit", 9, 11)).1, 3, "three permits");
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
    let (text, injected) = through_faults(name, "kinds_worker", direct, &table).await;
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

/// `WORKERS` processes of the worker `entry` on `table`, each through a fault proxy of its own to
/// `direct`, through [`inject_faults`]: their history (no untyped error in it) and how many faults
/// were injected.
async fn through_faults(name: &str, entry: &str, direct: &str, table: &str) -> (String, usize) {
    let work = tempfile::tempdir().unwrap();
    let log = work.path().join("history");
    let mut proxies = Vec::new();
    let mut children = Vec::new();
    for _ in 0..WORKERS {
        let proxy = Proxy::start(&common::host_of(direct)).await;
        children.push(
            history::worker_command(entry, &proxy.url(direct), table, &log, false)
                .spawn()
                .unwrap(),
        );
        proxies.push(proxy);
    }
    let injected = inject_faults(&proxies).await;
    for status in history::wait_all(children).await {
        assert!(status.success(), "{name}: a worker failed: {status:?}");
    }
    let text = std::fs::read_to_string(&log).unwrap();
    history::assert_no_untyped_errors(name, &text);
    (text, injected)
}

/// Faults, one worker's proxy at a time, until the quiet end of the run: lost replies, dropped
/// sends, replies delayed past the ttl, blackholed connections. How many were injected.
async fn inject_faults(proxies: &[Proxy]) -> usize {
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
        let proxy = &proxies[fastrand::usize(..proxies.len())];
        let mode = faults[fastrand::usize(..faults.len())];
        proxy.set(mode);
        tokio::time::sleep(Duration::from_millis(fastrand::u64(200..800))).await;
        if mode == Mode::HoldReplies {
            // A lost reply: the held bytes never arrive, the connection breaks.
            proxy.cut_off();
        }
        proxy.set(Mode::Pass);
        injected += 1;
    }
    injected
}

/// The fenced-write run's worker (`common::fenced`): leases, steals and `lock_in` transactions
/// of key `doc`, each writing its token into the app's table in a transaction that fences it.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "chaos worker entry point, started by the fenced-write chaos test"]
async fn fenced_worker() {
    fenced::fenced_worker(&fenced::Plan {
        run: RUN,
        ttl: TTL,
        linger: LINGER,
        lock_in: true,
        seq: false,
    })
    .await;
}

#[test]
fn the_fenced_write_checker_catches_a_stale_write() {
    assert_eq!(out_of_order(&[1, 2, 5, 9]), 0);
    assert_eq!(out_of_order(&[1, 5, 2, 9]), 1);
    assert_eq!(out_of_order(&[1, 2, 2, 3]), 1);
}

/// Leases, steals and `lock_in` transactions of one key, each writing its token in a fenced
/// transaction, from 3 worker processes through faults: the committed writes' tokens only grow in
/// the order they were written, whatever was stolen or expired mid-transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_writes_keep_their_order_through_faults_and_steals() {
    #[allow(unused_mut)]
    let mut targets: Vec<(&str, String, &str)> = Vec::new();
    #[cfg(feature = "postgres")]
    if common::postgres("chaos_fenced").await.is_some() {
        targets.push((
            "postgres",
            common::postgres_url(),
            "(id BIGSERIAL PRIMARY KEY, token BIGINT NOT NULL)",
        ));
    }
    #[cfg(feature = "mysql")]
    if common::mysql("chaos_fenced").await.is_some() {
        targets.push((
            "mariadb",
            common::mysql_url(),
            "(id BIGINT AUTO_INCREMENT PRIMARY KEY, token BIGINT NOT NULL)",
        ));
    }
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    for (name, direct, columns) in targets {
        run_fenced(name, &direct, columns, None).await;
    }
    // The same on a PostgreSQL cluster whose clock steps forward by more than the ttl mid-run,
    // and back again: every lease ends at once, then every lease lasts the step longer.
    #[cfg(feature = "postgres")]
    if let Some(pg) =
        common::cluster::PrivatePg::start_with_clock("the fenced chaos run under clock steps", &[])
    {
        run_fenced(
            "postgres, clock steps",
            &pg.url(),
            "(id BIGSERIAL PRIMARY KEY, token BIGINT NOT NULL)",
            Some(&pg),
        )
        .await;
    }
}

/// Steps `pg`'s clock forward by 20 s (ten ttls) a third into the run, back to the real time two
/// thirds in; how many steps.
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn step_clock(pg: Option<&common::cluster::PrivatePg>) -> usize {
    #[cfg(feature = "postgres")]
    if let Some(pg) = pg {
        tokio::time::sleep(RUN / 3).await;
        pg.set_clock(20);
        tokio::time::sleep(RUN / 3).await;
        pg.set_clock(0);
        return 2;
    }
    let _ = pg;
    0
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn run_fenced(
    name: &str,
    direct: &str,
    columns: &str,
    clock: Option<&common::cluster::PrivatePg>,
) {
    let table = common::table_for("chaos_fenced");
    let observer = Locker::connect(direct).await.unwrap().table(&table);
    observer.migrate().await.unwrap();
    let pool = App::connect(direct);
    pool.execute(&format!("CREATE TABLE {table}_w {columns}"))
        .await
        .unwrap();
    let ((text, injected), steps) = tokio::join!(
        through_faults(name, "fenced_worker", direct, &table),
        step_clock(clock)
    );
    let tokens = pool
        .column(&format!("SELECT token FROM {table}_w ORDER BY id"))
        .await
        .unwrap();
    let fenced::Tally {
        steals,
        refused_lease,
        refused_steal,
        exits,
    } = fenced::tally(&text);
    println!(
        "{name}: {injected} faults, {steps} clock steps; {steals} steals; {} fenced writes \
         committed; fences refused (stolen or run out before the fence): {refused_lease} of \
         leases, {refused_steal} of stealers",
        tokens.len(),
    );
    assert_eq!(
        out_of_order(&tokens),
        0,
        "{name}: a stale write committed: {tokens:?}"
    );
    assert!(tokens.len() > 10, "{name}: too few writes to say anything");
    assert!(steals > 0, "{name}: no steal");
    assert_eq!(exits, WORKERS, "{name}");
}
