//! A chaos run's history and its checker, shared by `tests/chaos.rs` and `tests/replicated.rs`.
//!
//! Worker processes (the test binary itself, started on an ignored entry-point test) take and give
//! back locks on a few keys and log every step, one line each, to one shared file: that file is the
//! history. Some workers ("nesting") keep one [`Owner`] for their whole life and re-enter the key
//! they hold (up to three nested locks of it) in every iteration, so one owner comes back to a key
//! after every fault its earlier calls met (a lost reply, an unknown release); the others use a
//! fresh owner per lock. Most locks have a short lease (the workload's `ttl`, shorter than the
//! faults); some, on keys of their own, a long one (`long_ttl`, longer than the whole run), so that
//! a hold leaked at any moment of the run is still live when the run ends. The checker then proves
//! from the history (and the table):
//! - every grant `lock()` returned was live (`is_lost()` false);
//! - no two tenures of a key (an owner's holds of one fencing token) ever certainly held it at
//!   once (a hold is certain from the moment `lock()` returned until the worker started to release
//!   it, or, if the guard then said it could be lost, until its lease ended), and a tenure belongs
//!   to one owner only;
//! - fencing tokens increase in the order the tenures began;
//! - no hold was counted twice: a first hold of an owner (no guard of it on the key in this
//!   process) has `hold_count` 1 after any fault, a nested one the count of its parent plus one
//!   (or 1, with a new token, if the parent's lease had ended);
//! - no hold was orphaned (`check_no_orphans`): right after the workers exited, every row still
//!   held belongs to a worker that was killed (or is a release the caller says the database may
//!   have lost, as a crash of a primary loses lazily durable releases);
//! - no untyped error: every `lock()` and release error is a typed outcome (busy, lost, not held),
//!   says its outcome is unknown, or names a real cause (an I/O error of the connection, a server
//!   error). Anything else (a pool time-out above all) is logged as `BAD` and fails the worker,
//!   which fails the run.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dblock::{ConnectOptions, LockError, Locker, Owner};

/// What each worker does, for `run`: lock a random key (one of `keys` with lease `ttl`, or, one
/// time in four, one of `long_keys` with lease `long_ttl`), hold it 0–40 ms (a nesting worker
/// re-enters it up to twice more meanwhile), release; then wait `linger` so background releases
/// and resolutions finish before it exits. `long_ttl` must outlast the run, the linger and the
/// checks.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    pub run: Duration,
    pub ttl: Duration,
    pub keys: usize,
    pub long_ttl: Duration,
    pub long_keys: usize,
    pub linger: Duration,
}

pub fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

fn us(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_micros() as i64
}

/// How an error of a `lock()` or release call is logged (one word), or `Err` with the error when
/// it is untyped: neither a typed outcome, nor marked outcome-unknown, nor naming a real cause.
/// A pool time-out is untyped: the library promises to report an unreachable server as the
/// connection error, and the workers' pools are never exhausted (one call at a time each).
pub fn error_kind(e: &LockError) -> Result<String, String> {
    let word = |s: String| s.replace(char::is_whitespace, "_");
    match e {
        LockError::Busy { .. } => Ok("busy".into()),
        LockError::Lost { .. } => Ok("lost".into()),
        LockError::NotHeld { .. } => Ok("notheld".into()),
        e if e.is_outcome_unknown() => Ok("unknown".into()),
        // A server error: the server said what went wrong.
        LockError::Database(sqlx::Error::Database(db)) => Ok(word(format!(
            "server:{}:{}",
            db.code().unwrap_or_default(),
            db.message()
        ))),
        // The connection's own error (refused, reset, broken pipe, a connect that hung).
        LockError::Database(sqlx::Error::Io(io)) => Ok(word(format!("io:{:?}:{io}", io.kind()))),
        // A worker with more loops than connections (`DBLOCK_CHAOS_TASKS`): while faults hold
        // every connection, its pool is truly exhausted (the server answers), and says so.
        LockError::Database(sqlx::Error::PoolTimedOut) if loops() > 1 => {
            Ok("pool-exhausted".into())
        }
        other => Err(format!("{other:?}")),
    }
}

/// Loops this worker runs at once (`DBLOCK_CHAOS_TASKS`, default 1). More than one: a batch
/// run, whose loops outnumber its pool's connections.
fn loops() -> u32 {
    std::env::var("DBLOCK_CHAOS_TASKS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(1)
}

/// The worker's log: one line per step, appended to the shared history file.
struct Log {
    file: std::fs::File,
    pid: u32,
}

impl Log {
    fn line(&mut self, text: String) {
        // One write per line: the workers append to one file, and an O_APPEND write of a short
        // line is not interleaved with another process's.
        self.file
            .write_all(format!("{} {text}\n", self.pid).as_bytes())
            .unwrap();
    }

    /// Logs an untyped error and fails the worker (its exit status fails the run).
    fn untyped(&mut self, call: &str, error: String) -> ! {
        self.line(format!(
            "BAD {call} {}",
            error.replace(char::is_whitespace, "_")
        ));
        panic!("untyped {call} error: {error}");
    }
}

/// The worker's loop, inside a child process started by [`spawn_worker`]: reads its URL, table,
/// log file and kind (nesting or not) from the environment, logs its history, and returns its
/// locker after a graceful exit (the line `EXIT`), for checks of its own. Panics on an untyped
/// error.
pub async fn worker(workload: &Workload) -> Locker {
    let url = std::env::var("DBLOCK_CHAOS_URL").expect("DBLOCK_CHAOS_URL");
    let table = std::env::var("DBLOCK_CHAOS_TABLE").unwrap();
    let log_path = std::env::var("DBLOCK_CHAOS_LOG").unwrap();
    let nesting = std::env::var("DBLOCK_CHAOS_NESTING").is_ok_and(|v| v == "1");
    // DBLOCK_CHAOS_TRACE=1: the library's debug events, per worker, next to the history (to
    // find out why a check failed).
    if std::env::var("DBLOCK_CHAOS_TRACE").is_ok_and(|v| v == "1") {
        let file =
            std::fs::File::create(format!("{log_path}.{}.trace", std::process::id())).unwrap();
        tracing_subscriber::fmt()
            .with_env_filter("dblock=debug,sqlx=debug")
            .with_writer(std::sync::Mutex::new(file))
            .with_ansi(false)
            .init();
    }
    // A statement may take longer than the ttl (as a commit waiting for a stalled synchronous
    // standby can): grants can then arrive after their lease could have ended.
    let tasks = loops();
    let mut options = ConnectOptions::new()
        .statement_timeout(Duration::from_secs(4))
        .acquire_timeout(Duration::from_secs(1));
    if tasks > 1 {
        // Fewer connections than loops: a locker keeps one statement of a kind in flight per
        // connection, so the loops' statements queue and travel in batches.
        options = options.max_connections(3);
    }
    let locker = loop {
        match Locker::connect_with(&url, options.clone()).await {
            Ok(l) => break l.table(&table),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let until = Instant::now() + workload.run;
    // DBLOCK_CHAOS_STOP_FILE: the run also ends when this file appears (a run whose faults take
    // as long as they take: the parent says when it is over).
    let stop_file = std::env::var_os("DBLOCK_CHAOS_STOP_FILE").map(std::path::PathBuf::from);
    let open = |label: u32| Log {
        file: std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .unwrap(),
        pid: label,
    };
    let mut logs = if tasks <= 1 {
        let mut log = open(std::process::id());
        run_loop(
            &locker,
            &mut log,
            workload,
            nesting,
            until,
            stop_file.as_deref(),
        )
        .await;
        vec![log]
    } else {
        // DBLOCK_CHAOS_TASKS=n: n loops at once in this process, each logging as a worker of
        // its own (`pid * 100 + i`), so that the locker's statements travel in batches.
        let all: Vec<_> = (0..tasks)
            .map(|i| {
                let (locker, stop_file) = (locker.clone(), stop_file.clone());
                let mut log = open(std::process::id() * 100 + i);
                let workload = *workload;
                tokio::spawn(async move {
                    run_loop(
                        &locker,
                        &mut log,
                        &workload,
                        nesting,
                        until,
                        stop_file.as_deref(),
                    )
                    .await;
                    log
                })
            })
            .collect();
        let mut logs = Vec::new();
        for t in all {
            logs.push(t.await.unwrap());
        }
        logs
    };
    for log in &mut logs {
        log.line(format!("STOP {}", now_us()));
    }
    // A graceful exit: background releases and resolutions get to finish (the network is back
    // to normal for the last seconds of the run).
    tokio::time::sleep(workload.linger).await;
    #[cfg(feature = "_test-util")]
    {
        let (statements, rows) = dblock::test_util::coalesced(&locker);
        logs[0].line(format!("COALESCED {statements} {rows}"));
    }
    for log in &mut logs {
        log.line(format!("EXIT {}", now_us()));
    }
    locker
}

/// A worker's loop (or one of its tasks'): iterations on random keys until `until` or until
/// `stop_file` appears.
async fn run_loop(
    locker: &Locker,
    log: &mut Log,
    workload: &Workload,
    nesting: bool,
    until: Instant,
    stop_file: Option<&Path>,
) {
    // A nesting worker's one owner, for its whole life: it comes back to keys after every fault.
    let lifelong = Owner::new();
    while Instant::now() < until && !stop_file.is_some_and(|f| f.exists()) {
        let (key, ttl) = if fastrand::usize(..4) == 0 {
            let key = format!("long{}", fastrand::usize(..workload.long_keys));
            (key, workload.long_ttl)
        } else {
            let key = format!("key{}", fastrand::usize(..workload.keys));
            (key, workload.ttl)
        };
        // Shorter than most faults, so that calls end with their outcome unknown and their
        // owner comes back to the key while the library still resolves them (and short because
        // a long key a killed worker held stays taken for the rest of the run).
        let wait = Duration::from_secs(1);
        let (owner, depth) = if nesting {
            (lifelong.clone(), 1 + fastrand::usize(..3))
        } else {
            (Owner::new(), 1)
        };
        let scoped = owner.clone();
        scoped
            .scope(iteration(locker, log, &owner, &key, ttl, wait, depth))
            .await;
    }
}

/// One iteration, run as `owner` (`Owner::scope`): takes `key` up to `depth` times, nested (each
/// `lock()` inside the scope re-enters), then gives the holds back, innermost first.
async fn iteration(
    locker: &Locker,
    log: &mut Log,
    owner: &Owner,
    key: &str,
    ttl: Duration,
    wait: Duration,
    depth: usize,
) {
    let mut guards = Vec::new();
    for d in 1..=depth {
        log.line(format!("TRY {key} {} {d} {}", owner.id(), now_us()));
        match locker.lock(key).ttl(ttl).wait(wait).await {
            Ok(g) => {
                log.line(format!(
                    "GOT {key} {} {} {} {} {} {d} {}",
                    g.fencing_token(),
                    g.hold_count(),
                    now_us(),
                    us(g.expires_at()),
                    u8::from(g.is_lost()),
                    owner.id(),
                ));
                guards.push((g, d));
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..40))).await;
            }
            Err(e) => {
                let kind = error_kind(&e).unwrap_or_else(|bad| log.untyped("lock", bad));
                log.line(format!("ERR {key} {d} {kind}"));
                break;
            }
        }
    }
    while let Some((g, d)) = guards.pop() {
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..20))).await;
        // Stopped past its ttl, the worker knows its lease may be gone: is_lost().
        let token = g.fencing_token();
        log.line(format!(
            "END {key} {token} {} {} {d}",
            now_us(),
            u8::from(g.is_lost())
        ));
        let outcome = match g.release().await {
            Ok(()) => "ok".to_owned(),
            Err(e) => error_kind(&e).unwrap_or_else(|bad| log.untyped("release", bad)),
        };
        log.line(format!("REL {key} {token} {outcome} {} {d}", now_us()));
    }
}

/// Starts a worker: this test binary, running only the ignored test `entry` (which calls
/// [`worker`]), on `url`, appending its history to `log`; a `nesting` worker keeps one owner and
/// re-enters.
pub fn spawn_worker(entry: &str, url: &str, table: &str, log: &Path, nesting: bool) -> Child {
    worker_command(entry, url, table, log, nesting)
        .spawn()
        .unwrap()
}

/// The command [`spawn_worker`] runs, for a caller that adds to it.
pub fn worker_command(entry: &str, url: &str, table: &str, log: &Path, nesting: bool) -> Command {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            entry,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("DBLOCK_CHAOS_URL", url)
        .env("DBLOCK_CHAOS_TABLE", table)
        .env("DBLOCK_CHAOS_LOG", log)
        .env("DBLOCK_CHAOS_NESTING", if nesting { "1" } else { "0" })
        .stdout(Stdio::null());
    command
}

/// Sends `sig` (`-STOP`, `-CONT`, `-KILL`) to a worker.
pub fn signal(child: &Child, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {sig}");
}

/// Waits for every worker to exit; their exit statuses, in order.
pub async fn wait_all(children: Vec<Child>) -> Vec<std::process::ExitStatus> {
    let mut statuses = Vec::new();
    for mut c in children {
        let status = tokio::task::spawn_blocking(move || c.wait())
            .await
            .unwrap()
            .unwrap();
        statuses.push(status);
    }
    statuses
}

/// No untyped error: fails naming every `BAD` line the workers logged.
pub fn assert_no_untyped_errors(name: &str, history: &str) {
    let bad: Vec<&str> = history.lines().filter(|l| l.contains(" BAD ")).collect();
    assert!(
        bad.is_empty(),
        "{name}: untyped errors:\n  {}",
        bad.join("\n  ")
    );
}

#[derive(Debug, Clone)]
pub struct Hold {
    pub pid: u32,
    pub owner: String,
    pub key: String,
    pub token: u64,
    pub hold_count: u32,
    /// 1 for an owner's first hold of the key in its process (no guard of it held), 2 and 3 for
    /// holds taken inside it.
    pub depth: usize,
    pub start: i64,
    pub lease_end: i64,
    /// `lock()` returned a guard that was already lost (its lease could have ended).
    pub lost_at_return: bool,
    pub end: Option<i64>,
    /// When the worker started to release it, the guard said it could be lost (the worker was
    /// stopped past its ttl).
    pub lost_at_end: bool,
}

impl Hold {
    /// Until when the hold was certain: until the worker started to release it; if by then the
    /// guard said it could be lost, only until the lease ended; if it never got to release it
    /// (killed), until the lease ended.
    pub fn certain_until(&self) -> i64 {
        match self.end {
            Some(end) if !self.lost_at_end => end,
            Some(end) => end.min(self.lease_end),
            None => self.lease_end,
        }
    }
}

/// The holds of a history (in the order they were logged), and how often each kind of line,
/// error and release outcome occurred.
pub fn parse(log: &str) -> (Vec<Hold>, HashMap<String, usize>) {
    let mut holds: Vec<Hold> = Vec::new();
    let mut counts: HashMap<String, usize> = HashMap::new();
    for l in log.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = l.split_whitespace().collect();
        let pid: u32 = f[0].parse().unwrap();
        *counts.entry(f[1].to_owned()).or_default() += 1;
        match f[1] {
            "GOT" => holds.push(Hold {
                pid,
                key: f[2].into(),
                token: f[3].parse().unwrap(),
                hold_count: f[4].parse().unwrap(),
                start: f[5].parse().unwrap(),
                lease_end: f[6].parse().unwrap(),
                lost_at_return: f[7] == "1",
                depth: f[8].parse().unwrap(),
                owner: f[9].into(),
                end: None,
                lost_at_end: false,
            }),
            "END" => {
                let (key, token): (&str, u64) = (f[2], f[3].parse().unwrap());
                let depth: usize = f[6].parse().unwrap();
                let h = holds
                    .iter_mut()
                    .rev()
                    .find(|h| {
                        h.pid == pid
                            && h.key == key
                            && h.token == token
                            && h.depth == depth
                            && h.end.is_none()
                    })
                    .expect("END without GOT");
                h.end = Some(f[4].parse().unwrap());
                h.lost_at_end = f[5] == "1";
            }
            "REL" => *counts.entry(format!("release {}", f[4])).or_default() += 1,
            "ERR" => *counts.entry(format!("lock {}", f[4])).or_default() += 1,
            _ => {}
        }
    }
    (holds, counts)
}

/// What a checked history contained, beyond the plain holds: the patterns the checks are for.
#[derive(Debug, Default)]
pub struct Figures {
    pub holds: usize,
    /// Holds taken inside another hold of the same owner (depth 2 or 3).
    pub nested: usize,
    /// First holds (depth 1) of an owner that had held the key before in this run.
    pub owner_came_back: usize,
    /// First holds of an owner whose previous call on that key (a `lock()` or a release) ended
    /// with an unknown outcome: the pattern that could count a hold twice.
    pub after_unknown: usize,
}

/// The checker: what must hold of every history (see the module's doc).
pub fn check(name: &str, holds: &[Hold], history: &str) -> Figures {
    assert!(
        holds.len() > 50,
        "{name}: only {} holds: too few to say anything",
        holds.len()
    );
    for h in holds {
        assert!(
            !h.lost_at_return,
            "{name}: a grant was returned dead: {h:?}"
        );
    }
    let figures = check_counts(name, holds, history);

    // Tenures: the holds of one (key, fencing token), i.e. an owner's nested holds of one lease.
    struct Tenure<'a> {
        first: &'a Hold,
        certain_until: i64,
    }
    let mut tenures: BTreeMap<(&str, u64), Tenure> = BTreeMap::new();
    for h in holds {
        let t = tenures.entry((&h.key, h.token)).or_insert(Tenure {
            first: h,
            certain_until: h.certain_until(),
        });
        assert!(
            t.first.pid == h.pid && t.first.owner == h.owner,
            "{name}: one tenure of {} (token {}) granted to two owners:\n  {:?}\n  {h:?}",
            h.key,
            h.token,
            t.first
        );
        t.certain_until = t.certain_until.max(h.certain_until());
    }
    let mut by_key: HashMap<&str, Vec<&Tenure>> = HashMap::new();
    for ((key, _), t) in &tenures {
        by_key.entry(*key).or_default().push(t);
    }
    for (key, mut ts) in by_key {
        ts.sort_by_key(|t| t.first.start);
        // Fencing order: tokens increase in the order the tenures began.
        for w in ts.windows(2) {
            assert!(
                w[1].first.token > w[0].first.token,
                "{name}: fencing tokens out of order on {key}:\n  {:?}\n  {:?}",
                w[0].first,
                w[1].first
            );
        }
        // No overlap: each tenure begins after every earlier one stopped being certain.
        let mut latest: Option<&Tenure> = None;
        for t in &ts {
            if let Some(prev) = latest {
                assert!(
                    t.first.start >= prev.certain_until,
                    "{name}: overlapping holds of {key} (the first certain until {}):\n  {:?}\n  {:?}",
                    prev.certain_until,
                    prev.first,
                    t.first
                );
            }
            if latest.is_none_or(|p| t.certain_until > p.certain_until) {
                latest = Some(t);
            }
        }
    }
    figures
}

/// What [`check`] would fail on, counted instead: tenures of a key that overlap an earlier one
/// (begun before it stopped being certain), and tenures whose fencing token is not above every
/// earlier one's. For set-ups that promise neither (asynchronous replication: a failover loses
/// acknowledged commits), to say how much was lost.
pub fn violations(holds: &[Hold]) -> (usize, usize) {
    let mut tenures: BTreeMap<(&str, u64), (i64, i64)> = BTreeMap::new();
    for h in holds {
        let t = tenures
            .entry((&h.key, h.token))
            .or_insert((h.start, h.certain_until()));
        t.0 = t.0.min(h.start);
        t.1 = t.1.max(h.certain_until());
    }
    let mut by_key: HashMap<&str, Vec<(i64, i64, u64)>> = HashMap::new();
    for ((key, token), (start, until)) in tenures {
        by_key.entry(key).or_default().push((start, until, token));
    }
    let (mut overlaps, mut regressions) = (0, 0);
    for (_, mut ts) in by_key {
        ts.sort_unstable();
        let (mut certain_until, mut top_token) = (i64::MIN, 0);
        for (start, until, token) in ts {
            if start < certain_until {
                overlaps += 1;
            }
            if token <= top_token {
                regressions += 1;
            }
            certain_until = certain_until.max(until);
            top_token = top_token.max(token);
        }
    }
    (overlaps, regressions)
}

/// No hold counted twice: a first hold is 1, a nested one its parent's count plus one (or 1 with
/// a new token: its parent's lease had ended, so it is a new tenure, which the overlap check
/// then judges).
fn check_counts(name: &str, holds: &[Hold], history: &str) -> Figures {
    let mut figures = Figures {
        holds: holds.len(),
        ..Figures::default()
    };
    // Per worker, its current nest of holds (outermost first).
    let mut nests: HashMap<u32, Vec<&Hold>> = HashMap::new();
    let mut seen: std::collections::HashSet<(&str, &str)> = Default::default();
    for h in holds {
        let nest = nests.entry(h.pid).or_default();
        nest.truncate(h.depth - 1);
        if h.depth == 1 {
            assert_eq!(
                h.hold_count,
                1,
                "{name}: a first hold counted as a re-entry (the owner's earlier hold counted \
                 twice, or one the process no longer tracked built on): {h:?}\n  {}",
                context(history, h)
            );
            if !seen.insert((&h.owner, &h.key)) {
                figures.owner_came_back += 1;
            }
        } else {
            figures.nested += 1;
            let parent = *nest.get(h.depth - 2).unwrap_or_else(|| {
                panic!("{name}: a nested hold without its parent in the history: {h:?}")
            });
            assert!(
                parent.owner == h.owner && parent.key == h.key,
                "{name}: {h:?} nested in {parent:?}"
            );
            if h.token == parent.token {
                assert_eq!(
                    h.hold_count,
                    parent.hold_count + 1,
                    "{name}: a re-entry miscounted:\n  parent {parent:?}\n  nested {h:?}\n  {}",
                    context(history, h)
                );
            } else {
                assert_eq!(
                    h.hold_count,
                    1,
                    "{name}: a re-entry into a new tenure (the parent's lease had ended) that \
                     built on the old one:\n  parent {parent:?}\n  nested {h:?}\n  {}",
                    context(history, h)
                );
            }
        }
        nest.push(h);
    }
    // The pattern of the issue: an owner takes a key again right after a call of it on that key
    // had an unknown outcome (only nesting workers use an owner twice).
    let mut unknown: std::collections::HashSet<(&str, &str)> = Default::default();
    let mut last_owner: HashMap<&str, &str> = HashMap::new();
    for l in history.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        match f.get(1) {
            Some(&"TRY") => {
                last_owner.insert(f[0], f[3]);
            }
            Some(&"ERR" | &"REL") if f[4] == "unknown" => {
                unknown.insert((last_owner[f[0]], f[2]));
            }
            Some(&"GOT") if f[8] == "1" && unknown.remove(&(f[9], f[2])) => {
                figures.after_unknown += 1;
            }
            _ => {}
        }
    }
    figures
}

/// What `h`'s worker logged about its key up to and including `h`: its last 12 lines.
fn context(history: &str, h: &Hold) -> String {
    let got = format!(
        "{} GOT {} {} {} {} ",
        h.pid, h.key, h.token, h.hold_count, h.start
    );
    let pid = h.pid.to_string();
    let mut lines: Vec<&str> = Vec::new();
    for l in history.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f[0] == pid && f.get(2) == Some(&h.key.as_str()) {
            lines.push(l);
        }
        if l.starts_with(&got) {
            break;
        }
    }
    let tail = &lines[lines.len().saturating_sub(12)..];
    format!(
        "its worker's last lines on the key:\n    {}",
        tail.join("\n    ")
    )
}

/// The rows of killed workers, the ones the caller allows, and the orphans among `rows` (`key`,
/// `owner`, `token` of each row held when the run had ended): a row is an orphan unless its
/// owner is one of a worker that never logged `EXIT` (killed), or `(key, token)` is in
/// `allowed`. Each orphan comes with what its worker logged about the key.
pub fn orphans(
    history: &str,
    rows: &[(String, Option<String>, u64)],
    allowed: &[(String, u64)],
) -> Vec<String> {
    let exited: Vec<u32> = history
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(1) == Some(&"EXIT")).then(|| f[0].parse().unwrap())
        })
        .collect();
    // Every owner a worker used (also for calls that failed) → that worker.
    let owners: HashMap<&str, u32> = history
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(1) == Some(&"TRY")).then(|| (f[3], f[0].parse().unwrap()))
        })
        .collect();
    let mut out = Vec::new();
    for (key, owner, token) in rows {
        let pid = owner.as_deref().and_then(|o| owners.get(o)).copied();
        let killed = pid.is_some_and(|p| !exited.contains(&p));
        if killed || allowed.contains(&(key.clone(), *token)) {
            continue;
        }
        let lines: Vec<&str> = history
            .lines()
            .filter(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                pid.is_some_and(|p| f[0] == p.to_string()) && f.get(2) == Some(&key.as_str())
            })
            .collect();
        let tail = &lines[lines.len().saturating_sub(8)..];
        out.push(format!(
            "{key} (token {token}) held by {owner:?} of worker {pid:?}, which exited; its last \
             lines on the key:\n    {}",
            tail.join("\n    ")
        ));
    }
    out
}

/// No orphan: whatever a worker that exited gracefully took, it gave back (or its background
/// resolution did) before it exited. To be called right after the last worker exited: the rows
/// `observer` (a locker on the workers' table) sees held then must all be of killed workers, or
/// in `allowed` (`(key, token)`: releases the database may have lost). A long-lease hold leaked
/// at any moment of the run is still live then (checked: every long lease of the history ends
/// after this snapshot), and so is a short one leaked in its last seconds.
pub async fn check_no_orphans(
    name: &str,
    history: &str,
    holds: &[Hold],
    observer: &Locker,
    allowed: &[(String, u64)],
) -> usize {
    let mut tries = 0;
    let (snapshot, held) = loop {
        let snapshot = now_us();
        match observer.held().await {
            Ok(held) => break (snapshot, held),
            // After a failover, the observer's pool may still hand out a connection it broke.
            Err(e) if tries < 10 => {
                tries += 1;
                eprintln!("{name}: reading the held rows: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("{name}: reading the held rows: {e:?}"),
        }
    };
    let rows: Vec<(String, Option<String>, u64)> = held
        .into_iter()
        .map(|i| (i.key, i.owner, i.fencing_token))
        .collect();
    let long: Vec<&Hold> = holds.iter().filter(|h| h.key.starts_with("long")).collect();
    assert!(
        long.len() >= 5,
        "{name}: only {} holds of a long-lease key: the orphan check would see too little",
        long.len()
    );
    let first = long.iter().map(|h| h.lease_end).min().unwrap();
    assert!(
        first > snapshot,
        "{name}: a long lease of the run ended {} ms before the orphan check: a hold leaked then \
         would not be seen (make long_ttl longer)",
        (snapshot - first) / 1000
    );
    let found = orphans(history, &rows, allowed);
    assert!(
        found.is_empty(),
        "{name}: holds outlived the run ({} rows held right after the workers exited):\n  {}",
        rows.len(),
        found.join("\n  ")
    );
    rows.len()
}

/// How the calls of a history ended, kept apart: `lock()` errors by kind (`busy`, `lost`,
/// `unknown`, `io:…`, `server:…`) and release outcomes (`ok`, `notheld`, `unknown`, …).
#[derive(Debug, Default)]
pub struct Tally {
    pub grants: usize,
    pub lock_errors: BTreeMap<String, usize>,
    pub releases: BTreeMap<String, usize>,
}

pub fn tally(log: &str) -> Tally {
    let mut t = Tally::default();
    for l in log.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        match f.get(1) {
            Some(&"GOT") => t.grants += 1,
            Some(&"ERR") => *t.lock_errors.entry(f[4].to_owned()).or_default() += 1,
            Some(&"REL") => *t.releases.entry(f[4].to_owned()).or_default() += 1,
            _ => {}
        }
    }
    t
}
