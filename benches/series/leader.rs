//! (f) Graceful leader hand-over between two processes (the `campaign` child): each leads for
//! `LEAD`, resigns, pauses `GAP` and campaigns again, so the other, already campaigning,
//! takes over. Timed: `resign()` called → the other's `campaign()` returning, and → this
//! process's `observe()` stream yielding the new term.

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_core::Stream;

use super::chart::{bars, Group};
use super::child::{now_us, spawn_child};
use super::child::{GAP, LEAD, TTL};
use super::{ms, pct, Report, Target};

struct Event {
    pid: u32,
    at: i64,
    term: u64,
}

fn parse(rest: &str) -> Event {
    let f: Vec<&str> = rest.split(' ').collect();
    Event {
        pid: f[0].parse().unwrap(),
        at: f[1].parse().unwrap(),
        term: f[2].parse().unwrap(),
    }
}

pub(crate) async fn run(targets: &[Target], report: &mut Report, secs: f64) {
    let hand_overs = ((secs * 3.0) as usize).clamp(4, 20);
    let time = (LEAD + GAP / 2) * hand_overs as u32;
    let every = (TTL / 10).clamp(Duration::from_millis(50), Duration::from_secs(1));
    report.section(
        "(f) Graceful leader hand-over: resign → the other's campaign, and observe()",
        &format!(
            "Two processes campaign for one election (`locker.leader(key).ttl({TTL:?})`, a \
             `Locker` each): the leader leads for {LEAD:?}, calls `resign()`, waits {GAP:?} and \
             campaigns again, while the other, already campaigning, takes over; about \
             {hand_overs} hand-overs per backend. Timed (wall-clock µs, one machine): \
             `resign()` called → the other process's `campaign()` returning; and → this \
             process's `observe()` stream (a third `Locker`) yielding the new term: it reads \
             the leader every ttl/10 = {every:?}, so it adds up to that. A hand-over where the \
             resigned process was elected again is not counted (said in the row if any)."
        ),
    );
    report.header(&[
        "backend",
        "hand-overs",
        "wake-up",
        "resign → campaign() p50",
        "resign → campaign() p99",
        "resign → observe() p50",
        "resign → observe() p99",
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
        let key = format!("leader:{}", fastrand::u64(..));
        let start = now_us() + 2_000_000;
        let end = start + time.as_micros() as i64;
        let extra = [
            ("DBLOCK_BENCH_START", start.to_string()),
            ("DBLOCK_BENCH_END", end.to_string()),
        ];
        // The observer: every item of the stream, with the time it came.
        let seen = Arc::new(Mutex::new(Vec::<(i64, Option<u64>)>::new()));
        let observer = {
            let (seen, election) = (seen.clone(), locker.leader(&key).ttl(TTL));
            tokio::spawn(async move {
                let mut changes = election.observe();
                while let Some(item) = poll_fn(|cx| Pin::new(&mut changes).poll_next(cx)).await {
                    if let Ok(leader) = item {
                        let term = leader.map(|l| l.fencing_token);
                        seen.lock().unwrap().push((now_us(), term));
                    }
                }
            })
        };
        let children: Vec<_> = (0..2)
            .map(|_| spawn_child("campaign", t, std::slice::from_ref(&key), &extra))
            .collect();
        let (mut led, mut resigned) = (Vec::new(), Vec::new());
        for (mut child, mut out) in children {
            for line in out.rest().await {
                if let Some(rest) = line.strip_prefix("LED ") {
                    led.push(parse(rest));
                } else if let Some(rest) = line.strip_prefix("RESIGN ") {
                    resigned.push(parse(rest));
                }
            }
            let status = child.wait().await.unwrap();
            assert!(status.success(), "{}: a campaign process failed", t.name);
        }
        // Let the observer see the last term.
        tokio::time::sleep(every * 2).await;
        observer.abort();
        let seen = seen.lock().unwrap().clone();
        led.sort_by_key(|e| e.term);
        let (mut campaign, mut observe, mut again) = (Vec::new(), Vec::new(), 0);
        for next in &led {
            // The resignation that ended the term before this one.
            let Some(prev) = resigned
                .iter()
                .filter(|r| r.term < next.term)
                .max_by_key(|r| r.term)
            else {
                continue;
            };
            if prev.pid == next.pid {
                again += 1;
                continue;
            }
            campaign.push((next.at - prev.at) as f64 / 1000.0);
            if let Some((at, _)) = seen
                .iter()
                .find(|(at, term)| *at >= prev.at && *term == Some(next.term))
            {
                observe.push((at - prev.at) as f64 / 1000.0);
            }
        }
        let wake = if t.pooler {
            "polling (pooler mode)"
        } else if t.is_postgres() {
            "LISTEN/NOTIFY"
        } else {
            "polling"
        };
        let mut label = campaign.len().to_string();
        if again > 0 {
            label.push_str(&format!(" ({again} re-elections not counted)"));
        }
        if observe.len() < campaign.len() {
            label.push_str(&format!(
                " ({} terms observe() did not see)",
                campaign.len() - observe.len()
            ));
        }
        report.row(&[
            t.name.into(),
            label,
            wake.into(),
            ms(pct(&campaign, 0.5)),
            ms(pct(&campaign, 0.99)),
            ms(pct(&observe, 0.5)),
            ms(pct(&observe, 0.99)),
        ]);
        groups.push(Group {
            label: t.name.into(),
            sub: String::new(),
            bars: vec![
                ("campaign() returns, p50".into(), Some(pct(&campaign, 0.5))),
                ("campaign() returns, p99".into(), Some(pct(&campaign, 0.99))),
                ("observe() sees it, p50".into(), Some(pct(&observe, 0.5))),
                ("observe() sees it, p99".into(), Some(pct(&observe, 0.99))),
            ],
        });
        locker.shutdown().await;
    }
    report.chart(
        "series-leader.svg",
        &bars(
            "Graceful leader hand-over: resign() → the other process",
            "ms",
            true,
            &groups,
        ),
    );
}
