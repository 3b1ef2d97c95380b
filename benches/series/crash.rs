//! (d) A holder crashes: a child process takes keys (ttl 5 s, renewed) and is killed with
//! SIGKILL (no destructor, no release, its connections closed by the kernel) while a waiter
//! of this process waits for each key: the time from the kill to the waiter's grant.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::chart::{bars, Group};
use super::child::TTL;
use super::child::{kill, now_us, spawn_child};
use super::{max, ms, pct, Report, Target};

/// Keys (one waiter each) a holder process takes per round.
const KEYS: usize = 4;

pub(crate) async fn run(targets: &[Target], report: &mut Report, secs: f64) {
    let rounds = ((secs / 2.5).ceil() as usize).clamp(1, 3);
    report.section(
        "(d) A crashed holder: kill → the next holder's grant (ttl 5 s)",
        &format!(
            "A child process takes {KEYS} keys with ttl {TTL:?} and `auto_renew()`, and says so \
             with each lease's end; a waiter in this process calls `lock(key).wait(30 s)` for \
             each; 100 ms later the child is killed with SIGKILL (before its first renewal, \
             which would come at ttl/3), and each waiter's grant is timed from the kill. {rounds} \
             round(s) per backend, {KEYS} keys each (the keys of a round are independent: one \
             waiter, one lease each). \"lease left\" is the lease's end (database clock, same \
             machine) minus the kill; \"after the lease end\" is the grant minus the lease's \
             end: what the waiter adds (a busy attempt tells it when the lease ends, and it \
             sleeps no later than that). Nothing releases a crashed holder's lease: the wait is \
             the ttl by design."
        ),
    );
    report.header(&[
        "backend",
        "samples",
        "kill → grant p50",
        "kill → grant max",
        "lease left at the kill, p50",
        "after the lease end, p50",
        "after the lease end, max",
    ]);
    let mut groups = Vec::new();
    for t in targets {
        let locker = match t.locker().await {
            Ok(l) => l,
            Err(e) => {
                report.row(&[t.name.into(), format!("skipped: {e}")]);
                continue;
            }
        };
        let run = fastrand::u32(..);
        let (mut took, mut left, mut after) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            let keys: Vec<String> = (0..KEYS)
                .map(|i| format!("crash:{run}:{round}:{i}"))
                .collect();
            let (mut child, mut out) = spawn_child("holder", t, &keys, &[]);
            let mut expires: HashMap<String, i64> = HashMap::new();
            for _ in &keys {
                let line = out.expect("HELD ", Duration::from_secs(30)).await;
                let (key, at) = line.split_once(' ').unwrap();
                expires.insert(key.to_owned(), at.parse().unwrap());
            }
            let waiters: Vec<_> = keys
                .iter()
                .map(|key| {
                    let (locker, key) = (locker.clone(), key.clone());
                    tokio::spawn(async move {
                        let g = locker
                            .lock(&key)
                            .ttl(Duration::from_secs(30))
                            .wait(Duration::from_secs(30))
                            .await
                            .unwrap();
                        let at = (Instant::now(), now_us());
                        g.release().await.unwrap();
                        (key, at)
                    })
                })
                .collect();
            tokio::time::sleep(Duration::from_millis(100)).await;
            let (killed, killed_us) = kill(&mut child).await;
            for w in waiters {
                let (key, (granted, granted_us)) = w.await.unwrap();
                let end = expires[&key];
                took.push((granted - killed).as_secs_f64() * 1e3);
                left.push((end - killed_us) as f64 / 1000.0);
                after.push((granted_us - end) as f64 / 1000.0);
            }
        }
        report.row(&[
            t.name.into(),
            took.len().to_string(),
            ms(pct(&took, 0.5)),
            ms(max(&took)),
            ms(pct(&left, 0.5)),
            ms(pct(&after, 0.5)),
            ms(max(&after)),
        ]);
        groups.push(Group {
            label: t.name.into(),
            sub: String::new(),
            bars: vec![
                ("kill → grant, p50".into(), Some(pct(&took, 0.5) / 1e3)),
                ("kill → grant, max".into(), Some(max(&took) / 1e3)),
                (
                    "lease left at the kill, p50".into(),
                    Some(pct(&left, 0.5) / 1e3),
                ),
            ],
        });
        locker.shutdown().await;
    }
    report.chart(
        "series-crash.svg",
        &bars(
            "A crashed holder (ttl 5 s): kill → the waiter's grant",
            "seconds",
            false,
            &groups,
        ),
    );
}
