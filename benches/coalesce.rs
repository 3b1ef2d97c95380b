//! Part 6 of the benchmark, **coalescing** (`DBLOCK_BENCH_PARTS=coalesce`): lock + unlock
//! cycles on distinct keys at 1, 8 and 64 owners, by one `Locker` with coalescing (the default)
//! and by one with `coalesce(false)`, alternating in rounds; ratios are medians of per-round
//! ratios. PostgreSQL: `pgbench` on the design's minimal statements with as many clients,
//! interleaved in the same rounds. Beside them, each server's session lock and the Redis lock
//! at the same owner counts.

use std::sync::Arc;
use std::time::Duration;

use dblock::{ConnectOptions, Locker};

use crate::{median, merge, pgbench, run, Bar, Cycle, Dblock, Stats, PGBENCH_SCRIPT};

const OWNERS: [usize; 3] = [1, 8, 64];
const ROUNDS: usize = 5;

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
        secs / ROUNDS as f64
    );
    println!();
    println!("| backend | owners | impl | cycles/s | p50 | p99 | ratio |");
    println!("|---|---|---|---|---|---|---|");
    let round = Duration::from_secs_f64(secs / ROUNDS as f64);
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
            for i in 0..ROUNDS {
                vacuum(name).await;
                let first_on = i % 2 == 0;
                let mut sides = [(true, &on, "on"), (false, &off, "off")];
                if !first_on {
                    sides.reverse();
                }
                let (mut x, mut y) = (None, None);
                for (is_on, imp, tag) in sides {
                    let s = run(imp.clone(), owners, round, tag).await;
                    if is_on {
                        x = Some(s);
                    } else {
                        y = Some(s);
                    }
                }
                let (x, y) = (x.unwrap(), y.unwrap());
                ratio.push(x.rate() / y.rate());
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
                            pgb.push(tps);
                        }
                        Err(e) => println!("| {name} | {owners} | pgbench: {e} | | | | |"),
                    }
                }
                merge(&mut a, x);
                merge(&mut b, y);
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
            row(
                "dblock (coalesced)",
                &mut a,
                format!(
                    "{:.2}× coalesce(false); {statements} coalesced statements of {:.1} rows, {alone} alone",
                    median(ratio),
                    rows as f64 / statements.max(1) as f64
                ),
            );
            if !pgb.is_empty() {
                let tps = median(pgb);
                println!(
                    "| {name} | {owners} | pgbench, minimal statements | {tps:.0} | | | coalesced dblock is {:.2}× it |",
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
                let mut p = crate::measure(peer, owners, secs / ROUNDS as f64).await;
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
                    let mut p = crate::measure(peer.clone(), owners, secs / ROUNDS as f64).await;
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
