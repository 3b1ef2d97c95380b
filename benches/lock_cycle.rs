//! Lock + unlock cycles through dblock's `Locker`, against the same SQL statements sent directly
//! through sqlx on an identically configured pool (the ceiling), on every reachable backend.
//!
//! `cargo bench -p dblock --all-features --bench lock_cycle` (release build). Prints a Markdown
//! table with cycles/s, p50/p99 latency per cycle and the dblock/ceiling ratio.
//! `DBLOCK_BENCH_SECS` sets the measured seconds per side and cell (default 5), split over 10
//! alternating rounds; the ratio printed is the median of the per-round ratios, so slow drift of
//! the machine hits both sides alike. `DBLOCK_BENCH_ONLY=postgres,mariadb`
//! limits the backends.

use std::future::Future;
use std::pin::Pin;

use std::sync::Arc;
use std::time::{Duration, Instant};

use dblock::Locker;
use sqlx::AssertSqlSafe;

const TTL: Duration = Duration::from_secs(30);
const KEYS_PER_OWNER: usize = 64;
/// Measured rounds per cell, alternating raw and dblock.
const ROUNDS: usize = 10;

type BoxFut<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// One lock+unlock cycle on `key`, by one of the two implementations.
trait Cycle: Send + Sync + 'static {
    fn cycle<'a>(&'a self, key: &'a str, owner: &'a str) -> BoxFut<'a>;
}

struct Dblock(Locker);

impl Cycle for Dblock {
    fn cycle<'a>(&'a self, key: &'a str, _owner: &'a str) -> BoxFut<'a> {
        Box::pin(async move {
            let g = self.0.lock(key).ttl(TTL).await.expect("dblock lock");
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
                let keys: Vec<String> = (0..KEYS_PER_OWNER)
                    .map(|k| format!("bench:{tag}:{o}:{k}"))
                    .collect();
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

/// The ceiling on a second, identically configured pool of its own.
async fn raw_for(url: &str, table: &str) -> Raw {
    let own = Locker::connect(url).await.unwrap().table(table);
    Raw(dblock::test_util::statements(&own))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
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
    let pg = std::env::var("DBLOCK_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let my = std::env::var("DBLOCK_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());

    let mut handoffs = Vec::new();
    println!("| backend | owners | impl | cycles/s | p50 | p99 | dblock / ceiling |");
    println!("|---|---|---|---|---|---|---|");
    for (name, url) in [
        ("sqlite", sqlite_url.as_str()),
        ("postgres", pg.as_str()),
        ("mariadb", my.as_str()),
    ] {
        if std::env::var("DBLOCK_BENCH_ONLY").is_ok_and(|only| !only.split(',').any(|o| o == name))
        {
            continue;
        }
        let locker = match Locker::connect(url).await {
            Ok(l) => l.table("dblock_bench"),
            Err(e) => {
                println!("| {name} | – | skipped: {e} | | | | |");
                continue;
            }
        };
        drop_table(url, "dblock_bench").await;
        locker.migrate().await.unwrap();
        let dblock: Arc<dyn Cycle> = Arc::new(Dblock(locker.clone()));
        let raw: Arc<dyn Cycle> = Arc::new(raw_for(url, locker.table_name()).await);
        for owners in [1, 8] {
            // Warm both pools and statement caches.
            run(raw.clone(), owners, Duration::from_millis(300), "raw").await;
            run(dblock.clone(), owners, Duration::from_millis(300), "dblock").await;
            let (mut r, mut d) = (None, None);
            let mut ratios = Vec::new();
            for i in 0..ROUNDS {
                // Alternate which side goes first, so neither always runs on a warmer cache.
                let (a, b) = if i % 2 == 0 {
                    let a = run(raw.clone(), owners, round, "raw").await;
                    (a, run(dblock.clone(), owners, round, "dblock").await)
                } else {
                    let b = run(dblock.clone(), owners, round, "dblock").await;
                    (run(raw.clone(), owners, round, "raw").await, b)
                };
                ratios.push(b.rate() / a.rate());
                merge(&mut r, a);
                merge(&mut d, b);
            }
            let (mut r, mut d) = (r.unwrap(), d.unwrap());
            ratios.sort_by(f64::total_cmp);
            // The median of per-round ratios: each round compares the two sides under the same
            // machine conditions, which vary a lot on a small VM (fsync latency above all).
            let ratio = ratios[ratios.len() / 2];
            for (label, s, ratio) in [
                ("raw sqlx (ceiling)", &mut r, String::new()),
                ("dblock", &mut d, format!("{ratio:.2}")),
            ] {
                println!(
                    "| {name} | {owners} | {label} | {:.0} | {:.2} ms | {:.2} ms | {ratio} |",
                    s.rate(),
                    s.pct(0.50).as_secs_f64() * 1e3,
                    s.pct(0.99).as_secs_f64() * 1e3,
                );
            }
            // A peer for scale: the server's own session-bound lock, in memory (no row, no
            // commit to disk, no expiry, no fencing, and gone if the connection drops).
            if let Some(peer) = peer_for(name, url).await {
                let (label, peer) = peer;
                run(peer.clone(), owners, Duration::from_millis(300), "peer").await;
                let mut p = run(peer, owners, round * (ROUNDS as u32), "peer").await;
                println!(
                    "| {name} | {owners} | peer: {label} | {:.0} | {:.2} ms | {:.2} ms | {:.2} (dblock / peer) |",
                    p.rate(),
                    p.pct(0.50).as_secs_f64() * 1e3,
                    p.pct(0.99).as_secs_f64() * 1e3,
                    d.rate() / p.rate(),
                );
            }
        }
        handoffs.push((name, locker));
    }

    println!();
    println!(
        "Hand-off under contention: {WAITERS} owners take turns on one key, each holding it for"
    );
    println!("`hold`; time from the holder's release() call to the next owner's lock() returning.");
    println!();
    println!("| backend | hold | wake-up | hand-offs | p50 | p99 |");
    println!("|---|---|---|---|---|---|");
    let handoff_secs = Duration::from_secs_f64(secs.max(2.0));
    for (name, locker) in handoffs {
        for hold in HOLDS {
            if name == "postgres" {
                let polling = dblock::test_util::polling_only(&locker);
                let mut s = handoff(polling, handoff_secs, hold).await;
                print_handoff(name, hold, "polling only", &mut s);
            }
            let mut s = handoff(locker.clone(), handoff_secs, hold).await;
            let how = if name == "postgres" {
                "LISTEN/NOTIFY + polling"
            } else {
                "polling (jittered backoff)"
            };
            print_handoff(name, hold, how, &mut s);
        }
    }
}

const WAITERS: usize = 8;
/// A short hold keeps every waiter polling fast; a long one lets their backoff grow.
const HOLDS: [Duration; 2] = [Duration::from_millis(1), Duration::from_millis(50)];

fn print_handoff(name: &str, hold: Duration, how: &str, s: &mut Stats) {
    let (p50, p99) = (s.pct(0.50), s.pct(0.99));
    println!(
        "| {name} | {hold:?} | {how} | {} | {:.2} ms | {:.2} ms |",
        s.cycles,
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3
    );
}

/// `WAITERS` owners loop on one key for `secs`; returns release→next-acquire latencies.
async fn handoff(locker: Locker, secs: Duration, hold: Duration) -> Stats {
    #[derive(Clone, Copy)]
    enum Ev {
        Acquired(Instant),
        Releasing(Instant),
    }
    let events = Arc::new(std::sync::Mutex::new(Vec::new()));
    let start = Instant::now();
    let tasks: Vec<_> = (0..WAITERS)
        .map(|_| {
            let (locker, events) = (locker.clone(), events.clone());
            tokio::spawn(async move {
                while start.elapsed() < secs {
                    let g = locker
                        .lock("handoff")
                        .ttl(TTL)
                        .wait(Duration::from_secs(30))
                        .await
                        .expect("handoff lock");
                    events.lock().unwrap().push(Ev::Acquired(Instant::now()));
                    tokio::time::sleep(hold).await;
                    events.lock().unwrap().push(Ev::Releasing(Instant::now()));
                    g.release().await.expect("handoff release");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
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

/// Starts each run from an empty table of the current schema.
async fn drop_table(url: &str, table: &str) {
    let sql = format!("DROP TABLE IF EXISTS {table}");
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
