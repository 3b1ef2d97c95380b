//! The series' other processes: this benchmark binary started with
//! `DBLOCK_BENCH_SERIES_CHILD=<role>` (see [`super::spawn_child`]), on the parent's backend and
//! table, printing what the parent measures as lines of wall-clock microseconds.
//!
//! - `holder`: takes each key (ttl 5 s, renewed) and says `HELD <key> <expires_at µs>`, then
//!   waits to be killed;
//! - `fair`: asks for each key with `fair()` (saying `CALLING <key>` first) and says
//!   `GOT <key> <µs>` when granted, then releases it;
//! - `turns`: from `DBLOCK_BENCH_START` to `DBLOCK_BENCH_END`, takes the one key, holds it
//!   `DBLOCK_BENCH_HOLD_US`, releases it and pauses [`PAUSE`], over and over:
//!   `EV <pid> <called> <acquired> <releasing>`;
//! - `campaign`: from start to end, campaigns for the one key's leadership (ttl 5 s), leads
//!   for [`LEAD`], resigns, pauses [`GAP`] and campaigns again:
//!   `LED <pid> <µs> <term>` and `RESIGN <pid> <µs> <term>`.

use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dblock::{ConnectOptions, Locker};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout};

use super::{Target, TABLE};

/// The ttl of the crashed holder's lease and of the election.
pub(crate) const TTL: Duration = Duration::from_secs(5);
/// (c) How long a `turns` waiter stays away after its release, longer than a polling waiter's
/// longest pause (250 ms): without it, the releaser's next call finds the key free before the
/// others' next poll and takes it again, and "hand-offs" would be mostly re-acquisitions by
/// the same process.
pub(crate) const PAUSE: Duration = Duration::from_millis(300);
/// (f) How long a leader leads before it resigns: longer than `observe()`'s read interval
/// (ttl/10 = 500 ms), so every term is seen.
pub(crate) const LEAD: Duration = Duration::from_millis(700);
/// (f) How long a resigned leader waits before it campaigns again: longer than a polling
/// waiter's longest pause (250 ms), so the other campaign, not its own, takes the key.
pub(crate) const GAP: Duration = Duration::from_millis(400);

/// Wall-clock microseconds: one machine, one clock, so times from several processes compare.
pub(crate) fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

/// A child process of this binary in `role` on `target`'s table, for `keys`; `extra`
/// variables for its role. Killed if dropped.
pub(crate) fn spawn_child(
    role: &str,
    target: &Target,
    keys: &[String],
    extra: &[(&str, String)],
) -> (Child, Out) {
    let mut cmd = tokio::process::Command::new(std::env::current_exe().unwrap());
    cmd.env("DBLOCK_BENCH_SERIES_CHILD", role)
        .env("DBLOCK_BENCH_URL", &target.url)
        .env("DBLOCK_BENCH_POOLER", if target.pooler { "1" } else { "0" })
        .env("DBLOCK_BENCH_TABLE", TABLE)
        .env("DBLOCK_BENCH_KEYS", keys.join(","))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true);
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("{}: cannot start a {role} process: {e}", target.name));
    let out = Out(BufReader::new(child.stdout.take().unwrap()).lines());
    (child, out)
}

/// A child's stdout, line by line.
pub(crate) struct Out(Lines<BufReader<ChildStdout>>);

impl Out {
    /// The rest of the next line that starts with `prefix` (earlier lines are skipped);
    /// panics after `within` or at the end of the output.
    pub(crate) async fn expect(&mut self, prefix: &str, within: Duration) -> String {
        let found = tokio::time::timeout(within, async {
            while let Some(line) = self.0.next_line().await.unwrap() {
                if let Some(rest) = line.strip_prefix(prefix) {
                    return Some(rest.to_owned());
                }
            }
            None
        })
        .await;
        match found {
            Ok(Some(rest)) => rest,
            Ok(None) => panic!("a child process ended without saying {prefix:?}"),
            Err(_) => panic!("a child process did not say {prefix:?} within {within:?}"),
        }
    }

    /// Every remaining line, until the child closes its output.
    pub(crate) async fn rest(&mut self) -> Vec<String> {
        let mut lines = Vec::new();
        while let Some(line) = self.0.next_line().await.unwrap() {
            lines.push(line);
        }
        lines
    }
}

/// Kills a child (SIGKILL: no destructor, no release runs) and reaps it; the instant and wall
/// time of the kill.
pub(crate) async fn kill(child: &mut Child) -> (Instant, i64) {
    let (at, at_us) = (Instant::now(), now_us());
    child.start_kill().unwrap();
    let _ = child.wait().await;
    (at, at_us)
}

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

/// Sleeps until wall-clock `at` (µs).
pub(crate) async fn until(at: i64) {
    tokio::time::sleep(Duration::from_micros((at - now_us()).max(0) as u64)).await;
}

/// In a child process: its role, then exit.
pub(crate) async fn child() {
    let role = var("DBLOCK_BENCH_SERIES_CHILD");
    let options = if var("DBLOCK_BENCH_POOLER") == "1" {
        ConnectOptions::new().pooler(true)
    } else {
        ConnectOptions::new()
    };
    let locker = Locker::connect_with(&var("DBLOCK_BENCH_URL"), options)
        .await
        .unwrap()
        .table(&var("DBLOCK_BENCH_TABLE"));
    let keys: Vec<String> = var("DBLOCK_BENCH_KEYS")
        .split(',')
        .map(str::to_owned)
        .collect();
    // Warm the pool before anything is timed.
    locker.inspect(&keys[0]).await.unwrap();
    match role.as_str() {
        "holder" => holder(&locker, &keys).await,
        "fair" => fair(&locker, &keys).await,
        "turns" => turns(&locker, &keys[0]).await,
        "campaign" => campaign(&locker, &keys[0]).await,
        other => panic!("no such series child role: {other}"),
    }
}

async fn holder(locker: &Locker, keys: &[String]) {
    let mut guards = Vec::new();
    for key in keys {
        let g = locker.lock(key).ttl(TTL).await.unwrap().auto_renew();
        let expires = g
            .expires_at()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros();
        println!("HELD {key} {expires}");
        guards.push(g);
    }
    // Killed long before; should the parent be gone, end (and release) after two minutes.
    tokio::time::sleep(Duration::from_secs(120)).await;
}

async fn fair(locker: &Locker, keys: &[String]) {
    let tasks: Vec<_> = keys
        .iter()
        .map(|key| {
            let (locker, key) = (locker.clone(), key.clone());
            tokio::spawn(async move {
                println!("CALLING {key}");
                let g = locker
                    .lock(&key)
                    .fair()
                    .ttl(Duration::from_secs(30))
                    .wait(Duration::from_secs(120))
                    .await
                    .unwrap();
                println!("GOT {key} {}", now_us());
                g.release().await.unwrap();
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

async fn turns(locker: &Locker, key: &str) {
    let start: i64 = var("DBLOCK_BENCH_START").parse().unwrap();
    let end: i64 = var("DBLOCK_BENCH_END").parse().unwrap();
    let hold = Duration::from_micros(var("DBLOCK_BENCH_HOLD_US").parse().unwrap());
    let pid = std::process::id();
    until(start).await;
    let mut lines = String::new();
    while now_us() < end {
        let called = now_us();
        let g = locker
            .lock(key)
            .ttl(Duration::from_secs(30))
            .wait(Duration::from_secs(60))
            .await
            .unwrap();
        let acquired = now_us();
        tokio::time::sleep(hold).await;
        let releasing = now_us();
        g.release().await.unwrap();
        lines.push_str(&format!("EV {pid} {called} {acquired} {releasing}\n"));
        // Out of the way until the others have had their turn: what follows a release is
        // another process's grant, not this one's next call finding the key free.
        tokio::time::sleep(PAUSE).await;
    }
    print!("{lines}");
}

async fn campaign(locker: &Locker, key: &str) {
    let start: i64 = var("DBLOCK_BENCH_START").parse().unwrap();
    let end: i64 = var("DBLOCK_BENCH_END").parse().unwrap();
    let pid = std::process::id();
    let election = locker.leader(key).ttl(TTL);
    until(start).await;
    while now_us() < end {
        let leading = election.campaign().await.unwrap();
        let term = leading.fencing_token();
        println!("LED {pid} {} {term}", now_us());
        tokio::time::sleep(LEAD).await;
        println!("RESIGN {pid} {} {term}", now_us());
        leading.resign().await.unwrap();
        tokio::time::sleep(GAP).await;
    }
}
