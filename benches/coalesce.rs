//! Part 6 of the benchmark, **coalescing** (`DBLOCK_BENCH_PARTS=coalesce`): lock + unlock
//! cycles on distinct keys at 1, 8 and 64 owners, by one `Locker` with coalescing (the default)
//! and by one with `coalesce(false)`, alternating in rounds (one owner: cycle by cycle within
//! each round, [`paired`]); ratios are medians of per-round ratios. From 8 owners, in the same
//! rounds, the library's own coalesced statements with none of its machinery
//! ([`raw_batches`]): the same keys in flight in perfectly formed batches, the batched ceiling
//! on PostgreSQL and MySQL/MariaDB (on SQLite the lane sends the kinds together in one
//! transaction, which these separate statements do not, and beats them). PostgreSQL:
//! `pgbench` on the design's minimal statements with as many clients, interleaved in the same
//! rounds. Beside them, each server's session lock and the Redis lock at the same owner counts.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use dblock::{ConnectOptions, Locker};

use crate::{
    median, merge, owner_keys, pgbench, run, Bar, Cycle, Dblock, Stats, KEYS_PER_OWNER,
    PGBENCH_SCRIPT, TTL,
};

const OWNERS: [usize; 3] = [1, 8, 64];

/// Rounds of a cell, the sides taking turns. Nine, not five: on the 2-core VM the one-owner
/// cells' medians of five rounds moved by up to 15 % between runs minutes apart (PgBouncer:
/// 0.90, 1.05, 0.92 and 0.95 on 2026-11-26, the same code on both sides), while each round's
/// ratio moves by about as much; a median of nine halves the chance that a burst of the
/// machine's noise decides it.
const ROUNDS: usize = 9;

/// A round's length a side, as a share of `DBLOCK_BENCH_SECS` (5 s by default: 1 s).
const ROUND_SHARE: f64 = 0.2;

/// The part's rows for every backend in `targets` (name, URL, options).
pub(crate) async fn coalescing(
    targets: &[(&'static str, String, ConnectOptions)],
    redis: &[(&'static str, Arc<dyn Cycle>)],
    secs: f64,
) -> Vec<Bar> {
    let mut bars = Vec::new();
    println!();
    println!(
        "Coalescing: lock + unlock cycles on distinct keys, coalesced (the default) and not \
         (`coalesce(false)`), {ROUNDS} alternating rounds of {:.1} s a side",
        secs * ROUND_SHARE
    );
    println!();
    println!("| backend | owners | impl | cycles/s | p50 | p99 | ratio |");
    println!("|---|---|---|---|---|---|---|");
    let round = Duration::from_secs_f64(secs * ROUND_SHARE);
    for (name, url, options) in targets {
        // DBLOCK_BENCH_POOL=n: both lockers with pools of n connections (the coalescing
        // locker's slots per kind; see `Backend::coalesce_slots`).
        let options = match std::env::var("DBLOCK_BENCH_POOL")
            .ok()
            .and_then(|n| n.parse().ok())
        {
            Some(n) => options.clone().max_connections(n),
            None => options.clone(),
        };
        let on = match Locker::connect_with(url, options.clone()).await {
            Ok(l) => l.table("dblock_bench"),
            Err(e) => {
                println!("| {name} | – | skipped: {e} | | | | |");
                continue;
            }
        };
        on.migrate().await.unwrap();
        let off = Locker::connect_with(url, options.clone().coalesce(false))
            .await
            .unwrap()
            .table("dblock_bench");
        let counted = on.clone();
        let raw = Arc::new(dblock::test_util::statements(&on));
        let on: Arc<dyn Cycle> = Arc::new(Dblock(on));
        let off: Arc<dyn Cycle> = Arc::new(Dblock(off));
        let pg = *name == "postgres";
        // DBLOCK_BENCH_OWNERS=64: only these owner counts.
        let owner_counts: Vec<usize> = std::env::var("DBLOCK_BENCH_OWNERS")
            .ok()
            .map(|v| v.split(',').filter_map(|n| n.parse().ok()).collect())
            .unwrap_or_else(|| OWNERS.to_vec());
        for owners in owner_counts {
            for imp in [&on, &off] {
                run(imp.clone(), owners, Duration::from_millis(300), "warm").await;
            }
            let before = dblock::test_util::coalesced(&counted);
            let (mut a, mut b) = (None::<Stats>, None::<Stats>);
            let (mut ratio, mut vs_pgbench, mut pgb) = (Vec::new(), Vec::new(), Vec::new());
            // The raw coalesced statements (from 8 owners): their rounds, dblock's share of
            // them, and their ratio to pgbench in the same round.
            let batched = owners >= 2 * SENDERS;
            let (mut c, mut of_raw, mut raw_vs_pgbench) = (None::<Stats>, Vec::new(), Vec::new());
            for i in 0..ROUNDS {
                vacuum(name).await;
                // The sides take turns at going first (and the raw statements at going first,
                // second or last): none of them always meets the table as the others left it.
                let (mut x, mut y, mut z) = (None, None, None);
                let turns = if batched { 3 } else { 2 };
                if owners == 1 {
                    // One owner: the sides take turns cycle by cycle ([`paired`]).
                    let (a, b) = paired(&on, &off, round * 2).await;
                    (x, y) = (Some(a), Some(b));
                } else {
                    for j in 0..turns {
                        match (i + j) % turns {
                            0 => x = Some(run(on.clone(), owners, round, "on").await),
                            1 => y = Some(run(off.clone(), owners, round, "off").await),
                            _ => z = Some(raw_batches(&raw, owners, round).await),
                        }
                    }
                }
                let (x, y) = (x.unwrap(), y.unwrap());
                ratio.push(x.rate() / y.rate());
                if let Some(z) = &z {
                    of_raw.push(x.rate() / z.rate());
                }
                if pg {
                    // pgbench runs whole seconds; its round is one second.
                    match pgbench(
                        url,
                        owners,
                        Duration::from_secs(1),
                        PGBENCH_SCRIPT.into(),
                        false,
                    )
                    .await
                    {
                        Ok(tps) => {
                            vs_pgbench.push(x.rate() / tps);
                            if let Some(z) = &z {
                                raw_vs_pgbench.push(z.rate() / tps);
                            }
                            pgb.push(tps);
                        }
                        Err(e) => println!("| {name} | {owners} | pgbench: {e} | | | | |"),
                    }
                }
                merge(&mut a, x);
                merge(&mut b, y);
                if let Some(z) = z {
                    merge(&mut c, z);
                }
            }
            let (mut a, mut b) = (a.unwrap(), b.unwrap());
            let row = |imp: &str, s: &mut Stats, note: String| {
                println!(
                    "| {name} | {owners} | {imp} | {:.0} | {} | {} | {note} |",
                    s.rate(),
                    s.ms(0.50),
                    s.ms(0.99)
                );
            };
            row("dblock, coalesce(false)", &mut b, String::new());
            bars.push(Bar {
                backend: name,
                owners,
                imp: "coalesce(false)".into(),
                rate: b.rate(),
            });
            bars.push(Bar {
                backend: name,
                owners,
                imp: "coalesced".into(),
                rate: a.rate(),
            });
            let after = dblock::test_util::coalesced(&counted);
            let (statements, rows) = (after.0 - before.0, after.1 - before.1);
            // Calls that went alone are the rest of the cycles' two statements each.
            let alone = (a.cycles as u64 * 2).saturating_sub(rows);
            let rounds = each(&ratio);
            row(
                "dblock (coalesced)",
                &mut a,
                format!(
                    "{:.2}× coalesce(false) (rounds: {rounds}); {statements} coalesced statements of {:.1} rows, {alone} alone",
                    median(ratio),
                    rows as f64 / statements.max(1) as f64
                ),
            );
            if let Some(mut c) = c {
                let mut note = format!("coalesced dblock is {:.2} of it", median(of_raw));
                if !raw_vs_pgbench.is_empty() {
                    let _ = write!(note, "; it is {:.2}× pgbench", median(raw_vs_pgbench));
                }
                row(
                    &format!(
                        "raw coalesced statements, {SENDERS} senders of {} rows",
                        owners / SENDERS
                    ),
                    &mut c,
                    note,
                );
                bars.push(Bar {
                    backend: name,
                    owners,
                    imp: "raw coalesced statements".into(),
                    rate: c.rate(),
                });
            }
            if !pgb.is_empty() {
                let tps = median(pgb);
                let rounds = each(&vs_pgbench);
                println!(
                    "| {name} | {owners} | pgbench, minimal statements | {tps:.0} | | | coalesced dblock is {:.2}× it (rounds: {rounds}) |",
                    median(vs_pgbench)
                );
                bars.push(Bar {
                    backend: name,
                    owners,
                    imp: "pgbench, minimal".into(),
                    rate: tps,
                });
            }
            if let Some((label, peer)) = crate::peer_for(name, url).await {
                let mut p = crate::measure(peer, owners, secs * ROUND_SHARE).await;
                row(&format!("peer: {label}"), &mut p, String::new());
                bars.push(Bar {
                    backend: name,
                    owners,
                    imp: label.into(),
                    rate: p.rate(),
                });
            }
            if *name == "postgres" {
                for (label, peer) in redis {
                    let mut p = crate::measure(peer.clone(), owners, secs * ROUND_SHARE).await;
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
        }
    }
    bars
}

/// One owner's lock + unlock cycles on both sides at once for `secs`, taking turns cycle by
/// cycle (on, off, off, on, on, off, …), in a task of its own as [`run`]'s owners are; each
/// side's time is the sum of its own cycles. A lone caller's cycles do not depend on each
/// other, so each pair meets the same machine: in rounds of 1 s a side, one side after the
/// other, a burst of the VM's noise decided whole rounds (one-owner rounds' ratios of 0.86 to
/// 1.40 on 2026-11-27, with the same statement on both sides).
async fn paired(on: &Arc<dyn Cycle>, off: &Arc<dyn Cycle>, secs: Duration) -> (Stats, Stats) {
    let (on, off) = (on.clone(), off.clone());
    let sides = tokio::spawn(async move {
        let owner = dblock::Owner::new().id().to_owned();
        let keys = [owner_keys("on", 0), owner_keys("off", 0)];
        let mut latencies = [Vec::new(), Vec::new()];
        let start = std::time::Instant::now();
        let mut i = 0;
        while start.elapsed() < secs {
            let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
            for side in order {
                let imp = if side == 0 { &on } else { &off };
                let t = std::time::Instant::now();
                imp.cycle(&keys[side][i % KEYS_PER_OWNER], &owner).await;
                latencies[side].push(t.elapsed());
            }
            i += 1;
        }
        latencies
    });
    let [x, y] = sides.await.unwrap().map(|latencies| Stats {
        cycles: latencies.len(),
        elapsed: latencies.iter().sum(),
        latencies,
    });
    (x, y)
}

/// A cell's per-round ratios, in the order the rounds ran: how far the machine moved them.
fn each(ratios: &[f64]) -> String {
    ratios
        .iter()
        .map(|r| format!("{r:.2}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Tasks that send the raw coalesced statements: one per core of the machine the figures in
/// the README come from (2), so that the server can run two statements at once. (On that
/// machine, 64 owners' keys in 1, 2, 4 and 8 senders' batches: 39, 35, 35 and 27 thousand
/// cycles/s in one run, `benches/profile.rs` with `DBLOCK_PROFILE_SENDERS`; 2 is the shape a
/// coalescing locker's two lanes, acquires and releases, come closest to.)
const SENDERS: usize = 2;

/// The raw coalesced statements for `owners` owners: the same keys in flight (each owner
/// cycling over keys of its own, as in [`run`]), but in batches formed perfectly, with none of
/// the client's machinery: [`SENDERS`] tasks, each acquiring its share of the owners' next keys
/// in one coalesced statement and releasing them in another (`test_util::Statements::
/// acquire_batch`, `release_batch`: the library's own statements, binds and pool). A latency
/// is one such acquire and release, shared by the owners of the batch.
async fn raw_batches(
    raw: &Arc<dblock::test_util::Statements>,
    owners: usize,
    secs: Duration,
) -> Stats {
    let start = std::time::Instant::now();
    let per = owners / SENDERS;
    let tasks: Vec<_> = (0..SENDERS)
        .map(|t| {
            let raw = raw.clone();
            tokio::spawn(async move {
                let owner = dblock::Owner::new().id().to_owned();
                let (mut cycles, mut lat) = (0, Vec::new());
                let mut i = 0;
                while start.elapsed() < secs {
                    let mut keys: Vec<String> = (0..per)
                        .map(|o| format!("bench:raw:{}:{}", t * per + o, i % KEYS_PER_OWNER))
                        .collect();
                    keys.sort_unstable();
                    let began = std::time::Instant::now();
                    raw.cycle_batch(&keys, &owner, TTL)
                        .await
                        .expect("raw coalesced statements");
                    let took = began.elapsed();
                    lat.extend(std::iter::repeat_n(took, per));
                    cycles += per;
                    i += 1;
                }
                (cycles, lat)
            })
        })
        .collect();
    let (mut cycles, mut latencies) = (0, Vec::new());
    for t in tasks {
        let (n, lat) = t.await.unwrap();
        cycles += n;
        latencies.extend(lat);
    }
    Stats {
        cycles,
        elapsed: start.elapsed(),
        latencies,
    }
}

/// PostgreSQL: `VACUUM` of the benchmark's table before a round, outside its timing. The test
/// server here runs with `autovacuum = off`, and a lock table is all updates: without it the
/// dead row versions of earlier rounds (pgbench's included) pile up, and the rounds after the
/// first lost up to half their rate, the coalesced statements (which read every row of a batch
/// twice: the row locks in key order, then the update) more than the one-row ones. Any server
/// with its default autovacuum keeps the table so.
/// (Through the server itself: the PostgreSQL entries share one database, and PgBouncer would
/// refuse sqlx's start-up parameters.)
async fn vacuum(name: &str) {
    if !name.starts_with("postgres") {
        return;
    }
    let url = crate::postgres_url();
    let vacuumed = async {
        let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&url).await?;
        sqlx::raw_sql("VACUUM dblock_bench")
            .execute(&mut conn)
            .await?;
        sqlx::Connection::close(conn).await
    };
    if let Err(e) = vacuumed.await {
        eprintln!("{name}: VACUUM dblock_bench: {e}");
    }
}
