//! dblock's benchmark, every part in one run on this machine:
//!
//! 1. **Cycles**: lock + unlock on distinct keys, 1 and 8 owners, per backend, through
//!    `Locker` (lazily durable releases, the default), through `Locker` with
//!    `durable_release(true)`, and through the ceiling: the library's own statements on its own
//!    pool with none of the client's machinery (`dblock::test_util`). The three alternate in
//!    rounds; the ratios are medians of per-round ratios. PostgreSQL also runs `pgbench` on the
//!    design's minimal statements (same durability: the release commits without waiting for its
//!    flush). Peers: the servers' own session locks (advisory locks, `GET_LOCK`) and Redis (a
//!    `SET NX PX` + owner-checked Lua delete, and the `rslock` crate).
//! 2. **Hand-off**: 8 owners take turns on one key; release → next `lock()` latency, with short
//!    and long holds, and with a background load of 8 owners cycling other keys.
//! 3. **Renewal**: 10,000 held locks with `auto_renew` on one locker: statements and time.
//! 4. **Fairness**: 16 waiters in 4 processes on one key, with and without `fair()`: hand-off
//!    p50/p99 and the longest wait (`fairness.rs`).
//! 5. **Kinds** and 6. **coalescing**: see `kinds.rs` and `coalesce.rs`.
//! 7. **Series** (`series.rs`; only when named, `DBLOCK_BENCH_PARTS=series`, about 8 minutes):
//!    the figures `docs/benchmarks.md` gives, each as a Markdown table with its method and an
//!    SVG chart, in `benches/results/series.md` and `benches/results/series-*.svg`: uncontended
//!    latency against a round trip, cycles/s at 1 to 1,000 owners beside the peers, hand-off,
//!    a crashed holder, a dead fair waiter, leader hand-over.
//!
//! 8. **Service** (`service.rs`; only when named, `DBLOCK_BENCH_PARTS=service`, about 5
//!    minutes): a request's transaction under a lock, with no lock, a lease, `release_in` and
//!    `lock_in`, at 1, 16 and 64 requests at once.
//!
//! `cargo bench -p dblock-bench` (release build). Prints Markdown tables and writes the cycle
//! chart to `benches/results/lock_cycle.svg`. `DBLOCK_BENCH_SECS` sets the measured seconds per
//! side and cell (default 5); `DBLOCK_BENCH_ONLY=postgres,mariadb` limits the backends;
//! `DBLOCK_REDIS_URL` (default `redis://127.0.0.1:6379`); `DBLOCK_BENCH_PARTS=cycles,handoff,renewal,fair,kinds,coalesce,series,service`
//! runs only those parts (the chart needs `cycles`; `series` and `service` run only when named).

use std::fmt::Write as _;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dblock::{ConnectOptions, Locker};
use sqlx::AssertSqlSafe;

mod coalesce;
mod fairness;
mod kinds;
mod series;
mod service;

const TTL: Duration = Duration::from_secs(30);
const WAIT: Duration = Duration::from_secs(10);
const KEYS_PER_OWNER: usize = 64;
/// Measured rounds per cell, alternating the sides.
const ROUNDS: usize = 10;
const OWNERS: [usize; 2] = [1, 8];

type BoxFut<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// One lock+unlock cycle on `key`, by one implementation.
trait Cycle: Send + Sync + 'static {
    fn cycle<'a>(&'a self, key: &'a str, owner: &'a str) -> BoxFut<'a>;
}

struct Dblock(Locker);

impl Cycle for Dblock {
    fn cycle<'a>(&'a self, key: &'a str, _owner: &'a str) -> BoxFut<'a> {
        Box::pin(async move {
            // A wait only for SQLite's write lock between owners (keys are never contended).
            let g = self
                .0
                .lock(key)
                .ttl(TTL)
                .wait(WAIT)
                .await
                .expect("dblock lock");
            g.release().await.expect("dblock release");
        })
    }
}

/// The ceiling: dblock's own acquire and release statements with its own binds, on a pool
/// set up exactly as `Locker::connect` sets up its own (it is one), sent one after the other
/// with nothing around them: no task per statement, no retry, no guard, no serialisation.
struct Raw(dblock::test_util::Statements);

impl Cycle for Raw {
    fn cycle<'a>(&'a self, key: &'a str, owner: &'a str) -> BoxFut<'a> {
        Box::pin(async move {
            let token = self.0.acquire(key, owner, TTL).await.unwrap();
            let token = token.expect("a free key");
            assert!(self.0.release(key, owner, token).await.unwrap(), "released");
        })
    }
}

struct Stats {
    cycles: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
}

impl Stats {
    fn rate(&self) -> f64 {
        self.cycles as f64 / self.elapsed.as_secs_f64()
    }
    fn pct(&mut self, p: f64) -> Duration {
        self.latencies.sort_unstable();
        let i = ((self.latencies.len() as f64 - 1.0) * p).round() as usize;
        self.latencies.get(i).copied().unwrap_or_default()
    }
    fn ms(&mut self, p: f64) -> String {
        format!("{:.2} ms", self.pct(p).as_secs_f64() * 1e3)
    }
}

/// The keys that owner `o` of a side tagged `tag` cycles over.
fn owner_keys(tag: &str, o: usize) -> Vec<String> {
    (0..KEYS_PER_OWNER)
        .map(|k| format!("bench:{tag}:{o}:{k}"))
        .collect()
}

/// `owners` tasks, each cycling over keys of its own, for `secs`.
async fn run(imp: Arc<dyn Cycle>, owners: usize, secs: Duration, tag: &str) -> Stats {
    let start = Instant::now();
    let tasks: Vec<_> = (0..owners)
        .map(|o| {
            let imp = imp.clone();
            let tag = tag.to_owned();
            tokio::spawn(async move {
                let owner = dblock::Owner::new().id().to_owned();
                let keys = owner_keys(&tag, o);
                let mut lat = Vec::new();
                let mut i = 0;
                while start.elapsed() < secs {
                    let t = Instant::now();
                    imp.cycle(&keys[i % KEYS_PER_OWNER], &owner).await;
                    lat.push(t.elapsed());
                    i += 1;
                }
                lat
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.unwrap());
    }
    Stats {
        cycles: latencies.len(),
        elapsed: start.elapsed(),
        latencies,
    }
}

fn merge(a: &mut Option<Stats>, b: Stats) {
    match a {
        None => *a = Some(b),
        Some(s) => {
            s.cycles += b.cycles;
            s.elapsed += b.elapsed;
            s.latencies.extend(b.latencies);
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One bar of the chart: backend, owners, implementation, cycles/s.
struct Bar {
    backend: &'static str,
    owners: usize,
    imp: String,
    rate: f64,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::var("DBLOCK_BENCH_FAIR_CHILD").is_ok() {
        return fairness::child().await;
    }
    if std::env::var("DBLOCK_BENCH_SERIES_CHILD").is_ok() {
        return series::child::child().await;
    }
    let secs: f64 = std::env::var("DBLOCK_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5.0);
    let round = Duration::from_secs_f64(secs / ROUNDS as f64);
    let dir = tempfile::tempdir().unwrap();
    let sqlite_url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("bench.db").display()
    );
    let pg = postgres_url();
    let my = std::env::var("DBLOCK_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let redis_url =
        std::env::var("DBLOCK_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let only = |name: &str| {
        std::env::var("DBLOCK_BENCH_ONLY").map_or(true, |only| only.split(',').any(|o| o == name))
    };

    let part = |name: &str| {
        std::env::var("DBLOCK_BENCH_PARTS").map_or(true, |p| p.split(',').any(|o| o == name))
    };
    // The series run only when named, before the other parts and on tables of their own.
    let parts = std::env::var("DBLOCK_BENCH_PARTS").unwrap_or_default();
    if parts.split(',').any(|p| p == "series") {
        let urls = series::Urls {
            postgres: pg.clone(),
            pgbouncer: std::env::var("DBLOCK_PGBOUNCER_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:6432/test".into()),
            mysql: my.clone(),
            redis: redis_url.clone(),
        };
        series::series(&urls, &only, secs).await;
    }
    // The service part, likewise only when named.
    if parts.split(',').any(|p| p == "service") {
        let bouncer = std::env::var("DBLOCK_PGBOUNCER_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:6432/test".into());
        service::service(&sqlite_url, &pg, &bouncer, &my, &only, secs).await;
    }
    if !parts.is_empty() && parts.split(',').all(|p| p == "series" || p == "service") {
        return;
    }

    let mut bars: Vec<Bar> = Vec::new();
    let mut lockers = Vec::new();
    let mut fair_targets = Vec::new();
    let mut coalesce_targets = Vec::new();
    if part("cycles") {
        println!("| backend | owners | impl | cycles/s | p50 | p99 | ratio |");
        println!("|---|---|---|---|---|---|---|");
    }
    let bouncer = std::env::var("DBLOCK_PGBOUNCER_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:6432/test".into());
    let pooler = || ConnectOptions::new().pooler(true);
    for (name, url, options) in [
        ("sqlite", sqlite_url.as_str(), ConnectOptions::new()),
        ("postgres", pg.as_str(), ConnectOptions::new()),
        // Pooler mode (simple queries, values inlined) straight to the server, and through
        // PgBouncer in transaction mode (`.ci/pgbouncer` starts one on 6432).
        ("postgres-pooler", pg.as_str(), pooler()),
        ("postgres-pgbouncer", bouncer.as_str(), pooler()),
        ("mariadb", my.as_str(), ConnectOptions::new()),
    ] {
        if !only(name) {
            continue;
        }
        let locker = match Locker::connect_with(url, options.clone()).await {
            Ok(l) => l.table("dblock_bench"),
            Err(e) => {
                println!("| {name} | – | skipped: {e} | | | | |");
                continue;
            }
        };
        // The PostgreSQL entries share one database: the table is dropped through the server.
        let direct = if name.starts_with("postgres") {
            pg.as_str()
        } else {
            url
        };
        drop_table(direct, "dblock_bench").await;
        locker.migrate().await.unwrap();
        lockers.push((name, locker.clone()));
        if name != "postgres-pooler" {
            coalesce_targets.push((name, url.to_owned(), options.clone()));
        }
        if name != "postgres-pooler" {
            let pooler = name.starts_with("postgres-");
            fair_targets.push((name, url.to_owned(), pooler, locker.table_name().to_owned()));
        }
        if !part("cycles") {
            continue;
        }
        let durable = Locker::connect_with(url, options.clone().durable_release(true))
            .await
            .unwrap()
            .table("dblock_bench");
        // MySQL/MariaDB have no per-session durability; the pooler cells show the pooler's cost.
        let lazy_differs = name == "sqlite" || name == "postgres";
        // pgbench on dblock's own statements, as the library prepares and binds them.
        let own_scripts = (
            dblock::test_util::pgbench_script(&locker),
            dblock::test_util::pgbench_script(&durable),
        );
        let dblock: Arc<dyn Cycle> = Arc::new(Dblock(locker.clone()));
        let dblock_durable: Arc<dyn Cycle> = Arc::new(Dblock(durable));
        let raw: Arc<dyn Cycle> = Arc::new(raw_for(url, options, locker.table_name()).await);
        for owners in OWNERS {
            // Warm the pools and statement caches.
            for imp in [&raw, &dblock, &dblock_durable] {
                run(imp.clone(), owners, Duration::from_millis(300), "warm").await;
            }
            let (mut r, mut d, mut dd) = (None, None, None);
            let (mut vs_ceiling, mut vs_durable) = (Vec::new(), Vec::new());
            for i in 0..ROUNDS {
                // Rotate which side goes first, so none always runs on a warmer cache.
                let mut sides: [(usize, &Arc<dyn Cycle>, &str); 3] = [
                    (0, &raw, "raw"),
                    (1, &dblock, "dblock"),
                    (2, &dblock_durable, "durable"),
                ];
                sides.rotate_left(i % 3);
                let mut got: [Option<Stats>; 3] = [None, None, None];
                for (slot, imp, tag) in sides {
                    if slot == 2 && !lazy_differs {
                        continue;
                    }
                    got[slot] = Some(run(imp.clone(), owners, round, tag).await);
                }
                let [a, b, c] = got;
                let (a, b) = (a.unwrap(), b.unwrap());
                vs_ceiling.push(b.rate() / a.rate());
                if let Some(c) = c {
                    vs_durable.push(b.rate() / c.rate());
                    merge(&mut dd, c);
                }
                merge(&mut r, a);
                merge(&mut d, b);
            }
            let (mut r, mut d) = (r.unwrap(), d.unwrap());
            let row = |imp: &str, s: &mut Stats, ratio: String| {
                println!(
                    "| {name} | {owners} | {imp} | {:.0} | {} | {} | {ratio} |",
                    s.rate(),
                    s.ms(0.50),
                    s.ms(0.99)
                );
            };
            row("raw statements (ceiling)", &mut r, String::new());
            row(
                "dblock",
                &mut d,
                format!("{:.2} of the ceiling", median(vs_ceiling)),
            );
            bars.push(Bar {
                backend: name,
                owners,
                imp: "dblock".into(),
                rate: d.rate(),
            });
            bars.push(Bar {
                backend: name,
                owners,
                imp: "ceiling".into(),
                rate: r.rate(),
            });
            if let Some(mut dd) = dd {
                row(
                    "dblock, durable release",
                    &mut dd,
                    format!("default is {:.2}×", median(vs_durable)),
                );
                bars.push(Bar {
                    backend: name,
                    owners,
                    imp: "dblock, durable release".into(),
                    rate: dd.rate(),
                });
            }
            if name == "postgres" {
                // The gap to pgbench, taken apart: pgbench (a C client) on the design's minimal
                // statements, and on dblock's own statements, lazily and durably released. The
                // second over the first is what dblock's SQL costs the server; dblock over the
                // second is what its client (sqlx, tokio, dblock) costs.
                let pgb = |script: String| {
                    pgbench(url, owners, Duration::from_secs_f64(secs), script, true)
                };
                let minimal = pgb(PGBENCH_SCRIPT.into()).await;
                let own = match &own_scripts.0 {
                    Some(s) => pgb(s.clone()).await,
                    None => Err("no script".into()),
                };
                let own_durable = match &own_scripts.1 {
                    Some(s) => pgb(s.clone()).await,
                    None => Err("no script".into()),
                };
                match &minimal {
                    Ok(tps) => {
                        println!(
                            "| {name} | {owners} | pgbench, minimal statements | {tps:.0} | | | dblock is {:.2} of it |",
                            d.rate() / tps
                        );
                        bars.push(Bar {
                            backend: name,
                            owners,
                            imp: "pgbench".into(),
                            rate: *tps,
                        });
                    }
                    Err(e) => println!("| {name} | {owners} | pgbench: {e} | | | | |"),
                }
                match (&own, &minimal) {
                    (Ok(tps), Ok(min)) => println!(
                        "| {name} | {owners} | pgbench, dblock's statements | {tps:.0} | | | dblock is {:.2} of it; it is {:.2} of minimal |",
                        d.rate() / tps,
                        tps / min
                    ),
                    (Err(e), _) | (_, Err(e)) => println!("| {name} | {owners} | pgbench, dblock's statements: {e} | | | | |"),
                }
                match (&own_durable, &own) {
                    (Ok(tps), Ok(lazy)) => println!(
                        "| {name} | {owners} | pgbench, dblock's statements, durable release | {tps:.0} | | | lazy is {:.2}× |",
                        lazy / tps
                    ),
                    (Err(e), _) | (_, Err(e)) => println!("| {name} | {owners} | pgbench, durable: {e} | | | | |"),
                }
            }
            // Peers for scale: the server's own session-bound lock, in memory (no row, no
            // commit to disk, no expiry, no fencing, and gone if the connection drops).
            if let Some((label, peer)) = peer_for(name, url).await {
                let mut p = measure(peer, owners, secs).await;
                let share = d.rate() / p.rate();
                row(
                    &format!("peer: {label}"),
                    &mut p,
                    format!("dblock is {share:.2} of it"),
                );
                bars.push(Bar {
                    backend: name,
                    owners,
                    imp: label.into(),
                    rate: p.rate(),
                });
            }
        }
    }

    // Redis: a lock in memory (with an expiry and an owner check, no fencing, no durability).
    let redis_peers = if only("redis") && (part("cycles") || part("coalesce")) {
        redis_peers(&redis_url).await
    } else {
        Vec::new()
    };
    for (label, peer) in redis_peers.iter().filter(|_| part("cycles")) {
        for owners in OWNERS {
            let mut p = measure(peer.clone(), owners, secs).await;
            println!(
                "| redis | {owners} | peer: {label} | {:.0} | {} | {} | |",
                p.rate(),
                p.ms(0.50),
                p.ms(0.99)
            );
            bars.push(Bar {
                backend: "redis",
                owners,
                imp: (*label).into(),
                rate: p.rate(),
            });
        }
    }

    if part("handoff") {
        handoffs(&lockers, &redis_url, secs).await;
    }
    if part("renewal") {
        renewal(&lockers).await;
    }
    if part("fair") {
        fairness::fairness(&fair_targets, secs).await;
    }
    if part("kinds") {
        kinds::kinds(&lockers, secs).await;
    }
    if part("coalesce") {
        let coalesced = coalesce::coalescing(&coalesce_targets, &redis_peers, secs).await;
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/results/coalesce.svg");
        std::fs::create_dir_all(concat!(env!("CARGO_MANIFEST_DIR"), "/results")).unwrap();
        std::fs::write(
            path,
            chart(
                &coalesced,
                "lock + unlock cycles/s (log scale), coalesced and not, 1, 8 and 64 owners",
            ),
        )
        .unwrap();
        println!();
        println!("Chart written to {path}");
    }
    if bars.is_empty() {
        return;
    }

    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/results/lock_cycle.svg");
    std::fs::create_dir_all(concat!(env!("CARGO_MANIFEST_DIR"), "/results")).unwrap();
    std::fs::write(
        path,
        chart(&bars, "lock + unlock cycles/s (log scale), 1 and 8 owners"),
    )
    .unwrap();
    println!();
    println!("Chart written to {path}");
}

/// A peer's cycles over the same total time as one side of a cell.
async fn measure(peer: Arc<dyn Cycle>, owners: usize, secs: f64) -> Stats {
    run(peer.clone(), owners, Duration::from_millis(300), "peer").await;
    run(peer, owners, Duration::from_secs_f64(secs), "peer").await
}

/// The ceiling on a second, identically configured pool of its own.
async fn raw_for(url: &str, options: ConnectOptions, table: &str) -> Raw {
    let own = Locker::connect_with(url, options)
        .await
        .unwrap()
        .table(table);
    Raw(dblock::test_util::statements(&own))
}

// ---------------------------------------------------------------------------------------------
// pgbench on the design's minimal statements

/// The design's minimal lock cycle (research/sql-notes.md, adapted to the table's NOT NULL
/// columns), two autocommit statements per cycle as dblock sends: the acquire, then the
/// release, which commits without waiting for its flush as dblock's does. Keys are per client,
/// like the owners' keys above.
const PGBENCH_SCRIPT: &str = r#"\set k random(0, 63)
WITH upd AS (
    UPDATE dblock_bench AS l SET
        hold_count    = CASE WHEN l.owner = 'pgb:' || :client_id AND l.expires_at > statement_timestamp()
                             THEN l.hold_count + 1 ELSE 1 END,
        fencing_token = CASE WHEN l.owner = 'pgb:' || :client_id AND l.expires_at > statement_timestamp()
                             THEN l.fencing_token ELSE l.fencing_token + 1 END,
        acquired_at   = statement_timestamp(),
        expires_at    = statement_timestamp() + interval '30 seconds',
        owner         = 'pgb:' || :client_id
    WHERE l.lock_key = 'pgbench:' || :client_id || ':' || :k
      AND (l.owner IS NULL OR l.owner = 'pgb:' || :client_id OR l.expires_at <= statement_timestamp())
    RETURNING l.hold_count, l.fencing_token
), ins AS (
    INSERT INTO dblock_bench (lock_key, owner, hold_count, fencing_token, expires_at, acquired_at)
    SELECT 'pgbench:' || :client_id || ':' || :k, 'pgb:' || :client_id, 1,
           (extract(epoch FROM statement_timestamp()) * 1000000)::int8,
           statement_timestamp() + interval '30 seconds', statement_timestamp()
    WHERE NOT EXISTS (SELECT 1 FROM upd)
    ON CONFLICT (lock_key) DO NOTHING
    RETURNING hold_count, fencing_token
)
SELECT * FROM upd UNION ALL SELECT * FROM ins;
UPDATE dblock_bench SET
    hold_count = hold_count - 1,
    owner      = CASE WHEN hold_count > 1 THEN owner END,
    expires_at = CASE WHEN hold_count > 1 THEN expires_at ELSE statement_timestamp() END
WHERE lock_key = 'pgbench:' || :client_id || ':' || :k AND owner = 'pgb:' || :client_id
  AND expires_at > statement_timestamp()
RETURNING hold_count, set_config('synchronous_commit', 'off', true);
"#;

/// Cycles/s of `pgbench` with `clients` clients on `script` (prepared statements).
async fn pgbench(
    url: &str,
    clients: usize,
    secs: Duration,
    script: String,
    warm: bool,
) -> Result<f64, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let path = dir.path().join("cycle.sql");
    std::fs::write(&path, script).map_err(|e| e.to_string())?;
    let script = path;
    let args = move |secs: u64| {
        vec![
            "-n".to_owned(),
            "-M".into(),
            "prepared".into(),
            "-c".into(),
            clients.to_string(),
            "-j".into(),
            clients.min(2).to_string(),
            "-T".into(),
            secs.to_string(),
            "-f".into(),
            script.display().to_string(),
            url.to_owned(),
        ]
    };
    let run = move |args: Vec<String>| {
        std::process::Command::new("pgbench")
            .args(args)
            .output()
            .map_err(|e| format!("pgbench not runnable: {e}"))
    };
    if warm {
        run(args(1))?;
    }
    let measured = args(secs.as_secs().max(1));
    let out = tokio::task::spawn_blocking(move || run(measured))
        .await
        .map_err(|e| e.to_string())??;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| {
            let rest = l.strip_prefix("tps = ")?;
            rest.split_whitespace().next()?.parse().ok()
        })
        .ok_or_else(|| {
            format!(
                "no tps in pgbench output: {text} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
}

// ---------------------------------------------------------------------------------------------
// Peers

/// The database's built-in session lock: PostgreSQL advisory locks, MySQL/MariaDB `GET_LOCK`.
/// Lock and unlock must run on the same connection, so each cycle holds one for both.
enum Peer {
    Advisory(sqlx::PgPool),
    GetLock(sqlx::MySqlPool),
}

impl Cycle for Peer {
    fn cycle<'a>(&'a self, key: &'a str, _owner: &'a str) -> BoxFut<'a> {
        Box::pin(async move {
            match self {
                Peer::Advisory(pool) => {
                    let mut conn = pool.acquire().await.unwrap();
                    let got: bool =
                        sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtextextended($1, 0))")
                            .bind(key)
                            .fetch_one(&mut *conn)
                            .await
                            .unwrap();
                    assert!(got);
                    sqlx::query("SELECT pg_advisory_unlock(hashtextextended($1, 0))")
                        .bind(key)
                        .execute(&mut *conn)
                        .await
                        .unwrap();
                }
                Peer::GetLock(pool) => {
                    let mut conn = pool.acquire().await.unwrap();
                    let got: i64 = sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
                        .bind(key)
                        .fetch_one(&mut *conn)
                        .await
                        .unwrap();
                    assert_eq!(got, 1);
                    sqlx::query("SELECT RELEASE_LOCK(?)")
                        .bind(key)
                        .execute(&mut *conn)
                        .await
                        .unwrap();
                }
            }
        })
    }
}

async fn peer_for(name: &str, url: &str) -> Option<(&'static str, Arc<dyn Cycle>)> {
    match name {
        "postgres" => {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(10)
                .test_before_acquire(false)
                .connect(url)
                .await
                .ok()?;
            Some(("pg_try_advisory_lock", Arc::new(Peer::Advisory(pool))))
        }
        "mariadb" => {
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(10)
                .test_before_acquire(false)
                .connect(url)
                .await
                .ok()?;
            Some(("GET_LOCK", Arc::new(Peer::GetLock(pool))))
        }
        _ => None,
    }
}

/// The usual Redis lock: `SET key token NX PX ttl`, released by a Lua script that deletes the
/// key only if it still holds this owner's token.
struct RedisLock {
    conn: redis::aio::MultiplexedConnection,
    unlock: redis::Script,
}

const REDIS_UNLOCK: &str =
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end";

impl RedisLock {
    /// One attempt: `true` if taken.
    async fn try_lock(&self, key: &str, token: &str, ttl: Duration) -> bool {
        let mut conn = self.conn.clone();
        let set: Option<String> = redis::cmd("SET")
            .arg(key)
            .arg(token)
            .arg("NX")
            .arg("PX")
            .arg(ttl.as_millis() as u64)
            .query_async(&mut conn)
            .await
            .expect("redis SET");
        set.is_some()
    }

    async fn unlock(&self, key: &str, token: &str) -> bool {
        let mut conn = self.conn.clone();
        let n: i64 = self
            .unlock
            .key(key)
            .arg(token)
            .invoke_async(&mut conn)
            .await
            .expect("redis unlock");
        n == 1
    }
}

impl Cycle for RedisLock {
    fn cycle<'a>(&'a self, key: &'a str, owner: &'a str) -> BoxFut<'a> {
        Box::pin(async move {
            assert!(self.try_lock(key, owner, TTL).await, "a free key");
            assert!(self.unlock(key, owner).await, "released");
        })
    }
}

/// The `rslock` crate (Redlock over one Redis server).
struct RsLock(rslock::LockManager);

impl Cycle for RsLock {
    fn cycle<'a>(&'a self, key: &'a str, _owner: &'a str) -> BoxFut<'a> {
        Box::pin(async move {
            let lock = self.0.lock(key.as_bytes(), TTL).await.expect("rslock lock");
            self.0.unlock(&lock).await;
        })
    }
}

async fn redis_lock(url: &str) -> Result<RedisLock, String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;
    Ok(RedisLock {
        conn,
        unlock: redis::Script::new(REDIS_UNLOCK),
    })
}

async fn redis_peers(url: &str) -> Vec<(&'static str, Arc<dyn Cycle>)> {
    match redis_lock(url).await {
        Ok(lock) => vec![
            (
                "redis SET NX PX + Lua unlock",
                Arc::new(lock) as Arc<dyn Cycle>,
            ),
            (
                "rslock (Redlock, 1 server)",
                Arc::new(RsLock(rslock::LockManager::new(vec![url.to_owned()]))),
            ),
        ],
        Err(e) => {
            println!("| redis | – | skipped: {e} | | | | |");
            Vec::new()
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Hand-off

const WAITERS: usize = 8;
/// A short hold keeps every waiter polling fast; a long one lets their backoff grow.
const HOLDS: [Duration; 2] = [Duration::from_millis(1), Duration::from_millis(50)];

/// Something 8 owners can take turns on: one key, waited for.
trait Turns: Send + Sync + 'static {
    /// Waits for the key; returns what releases it.
    fn take<'a>(
        &'a self,
        key: &'a str,
    ) -> Pin<Box<dyn Future<Output = Box<dyn Release>> + Send + 'a>>;
}

trait Release: Send {
    fn release(self: Box<Self>) -> BoxFut<'static>;
}

impl Turns for Locker {
    fn take<'a>(
        &'a self,
        key: &'a str,
    ) -> Pin<Box<dyn Future<Output = Box<dyn Release>> + Send + 'a>> {
        Box::pin(async move {
            let g = self
                .lock(key)
                .ttl(TTL)
                .wait(Duration::from_secs(60))
                .await
                .expect("hand-off lock");
            Box::new(g) as Box<dyn Release>
        })
    }
}

impl Release for dblock::LockGuard {
    fn release(self: Box<Self>) -> BoxFut<'static> {
        Box::pin(async move { (*self).release().await.expect("hand-off release") })
    }
}

/// Redis waiters poll as dblock's do: jittered backoff from 5 ms doubling to 250 ms.
struct RedisTurns(Arc<RedisLock>);

struct RedisHeld(Arc<RedisLock>, String, String);

impl Turns for RedisTurns {
    fn take<'a>(
        &'a self,
        key: &'a str,
    ) -> Pin<Box<dyn Future<Output = Box<dyn Release>> + Send + 'a>> {
        Box::pin(async move {
            let token = dblock::Owner::new().id().to_owned();
            let mut backoff = Duration::from_millis(5);
            while !self.0.try_lock(key, &token, TTL).await {
                let pause = backoff / 2 + backoff.mul_f64(fastrand::f64() / 2.0);
                tokio::time::sleep(pause).await;
                backoff = (backoff * 2).min(Duration::from_millis(250));
            }
            Box::new(RedisHeld(self.0.clone(), key.to_owned(), token)) as Box<dyn Release>
        })
    }
}

impl Release for RedisHeld {
    fn release(self: Box<Self>) -> BoxFut<'static> {
        Box::pin(async move {
            assert!(self.0.unlock(&self.1, &self.2).await);
        })
    }
}

async fn handoffs(lockers: &[(&'static str, Locker)], redis_url: &str, secs: f64) {
    println!();
    println!(
        "Hand-off: {WAITERS} owners take turns on one key, each holding it for `hold`; time from"
    );
    println!(
        "the holder's release call to the next owner's lock returning. \"+ load\": 8 more owners"
    );
    println!("cycle other keys of the same backend meanwhile.");
    println!();
    println!("| backend | hold | wake-up | hand-offs | p50 | p99 |");
    println!("|---|---|---|---|---|---|");
    let secs = Duration::from_secs_f64(secs.max(2.0));
    for (name, locker) in lockers {
        for hold in HOLDS {
            let how = if *name == "postgres" {
                let mut s = handoff(
                    Arc::new(dblock::test_util::polling_only(locker)),
                    secs,
                    hold,
                    None,
                )
                .await;
                print_handoff(name, hold, "polling only", &mut s);
                "LISTEN/NOTIFY + polling"
            } else if name.starts_with("postgres-") {
                "polling only (pooler mode)"
            } else {
                "polling (jittered backoff)"
            };
            let mut s = handoff(Arc::new(locker.clone()), secs, hold, None).await;
            print_handoff(name, hold, how, &mut s);
        }
        let load: Arc<dyn Cycle> = Arc::new(Dblock(locker.clone()));
        let hold = HOLDS[1];
        let mut s = handoff(Arc::new(locker.clone()), secs, hold, Some(load)).await;
        let how = if *name == "postgres" {
            "LISTEN/NOTIFY + polling, + load"
        } else {
            "polling, + load"
        };
        print_handoff(name, hold, how, &mut s);
    }
    if let Ok(lock) = redis_lock(redis_url).await {
        let turns = Arc::new(RedisTurns(Arc::new(lock)));
        for hold in HOLDS {
            let mut s = handoff(turns.clone(), secs, hold, None).await;
            print_handoff("redis", hold, "polling (same backoff)", &mut s);
        }
    }
}

fn print_handoff(name: &str, hold: Duration, how: &str, s: &mut Stats) {
    let (p50, p99) = (s.ms(0.50), s.ms(0.99));
    println!(
        "| {name} | {hold:?} | {how} | {} | {p50} | {p99} |",
        s.cycles
    );
}

/// `WAITERS` owners loop on one key for `secs` (with `load` cycling other keys meanwhile);
/// returns release→next-acquire latencies.
async fn handoff(
    turns: Arc<dyn Turns>,
    secs: Duration,
    hold: Duration,
    load: Option<Arc<dyn Cycle>>,
) -> Stats {
    #[derive(Clone, Copy)]
    enum Ev {
        Acquired(Instant),
        Releasing(Instant),
    }
    let key = format!("handoff:{}", fastrand::u64(..));
    let background = load.map(|l| tokio::spawn(run(l, 8, secs, "load")));
    let events = Arc::new(std::sync::Mutex::new(Vec::new()));
    let start = Instant::now();
    let tasks: Vec<_> = (0..WAITERS)
        .map(|_| {
            let (turns, events, key) = (turns.clone(), events.clone(), key.clone());
            tokio::spawn(async move {
                while start.elapsed() < secs {
                    let g = turns.take(&key).await;
                    events.lock().unwrap().push(Ev::Acquired(Instant::now()));
                    tokio::time::sleep(hold).await;
                    events.lock().unwrap().push(Ev::Releasing(Instant::now()));
                    g.release().await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    if let Some(b) = background {
        b.await.unwrap();
    }
    let mut evs = events.lock().unwrap().clone();
    evs.sort_by_key(|e| match e {
        Ev::Acquired(t) | Ev::Releasing(t) => *t,
    });
    let mut latencies = Vec::new();
    let mut released: Option<Instant> = None;
    for e in evs {
        match e {
            Ev::Releasing(t) => released = Some(t),
            Ev::Acquired(t) => {
                if let Some(r) = released.take() {
                    latencies.push(t - r);
                }
            }
        }
    }
    Stats {
        cycles: latencies.len(),
        elapsed: start.elapsed(),
        latencies,
    }
}

// ---------------------------------------------------------------------------------------------
// Renewal

const RENEWED: usize = 10_000;
const RENEW_TTL: Duration = Duration::from_secs(3);

/// 10,000 locks held with `auto_renew` on one locker for two ttls: what renewal costs.
async fn renewal(lockers: &[(&'static str, Locker)]) {
    println!();
    println!(
        "Renewal: {RENEWED} locks held with auto_renew (ttl {RENEW_TTL:?}, so each is extended"
    );
    println!(
        "about every second) on one locker, measured over {:?}.",
        RENEW_TTL * 2
    );
    println!();
    println!("| backend | statements/s | leases per statement | statement time per second | wake-ups/s |");
    println!("|---|---|---|---|---|");
    for (name, locker) in lockers {
        // A locker of its own, so only these leases are in its renewal set.
        let own = locker.table("dblock_bench_renew");
        own.migrate().await.unwrap();
        let keys: Vec<String> = (0..RENEWED).map(|i| format!("renew:{i}")).collect();
        let mut guards = Vec::with_capacity(RENEWED);
        for chunk in keys.chunks(500) {
            let taken = own
                .lock_all(chunk)
                .ttl(RENEW_TTL)
                .await
                .expect("10,000 free keys");
            guards.extend(taken.into_iter().map(dblock::LockGuard::auto_renew));
        }
        // Let the first round settle, then measure.
        tokio::time::sleep(RENEW_TTL / 2).await;
        let before = dblock::test_util::renewal_stats(&own);
        let window = RENEW_TTL * 2;
        tokio::time::sleep(window).await;
        let after = dblock::test_util::renewal_stats(&own);
        let lost = guards.iter().filter(|g| g.is_lost()).count();
        let (ticks, statements, leases, busy) = (
            after.0 - before.0,
            after.1 - before.1,
            after.2 - before.2,
            after.3 - before.3,
        );
        let per_s = |n: u64| n as f64 / window.as_secs_f64();
        println!(
            "| {name} | {:.1} | {:.0} | {:.1} ms | {:.1} |{}",
            per_s(statements),
            leases as f64 / statements.max(1) as f64,
            busy.as_secs_f64() * 1e3 / window.as_secs_f64(),
            per_s(ticks),
            if lost > 0 {
                format!(" {lost} LOST")
            } else {
                String::new()
            }
        );
        drop(guards);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Chart

/// A grouped bar chart of cycles/s (log scale), one group per backend and owner count.
fn chart(bars: &[Bar], title: &str) -> String {
    let mut groups: Vec<(&str, usize)> = Vec::new();
    for b in bars {
        if !groups.contains(&(b.backend, b.owners)) {
            groups.push((b.backend, b.owners));
        }
    }
    let mut imps: Vec<&str> = Vec::new();
    for b in bars {
        if !imps.contains(&b.imp.as_str()) {
            imps.push(&b.imp);
        }
    }
    let palette = [
        "#1b6ca8", "#9bc1e0", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#edc948", "#76b7b2",
        "#ff9da7", "#9c755f",
    ];
    let (left, top, bar_w, gap, plot_h) = (70.0, 30.0, 14.0, 26.0, 300.0);
    let group_w = |g: &(&str, usize)| {
        bars.iter().filter(|b| (b.backend, b.owners) == *g).count() as f64 * bar_w
    };
    let width = left + groups.iter().map(|g| group_w(g) + gap).sum::<f64>() + 230.0;
    let height = top + plot_h + 70.0;
    let max = bars.iter().map(|b| b.rate).fold(1.0, f64::max);
    let (lo, hi) = (100f64.log10(), (max * 1.5).log10());
    let y = |v: f64| top + plot_h - (v.max(100.0).log10() - lo) / (hi - lo) * plot_h;
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" font-family="sans-serif" font-size="11">"#
    );
    let _ = write!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = write!(
        svg,
        r#"<text x="{left}" y="18" font-size="13">{title}</text>"#
    );
    let mut tick = 100.0;
    while tick <= max * 1.5 {
        let ty = y(tick);
        let _ = write!(
            svg,
            r##"<line x1="{left}" x2="{:.0}" y1="{ty:.1}" y2="{ty:.1}" stroke="#ddd"/><text x="{:.0}" y="{:.1}" text-anchor="end">{tick:.0}</text>"##,
            width - 230.0,
            left - 6.0,
            ty + 4.0
        );
        tick *= 10.0;
    }
    let mut x = left + gap / 2.0;
    for g in &groups {
        let start = x;
        for b in bars.iter().filter(|b| (b.backend, b.owners) == *g) {
            let i = imps.iter().position(|i| *i == b.imp).unwrap_or(0);
            let by = y(b.rate);
            let _ = write!(
                svg,
                r#"<rect x="{x:.1}" y="{by:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{} {} owners, {}: {:.0}/s</title></rect>"#,
                bar_w - 2.0,
                top + plot_h - by,
                palette[i % palette.len()],
                b.backend,
                b.owners,
                b.imp,
                b.rate
            );
            x += bar_w;
        }
        let _ = write!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text><text x="{:.1}" y="{:.1}" text-anchor="middle">{} owner{}</text>"#,
            (start + x) / 2.0,
            top + plot_h + 16.0,
            g.0,
            (start + x) / 2.0,
            top + plot_h + 30.0,
            g.1,
            if g.1 == 1 { "" } else { "s" }
        );
        x += gap;
    }
    let lx = width - 220.0;
    for (i, imp) in imps.iter().enumerate() {
        let ly = top + 14.0 * i as f64;
        let _ = write!(
            svg,
            r#"<rect x="{lx:.0}" y="{ly:.0}" width="10" height="10" fill="{}"/><text x="{:.0}" y="{:.0}">{imp}</text>"#,
            palette[i % palette.len()],
            lx + 14.0,
            ly + 9.0
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// Starts each run from an empty table (and queue) of the current schema.
async fn drop_table(url: &str, table: &str) {
    let sql = format!("DROP TABLE IF EXISTS {table}, {table}_queue");
    if url.starts_with("postgres") {
        let pool = sqlx::PgPool::connect(url).await.unwrap();
        sqlx::query(AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .unwrap();
    } else if url.starts_with("mysql") {
        let pool = sqlx::MySqlPool::connect(url).await.unwrap();
        sqlx::query(AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .unwrap();
    }
}

/// The PostgreSQL server's own URL (`DBLOCK_POSTGRES_URL`, or the local test server's).
fn postgres_url() -> String {
    std::env::var("DBLOCK_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}
