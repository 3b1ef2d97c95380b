//! (b) Lock + unlock cycles/s on distinct keys at 1 to 1,000 owners: dblock coalesced (the
//! default) and `coalesce(false)`, alternating in rounds, beside the peers the other parts
//! use (`peer_for`: advisory locks, `GET_LOCK`; `redis_lock`: Redis `SET NX PX` + owner-checked
//! Lua delete) and pgbench on the design's minimal statements.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dblock::Locker;

use super::chart::{lines, Panel};
use super::{ms, Report, Target, TABLE};
use crate::{median, merge, BoxFut, Cycle, Stats};

const OWNERS: [usize; 5] = [1, 8, 64, 256, 1000];
/// Rounds per cell, the two dblock sides taking turns at going first.
const ROUNDS: usize = 3;
/// A round's length a side, as a share of `DBLOCK_BENCH_SECS` (5 s by default: 1 s).
const ROUND_SHARE: f64 = 0.2;

/// dblock's cycle as `crate::Dblock`'s, counting failures (a pool or `wait` time-out at 1,000
/// owners) instead of panicking on them.
struct Counting {
    locker: Locker,
    failed: AtomicUsize,
}

impl Cycle for Counting {
    fn cycle<'a>(&'a self, key: &'a str, _owner: &'a str) -> BoxFut<'a> {
        Box::pin(async move {
            match self
                .locker
                .lock(key)
                .ttl(crate::TTL)
                .wait(crate::WAIT)
                .await
            {
                Ok(g) => {
                    if g.release().await.is_err() {
                        self.failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Err(_) => {
                    self.failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    }
}

/// The owner counts: `DBLOCK_BENCH_OWNERS=1,8` for a short run, else all.
fn owner_counts() -> Vec<usize> {
    std::env::var("DBLOCK_BENCH_OWNERS")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.parse().ok()).collect())
        .unwrap_or_else(|| OWNERS.to_vec())
}

/// Whether `clients` more connections fit under PostgreSQL's `max_connections` now: `Err`
/// with the reason if not.
async fn room_for(url: &str, clients: usize) -> Result<(), String> {
    let counts = async {
        let mut c = <sqlx::PgConnection as sqlx::Connection>::connect(url).await?;
        let max: String = sqlx::query_scalar("SHOW max_connections")
            .fetch_one(&mut c)
            .await?;
        let reserved: String = sqlx::query_scalar("SHOW superuser_reserved_connections")
            .fetch_one(&mut c)
            .await?;
        let used: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity")
            .fetch_one(&mut c)
            .await?;
        Ok::<_, sqlx::Error>((
            max.parse::<i64>().unwrap_or(0),
            reserved.parse::<i64>().unwrap_or(0),
            used,
        ))
    };
    let (max, reserved, used) = counts.await.map_err(|e| e.to_string())?;
    if clients as i64 + used + reserved > max {
        Err(format!(
            "not run: pgbench opens a connection per client; {clients} clients do not fit under \
             max_connections {max} ({used} in use, {reserved} reserved)"
        ))
    } else {
        Ok(())
    }
}

fn row(report: &mut Report, cells: [&str; 4], s: &mut Stats, failed: usize, note: String) {
    let rate = (s.cycles - failed.min(s.cycles)) as f64 / s.elapsed.as_secs_f64();
    let mut note = note;
    if failed > 0 {
        note.push_str(&format!("; {failed} cycles failed (not counted)"));
    }
    report.row(&[
        cells[0].into(),
        cells[1].into(),
        cells[2].into(),
        cells[3].into(),
        format!("{rate:.0}"),
        ms(s.pct(0.5).as_secs_f64() * 1e3),
        ms(s.pct(0.99).as_secs_f64() * 1e3),
        note,
    ]);
}

fn rate(s: &Stats, failed: usize) -> f64 {
    (s.cycles - failed.min(s.cycles)) as f64 / s.elapsed.as_secs_f64()
}

pub(crate) async fn run(targets: &[Target], redis: Option<&str>, report: &mut Report, secs: f64) {
    let round = Duration::from_secs_f64(secs * ROUND_SHARE);
    let side = round * ROUNDS as u32;
    let owners = owner_counts();
    report.section(
        "(b) Cycles/s on distinct keys, 1 to 1,000 owners",
        &format!(
            "Each owner is a task that locks and releases keys of its own (64 in turn; ttl 30 s) \
             as fast as it can; owners share one `Locker` (pool of 10 connections, SQLite 8). \
             dblock coalesced (the default: concurrent calls on distinct keys share one \
             statement) and `coalesce(false)` alternate in {ROUNDS} rounds of {:.1} s a side, \
             each round's first side alternating; cycles/s over all rounds, the ratio the median \
             of the rounds' ratios; p50/p99 of one cycle's latency. PostgreSQL is vacuumed before \
             each round (the server runs without autovacuum). Peers, {:.1} s each after 0.3 s \
             of warm-up: the servers' session locks (`pg_try_advisory_lock` / \
             `pg_advisory_unlock` on a hash of the key, `GET_LOCK(key, 0)` / `RELEASE_LOCK`), one \
             cycle per pooled connection of a pool of 10, so above 10 owners the owners queue \
             for a connection as dblock's do; Redis `SET key token NX PX` + an owner-checked Lua \
             delete on one multiplexed connection; pgbench (C, prepared, one connection per \
             client) on the design's minimal acquire and release statements on the same table, \
             where the clients fit under `max_connections`. Through PgBouncer no peer runs: \
             session locks do not survive transaction pooling.",
            round.as_secs_f64(),
            side.as_secs_f64()
        ),
    );
    report.header(&[
        "backend",
        "owners",
        "implementation",
        "connections",
        "cycles/s",
        "p50",
        "p99",
        "note",
    ]);
    let mut panels = Vec::new();
    for t in targets {
        // pgbench first, before this target's pools hold connections of their own: its
        // clients are connections, and the server's max_connections bounds them.
        let mut pgbench = Vec::new();
        if t.name == "postgres" {
            super::vacuum(t).await;
            for &n in &owners {
                let tps = match room_for(&t.direct, n).await {
                    Ok(()) => {
                        let script = crate::PGBENCH_SCRIPT.replace("dblock_bench", TABLE);
                        crate::pgbench(&t.url, n, side, script, true).await
                    }
                    Err(e) => Err(e),
                };
                pgbench.push(tps);
            }
        }
        let (on, off) = match (
            t.locker().await,
            Locker::connect_with(&t.url, t.options().coalesce(false)).await,
        ) {
            (Ok(on), Ok(off)) => (on, off.table(TABLE)),
            (Err(e), _) | (_, Err(e)) => {
                report.row(&[t.name.into(), format!("skipped: {e}")]);
                continue;
            }
        };
        let pool = if t.name == "sqlite" {
            "pool of 8"
        } else {
            "pool of 10"
        };
        let on = Arc::new(Counting {
            locker: on,
            failed: AtomicUsize::new(0),
        });
        let off = Arc::new(Counting {
            locker: off,
            failed: AtomicUsize::new(0),
        });
        let peer = crate::peer_for(t.name, &t.url).await;
        let mut series: Vec<(String, Vec<(f64, f64)>)> = vec![
            ("dblock (coalesced)".into(), Vec::new()),
            ("dblock, coalesce(false)".into(), Vec::new()),
        ];
        for (i, &n) in owners.iter().enumerate() {
            let sides: [Arc<dyn Cycle>; 2] = [on.clone(), off.clone()];
            for imp in &sides {
                crate::run(imp.clone(), n, Duration::from_millis(300), "warm").await;
            }
            let failed_before = [
                on.failed.load(Ordering::Relaxed),
                off.failed.load(Ordering::Relaxed),
            ];
            let (mut a, mut b) = (None::<Stats>, None::<Stats>);
            let mut ratios = Vec::new();
            for r in 0..ROUNDS {
                super::vacuum(t).await;
                let (mut x, mut y) = (None, None);
                for j in 0..2 {
                    if (r + j) % 2 == 0 {
                        x = Some(crate::run(sides[0].clone(), n, round, "s-on").await);
                    } else {
                        y = Some(crate::run(sides[1].clone(), n, round, "s-off").await);
                    }
                }
                let (x, y) = (x.unwrap(), y.unwrap());
                ratios.push(x.rate() / y.rate());
                merge(&mut a, x);
                merge(&mut b, y);
            }
            let failed = [
                on.failed.load(Ordering::Relaxed) - failed_before[0],
                off.failed.load(Ordering::Relaxed) - failed_before[1],
            ];
            let (mut a, mut b) = (a.unwrap(), b.unwrap());
            let ns = n.to_string();
            series[0].1.push((n as f64, rate(&a, failed[0])));
            series[1].1.push((n as f64, rate(&b, failed[1])));
            row(
                report,
                [t.name, &ns, "dblock (coalesced)", pool],
                &mut a,
                failed[0],
                format!("{:.2}× coalesce(false)", median(ratios)),
            );
            row(
                report,
                [t.name, &ns, "dblock, coalesce(false)", pool],
                &mut b,
                failed[1],
                String::new(),
            );
            if let Some(tps) = pgbench.get(i) {
                let label = "pgbench, minimal statements";
                match tps.clone() {
                    Ok(tps) => {
                        report.row(&[
                            t.name.into(),
                            ns.clone(),
                            label.into(),
                            format!("{n}"),
                            format!("{tps:.0}"),
                            String::new(),
                            String::new(),
                            format!("coalesced dblock is {:.2}× it", rate(&a, failed[0]) / tps),
                        ]);
                        push(&mut series, label, n, tps);
                    }
                    Err(e) => report.row(&[
                        t.name.into(),
                        ns.clone(),
                        label.into(),
                        format!("{n}"),
                        String::new(),
                        String::new(),
                        String::new(),
                        e,
                    ]),
                }
            }
            if let Some((label, imp)) = &peer {
                let mut p = crate::measure(imp.clone(), n, side.as_secs_f64()).await;
                let note = format!(
                    "coalesced dblock is {:.2}× it",
                    rate(&a, failed[0]) / p.rate()
                );
                row(report, [t.name, &ns, label, "pool of 10"], &mut p, 0, note);
                push(&mut series, label, n, p.rate());
            }
        }
        panels.push(Panel {
            title: t.name.into(),
            series,
        });
        on.locker.shutdown().await;
        off.locker.shutdown().await;
    }
    if let Some(url) = redis {
        let label = "Redis SET NX PX + Lua delete";
        match crate::redis_lock(url).await {
            Ok(lock) => {
                let lock: Arc<dyn Cycle> = Arc::new(lock);
                let mut points = Vec::new();
                for &n in &owners {
                    let mut p = crate::measure(lock.clone(), n, side.as_secs_f64()).await;
                    row(
                        report,
                        ["redis", &n.to_string(), label, "1, multiplexed"],
                        &mut p,
                        0,
                        String::new(),
                    );
                    points.push((n as f64, p.rate()));
                }
                for p in &mut panels {
                    p.series.push((label.into(), points.clone()));
                }
            }
            Err(e) => report.row(&["redis".into(), format!("skipped: {e}")]),
        }
    }
    let ticks: Vec<f64> = owners.iter().map(|n| *n as f64).collect();
    report.chart(
        "series-throughput.svg",
        &lines(
            "Lock + unlock cycles/s on distinct keys (log-log); Redis repeated in each panel",
            "owners",
            "cycles/s (log scale)",
            &ticks,
            &panels,
        ),
    );
}

fn push(series: &mut Vec<(String, Vec<(f64, f64)>)>, label: &str, n: usize, v: f64) {
    match series.iter_mut().find(|s| s.0 == label) {
        Some(s) => s.1.push((n as f64, v)),
        None => series.push((label.into(), vec![(n as f64, v)])),
    }
}
