//! (e) What a dead `fair()` waiter costs the queue. This process holds keys; a child process
//! ("first") queues with `fair()` for each, a second child ("next") queues behind it; the
//! first is killed with SIGKILL, its tickets left in the queue (a ticket's lease is 5 s, renewed
//! about every second while its waiter lives); then this process releases the keys: the time
//! from each release to the next waiter's grant, against the same without the first waiter.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::chart::{bars, Group};
use super::child::{kill, now_us, spawn_child};
use super::{max, ms, pct, Report, Target, TABLE};

/// Keys (one queue each) per round.
const KEYS: usize = 4;

pub(crate) async fn run(targets: &[Target], report: &mut Report, secs: f64) {
    let rounds = ((secs / 2.5).ceil() as usize).clamp(1, 3);
    report.section(
        "(e) A dead fair waiter: release → the next fair waiter's grant",
        &format!(
            "This process holds {KEYS} keys (ttl 30 s). \"dead waiter ahead\": a child process \
             calls `lock(key).fair().wait(120 s)` for each key and queues (its ticket is a lease \
             of 5 s, renewed about every second while it waits); once the queue shows its \
             ticket, a second child process does the same and queues behind it; once the queue \
             shows both tickets, the first child is killed with SIGKILL (its tickets stay), and \
             100 ms later this process releases the keys one by one. Timed: each release call \
             to the second child's grant (wall-clock µs, one machine). \"no dead waiter\": the \
             same with the second child alone in the queue. {rounds} round(s) of {KEYS} keys per \
             case and backend. The dead ticket blocks the queue until its lease ends: expect up \
             to 5 s, less the time since its last renewal."
        ),
    );
    report.header(&[
        "backend",
        "queue ahead of the next waiter",
        "samples",
        "release → grant p50",
        "release → grant max",
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
        let mut bars = Vec::new();
        for dead in [false, true] {
            let mut took = Vec::new();
            let mut unchecked = 0;
            for round in 0..rounds {
                let keys: Vec<String> = (0..KEYS)
                    .map(|i| format!("dead:{run}:{dead}:{round}:{i}"))
                    .collect();
                let mut guards = Vec::new();
                for key in &keys {
                    guards.push(locker.lock(key).ttl(Duration::from_secs(30)).await.unwrap());
                }
                let first = if dead {
                    let (child, out) = spawn_child("fair", t, &keys, &[]);
                    if !await_tickets(t, &keys, 1).await {
                        unchecked += 1;
                    }
                    Some((child, out))
                } else {
                    None
                };
                let (mut next, mut out) = spawn_child("fair", t, &keys, &[]);
                if !await_tickets(t, &keys, if dead { 2 } else { 1 }).await {
                    unchecked += 1;
                }
                if let Some((mut child, _out)) = first {
                    kill(&mut child).await;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                let mut released = HashMap::new();
                for (key, g) in keys.iter().zip(guards) {
                    released.insert(key.clone(), now_us());
                    g.release().await.unwrap();
                }
                for _ in &keys {
                    let line = out.expect("GOT ", Duration::from_secs(60)).await;
                    let (key, at) = line.split_once(' ').unwrap();
                    let at: i64 = at.parse().unwrap();
                    took.push((at - released[key]) as f64 / 1000.0);
                }
                let status = next.wait().await.unwrap();
                assert!(status.success(), "{}: a fair waiter process failed", t.name);
            }
            let what = if dead {
                "a dead waiter's ticket"
            } else {
                "nobody (no dead waiter)"
            };
            let mut cells = vec![
                t.name.to_string(),
                what.into(),
                took.len().to_string(),
                ms(pct(&took, 0.5)),
                ms(max(&took)),
            ];
            if unchecked > 0 {
                cells[1].push_str(&format!(
                    " ({unchecked} round(s) where the queue did not show the tickets in 10 s)"
                ));
            }
            report.row(&cells);
            let short = if dead {
                "dead waiter ahead"
            } else {
                "no dead waiter"
            };
            bars.push((format!("{short}, p50"), Some(pct(&took, 0.5))));
            bars.push((format!("{short}, max"), Some(max(&took))));
        }
        groups.push(Group {
            label: t.name.into(),
            sub: String::new(),
            bars,
        });
        locker.shutdown().await;
    }
    report.chart(
        "series-dead-waiter.svg",
        &bars(
            "A dead fair waiter: release → the next fair waiter's grant",
            "ms",
            true,
            &groups,
        ),
    );
}

/// Live and dead tickets in the fair queue of `key` (read on the server itself).
async fn tickets(target: &Target, key: &str) -> i64 {
    let url = &target.direct;
    let sql = |mark: &str| format!("SELECT COUNT(*) FROM {TABLE}_queue WHERE lock_key = {mark}");
    let counted = if url.starts_with("postgres") {
        let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(url)
            .await
            .unwrap();
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql("$1")))
            .bind(key)
            .fetch_one(&mut conn)
            .await
    } else if url.starts_with("mysql") {
        let mut conn = <sqlx::MySqlConnection as sqlx::Connection>::connect(url)
            .await
            .unwrap();
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql("?")))
            .bind(key)
            .fetch_one(&mut conn)
            .await
    } else {
        let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect(url)
            .await
            .unwrap();
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql("?")))
            .bind(key)
            .fetch_one(&mut conn)
            .await
    };
    counted.unwrap()
}

/// Waits until the queue of each of `keys` holds `n` tickets; `false` after 10 s.
async fn await_tickets(target: &Target, keys: &[String], n: i64) -> bool {
    let until = Instant::now() + Duration::from_secs(10);
    for key in keys {
        while tickets(target, key).await != n {
            if Instant::now() > until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    true
}
