//! (c) Contended hand-off: release → the next waiter's grant on one key. Two layouts: the
//! `handoff` part's 8 tasks in this process (`crate::handoff`, where the process's own line
//! wakes the next task at once), and 4 processes of one waiter each (the `turns` child), where
//! only the backend's wake-up (NOTIFY) or polling carries the release across. Redis: 4 tasks
//! with `RedisTurns` (polling), laid out as the processes are.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::chart::{bars, Group};
use super::child::PAUSE;
use super::child::{now_us, spawn_child};
use super::{ms, ms_of, pct, Report, Target};
use crate::Turns;

const HOLDS: [Duration; 2] = [Duration::from_millis(1), Duration::from_millis(50)];
const PROCESSES: usize = 4;

fn wake_up(t: &Target) -> &'static str {
    if t.pooler {
        "polling (pooler mode: no LISTEN)"
    } else if t.is_postgres() {
        "LISTEN/NOTIFY + polling"
    } else {
        "polling (backoff 5 → 250 ms)"
    }
}

/// Hand-offs (ms) from `(who, acquired, releasing)` turns: each grant after a release by
/// another waiter. Also how many grants went back to the releaser.
fn handoffs(mut turns: Vec<(u64, i64, i64)>) -> (Vec<f64>, usize) {
    turns.sort_unstable_by_key(|t| t.1);
    let mut same = 0;
    let mut out = Vec::new();
    for w in turns.windows(2) {
        if w[0].0 == w[1].0 {
            same += 1;
        } else {
            out.push((w[1].1 - w[0].2) as f64 / 1000.0);
        }
    }
    (out, same)
}

/// `PROCESSES` child processes take turns on one key for `time`, each holding it `hold`.
async fn across(t: &Target, hold: Duration, time: Duration) -> (Vec<f64>, usize) {
    let key = format!("handoff:{}", fastrand::u64(..));
    let start = now_us() + 2_000_000;
    let end = start + time.as_micros() as i64;
    let extra = [
        ("DBLOCK_BENCH_START", start.to_string()),
        ("DBLOCK_BENCH_END", end.to_string()),
        ("DBLOCK_BENCH_HOLD_US", hold.as_micros().to_string()),
    ];
    let children: Vec<_> = (0..PROCESSES)
        .map(|_| spawn_child("turns", t, std::slice::from_ref(&key), &extra))
        .collect();
    let mut turns = Vec::new();
    for (mut child, mut out) in children {
        for line in out.rest().await {
            let f: Vec<i64> = line
                .strip_prefix("EV ")
                .map(|r| r.split(' ').filter_map(|x| x.parse().ok()).collect())
                .unwrap_or_default();
            if let [pid, _called, acquired, releasing] = f[..] {
                turns.push((pid as u64, acquired, releasing));
            }
        }
        let status = child.wait().await.unwrap();
        assert!(status.success(), "{}: a turns process failed", t.name);
    }
    handoffs(turns)
}

/// The processes' layout in tasks of this process, for a lock without a line (Redis).
async fn tasks(turns: Arc<dyn Turns>, hold: Duration, time: Duration) -> (Vec<f64>, usize) {
    let key = format!("handoff:{}", fastrand::u64(..));
    let log = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let t0 = now_us();
    let workers: Vec<_> = (0..PROCESSES as u64)
        .map(|who| {
            let (turns, log, key) = (turns.clone(), log.clone(), key.clone());
            tokio::spawn(async move {
                while start.elapsed() < time {
                    let g = turns.take(&key).await;
                    let acquired = now_us();
                    tokio::time::sleep(hold).await;
                    let releasing = now_us();
                    g.release().await;
                    log.lock()
                        .unwrap()
                        .push((who, acquired - t0, releasing - t0));
                    tokio::time::sleep(PAUSE).await;
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    let turns = log.lock().unwrap().clone();
    handoffs(turns)
}

pub(crate) async fn run(targets: &[Target], redis: Option<&str>, report: &mut Report, secs: f64) {
    let time = Duration::from_secs_f64((secs * 0.6).max(1.0));
    let apart = time * 2;
    report.section(
        "(c) Contended hand-off: release → the next waiter's grant",
        &format!(
            "Waiters take turns on one key, each holding it for `hold` (ttl 30 s); a hand-off \
             is the time from the holder's `release()` call to the next holder's `lock()` \
             returning. \"8 tasks, 1 process\" ({:.1} s a cell): the `handoff` part's layout, 8 \
             tasks on one `Locker`, each calling again as soon as it has released; the \
             process's own line wakes its next waiter the moment it releases, so this is the \
             hand-off inside one process. \"{PROCESSES} processes\" ({:.1} s a cell): one waiter \
             in each of {PROCESSES} processes, each staying away {PAUSE:?} after its release \
             (longer than a poll's longest pause, so that the key goes to a waiter, not back to \
             the releaser's next call); only the backend carries the release across: \
             PostgreSQL's NOTIFY, otherwise the waiters' polling (jittered backoff from 5 ms \
             doubling to 250 ms). On PostgreSQL a release NOTIFYs only if a waiter marked the \
             current tenure as contended (the next grant clears the mark; a waiter sets it at \
             its next attempt, once its LISTEN is in place), so with short holds the waiters \
             whose last attempt came before the previous hand-off learn of the release by \
             polling. Times in wall-clock µs, one machine. Redis: {PROCESSES} tasks \
             laid out as the processes, `SET NX PX` attempts with the same backoff. Grants that \
             went back to the releaser are not hand-offs and not counted (said in the row if \
             any).",
            time.as_secs_f64(),
            apart.as_secs_f64()
        ),
    );
    report.header(&[
        "backend",
        "waiters",
        "hold",
        "wake-up",
        "hand-offs",
        "p50",
        "p99",
    ]);
    let mut groups = Vec::new();
    let row = |report: &mut Report,
               name: &str,
               who: &str,
               hold: Duration,
               how: &str,
               v: &[f64],
               same: usize| {
        let (p50, p99) = (pct(v, 0.5), pct(v, 0.99));
        let mut n = v.len().to_string();
        if same > 0 {
            n.push_str(&format!(" ({same} back to the releaser, not counted)"));
        }
        report.row(&[
            name.into(),
            who.into(),
            format!("{hold:?}"),
            how.into(),
            n,
            ms(p50),
            ms(p99),
        ]);
        (p50, p99)
    };
    for t in targets {
        let locker = match t.locker().await {
            Ok(l) => l,
            Err(e) => {
                report.row(&[t.name.into(), format!("skipped: {e}")]);
                continue;
            }
        };
        for hold in HOLDS {
            let turns: Arc<dyn Turns> = Arc::new(locker.clone());
            let s = crate::handoff(turns, time, hold, None).await;
            let one: Vec<f64> = s.latencies.iter().map(|d| ms_of(*d)).collect();
            let (a50, a99) = row(
                report,
                t.name,
                "8 tasks, 1 process",
                hold,
                "in-process line (woken at once)",
                &one,
                0,
            );
            let (v, same) = across(t, hold, apart).await;
            let (b50, b99) = row(report, t.name, "4 processes", hold, wake_up(t), &v, same);
            groups.push(Group {
                label: t.name.into(),
                sub: format!("hold {hold:?}"),
                bars: vec![
                    ("8 tasks, 1 process: p50".into(), Some(a50)),
                    ("8 tasks, 1 process: p99".into(), Some(a99)),
                    ("4 processes (Redis: tasks): p50".into(), Some(b50)),
                    ("4 processes (Redis: tasks): p99".into(), Some(b99)),
                ],
            });
        }
        locker.shutdown().await;
    }
    if let Some(url) = redis {
        if let Ok(lock) = crate::redis_lock(url).await {
            let turns: Arc<dyn Turns> = Arc::new(crate::RedisTurns(Arc::new(lock)));
            for hold in HOLDS {
                let (v, same) = tasks(turns.clone(), hold, apart).await;
                let (p50, p99) = row(
                    report,
                    "redis",
                    "4 tasks",
                    hold,
                    "polling (same backoff)",
                    &v,
                    same,
                );
                groups.push(Group {
                    label: "redis".into(),
                    sub: format!("hold {hold:?}"),
                    bars: vec![
                        ("4 processes (Redis: tasks): p50".into(), Some(p50)),
                        ("4 processes (Redis: tasks): p99".into(), Some(p99)),
                    ],
                });
            }
        }
    }
    report.chart(
        "series-handoff.svg",
        &bars(
            "Contended hand-off: release → the next waiter's grant",
            "ms",
            true,
            &groups,
        ),
    );
}
