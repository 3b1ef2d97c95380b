//! A chaos run and a history checker, on PostgreSQL and MariaDB: several worker processes (this
//! test binary, on an ignored entry point) take and give back locks on a few keys, each
//! through a fault proxy of its own, while the parent cuts replies and sends, blackholes, delays
//! replies past the ttl, refuses connections, stops a holder (SIGSTOP) past its ttl and kills one
//! (SIGKILL). Two of the workers keep one owner for their whole life and re-enter the key they hold
//! (nested locks), so an owner comes back to a key after every fault its calls met. Every worker
//! logs what it was told; the checker (`common/history.rs`, shared with `tests/replicated.rs`,
//! where each check is described) then proves from the logs and the table: every grant was
//! returned live, no overlapping tenures, fencing order, hold counts exactly as the nesting
//! implies (a first hold is 1 after any fault), no orphaned hold (checked right after the workers
//! exit, while every long lease of the run is still live), no untyped error (a pool time-out
//! fails the run). The last tests plant each violation in a synthetic history and show the
//! checker catches it.

#![cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(unused))]

mod common;

use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use common::history::{self, check, parse, signal, Workload};
use common::proxy::{Mode, Proxy};
use dblock::Locker;

const WORKERS: usize = 4;
const KEYS: usize = 3;
const RUN: Duration = Duration::from_secs(20);
const TTL: Duration = Duration::from_secs(3);
/// The lease of the long-lease keys: longer than the run, the linger and the checks, so a hold
/// leaked at any moment is still live when the orphan check looks.
const LONG_TTL: Duration = Duration::from_secs(60);
/// No fault in the last seconds of the run: the network is normal again well before the
/// workers stop (a reply delayed past the ttl may still be on its way for 3.5 s).
const QUIET: Duration = Duration::from_secs(2);
/// Workers wait this long before they exit, so background releases and resolutions finish on
/// the healed network (a resolution resends at least every 250 ms; a send is bounded by the
/// workers' 4 s statement time-out, so one sent into the last fault has its answer by now).
const LINGER: Duration = Duration::from_secs(3);
const WORKLOAD: Workload = Workload {
    run: RUN,
    ttl: TTL,
    keys: KEYS,
    long_ttl: LONG_TTL,
    long_keys: 2,
    linger: LINGER,
};

/// The worker: runs only inside a child process (ignored in normal runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "chaos worker entry point, started by the chaos test"]
async fn chaos_worker() {
    history::worker(&WORKLOAD).await;
}

/// The batch run's workload: many keys, so that the tasks of one worker lock distinct keys at
/// once and their statements travel together.
const BATCH_WORKLOAD: Workload = Workload {
    keys: 32,
    ..WORKLOAD
};

/// Loops at once in each worker of the batch run.
const BATCH_TASKS: usize = 12;

/// The batch run's worker: `BATCH_TASKS` loops at once (`DBLOCK_CHAOS_TASKS`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "chaos worker entry point, started by the chaos test"]
async fn chaos_batch_worker() {
    history::worker(&BATCH_WORKLOAD).await;
}

/// Worker `i`: the odd ones keep one owner and re-enter (the killed one, 0, does not). With
/// `tasks` > 1, that many loops at once in the process (coalesced statements).
fn worker(i: usize, url: &str, table: &str, log: &Path, tasks: usize) -> Child {
    let entry = if tasks > 1 {
        "chaos_batch_worker"
    } else {
        "chaos_worker"
    };
    history::worker_command(entry, url, table, log, i % 2 == 1)
        .env("DBLOCK_CHAOS_TASKS", tasks.to_string())
        .spawn()
        .unwrap()
}

#[cfg(not(any(feature = "postgres", feature = "mysql")))]
#[test]
#[ignore = "the chaos run needs `--features postgres` and/or `--features mysql` (or --all-features)"]
fn chaos_needs_a_server_backend() {}

#[derive(Clone, Copy)]
enum Step {
    Fault(Fault),
    /// SIGSTOP a worker past the ttl, then SIGCONT (first cycle only).
    Stop,
    /// SIGKILL a worker (first cycle only).
    Kill,
}

#[derive(Clone, Copy)]
enum Fault {
    /// The replies of whatever is in flight are lost; then the connections are reset and
    /// reconnecting is refused for a while: outcomes stay unknown past a short `wait`.
    LostRepliesThenRefused,
    /// Replies arrive later than the ttl: grants that come back dead must be given back.
    Late,
    LostSends,
    /// A silent partition, shorter than the statement time-out.
    Blackhole,
    /// The connections are reset and reconnecting is refused for a while.
    Refused,
    /// A silent partition past the statement time-out: releases return "outcome unknown" and
    /// go on in the background, `lock()` calls give up with their outcome unknown.
    Partition,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::LostRepliesThenRefused => "lost replies, then reset + refused",
            Fault::Late => "replies later than the ttl",
            Fault::LostSends => "lost sends",
            Fault::Blackhole => "blackhole",
            Fault::Refused => "reset + refused",
            Fault::Partition => "partition past the statement time-out",
        }
    }

    /// (mode, for how long, then how long new connections are refused after a reset).
    fn plan(self) -> (Mode, Duration, Duration) {
        let ms = Duration::from_millis;
        match self {
            Fault::LostRepliesThenRefused => (Mode::HoldReplies, ms(300), ms(700)),
            Fault::Late => (Mode::DelayReplies(TTL + ms(500)), ms(2000), ms(0)),
            Fault::LostSends => (Mode::DropSends, ms(400), ms(0)),
            Fault::Blackhole => (Mode::Blackhole, ms(1500), ms(0)),
            Fault::Refused => (Mode::Pass, ms(0), ms(700)),
            Fault::Partition => (Mode::Blackhole, ms(4500), ms(0)),
        }
    }

    fn lasts(self) -> Duration {
        let (_, hold, refused) = self.plan();
        hold + refused
    }

    async fn inject(self, proxies: &[Proxy], targets: &[usize]) {
        let (mode, hold, refused) = self.plan();
        for &w in targets {
            proxies[w].set(mode);
        }
        tokio::time::sleep(hold).await;
        if !refused.is_zero() {
            for &w in targets {
                proxies[w].set(Mode::Refuse);
                proxies[w].reset_all();
            }
            tokio::time::sleep(refused).await;
        }
        for &w in targets {
            proxies[w].set(Mode::Pass);
        }
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_run_keeps_every_promise() {
    on_every_server("chaos", 1).await;
}

/// The same run with `BATCH_TASKS` loops in each worker: their acquires and releases share
/// statements (2 to 12 rows each), through the same faults; the same checks hold per row.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_run_with_coalesced_statements_keeps_every_promise() {
    on_every_server("chaos_batch", BATCH_TASKS).await;
}

/// [`run`] on PostgreSQL and MariaDB, those this build has and this machine reaches, on a
/// fresh table named after `test`, with `tasks` loops a worker.
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn on_every_server(test: &str, tasks: usize) {
    #[allow(unused_mut)]
    let mut servers: Vec<(&str, String, Option<common::Db>)> = Vec::new();
    #[cfg(feature = "postgres")]
    servers.push((
        "postgres",
        common::postgres_url(),
        common::postgres(test).await,
    ));
    #[cfg(feature = "mysql")]
    servers.push(("mariadb", common::mysql_url(), common::mysql(test).await));
    for (name, direct, db) in servers {
        let Some(db) = db else { continue };
        run(name, &direct, &db.locker, tasks).await;
    }
}

async fn run(name: &str, direct: &str, observer: &Locker, tasks: usize) {
    let host = common::host_of(direct);
    // Kept if the run fails (removed once every check passed).
    let log = std::env::temp_dir().join(format!(
        "dblock-chaos-{name}-{tasks}-{}.history",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&log);
    // DBLOCK_CHAOS_TRACE=1: each worker's library events go to `<history>.<pid>.trace`.
    eprintln!("chaos on {name}: history in {}", log.display());
    let table = observer.table_name().to_owned();
    let mut proxies = Vec::new();
    let mut children = Vec::new();
    for i in 0..WORKERS {
        let proxy = Proxy::start(&host).await;
        children.push(worker(i, &proxy.url(direct), &table, &log, tasks));
        proxies.push(proxy);
    }
    let started = Instant::now();
    let mut rng = fastrand::Rng::with_seed(7);
    let mut faults: HashMap<&str, usize> = HashMap::new();
    let killed = 0; // the worker that gets SIGKILL, a third into the run
                    // The schedule, repeated while there is time: each fault on two workers at once (the
                    // nesting ones are 1 and 3), a stop past the ttl and a kill once.
    let schedule: [(Step, [usize; 2]); 9] = [
        (Step::Fault(Fault::LostRepliesThenRefused), [1, 2]),
        (Step::Fault(Fault::Late), [3, 0]),
        (Step::Stop, [2, 2]),
        (Step::Fault(Fault::LostSends), [1, 0]),
        (Step::Fault(Fault::Blackhole), [2, 3]),
        (Step::Kill, [killed, killed]),
        (Step::Fault(Fault::Refused), [3, 1]),
        (Step::Fault(Fault::Partition), [1, 3]),
        (Step::Fault(Fault::LostRepliesThenRefused), [3, 2]),
    ];
    let mut cycle = 0;
    'run: loop {
        for &(step, targets) in &schedule {
            let fault = match step {
                Step::Fault(f) => f,
                Step::Stop if cycle == 0 => {
                    signal(&children[targets[0]], "-STOP");
                    tokio::time::sleep(TTL + Duration::from_millis(700)).await;
                    signal(&children[targets[0]], "-CONT");
                    *faults.entry("SIGSTOP past the ttl").or_default() += 1;
                    continue;
                }
                Step::Kill if cycle == 0 => {
                    signal(&children[targets[0]], "-KILL");
                    *faults.entry("SIGKILL").or_default() += 1;
                    continue;
                }
                Step::Stop | Step::Kill => continue,
            };
            // Never on the killed worker once it is dead (its proxy has no one to hurt).
            let targets: Vec<usize> = targets
                .into_iter()
                .filter(|&w| w != killed || !faults.contains_key("SIGKILL"))
                .collect();
            if started.elapsed() + fault.lasts() + QUIET >= RUN {
                break 'run;
            }
            *faults.entry(fault.name()).or_default() += 1;
            fault.inject(&proxies, &targets).await;
            tokio::time::sleep(Duration::from_millis(rng.u64(100..300))).await;
        }
        cycle += 1;
    }
    let statuses = history::wait_all(children).await;
    let exited = Instant::now();
    let history = std::fs::read_to_string(&log).unwrap();
    let (holds, counts) = parse(&history);
    // No orphan, first, while the long leases are live: whatever a survivor took, it gave back
    // (or its resolution did) before it exited.
    let rows = history::check_no_orphans(name, &history, &holds, observer, &[]).await;
    let looked_after = exited.elapsed();
    // No untyped error: the workers that met one say which.
    history::assert_no_untyped_errors(name, &history);
    for (i, status) in statuses.iter().enumerate() {
        if i == killed {
            assert_eq!(
                status.signal(),
                Some(9),
                "{name}: worker {i} ended before its SIGKILL: {status}"
            );
        } else {
            assert!(status.success(), "{name}: worker {i} failed: {status}");
        }
    }
    let figures = check(name, &holds, &history);
    // The patterns the count check is for did happen.
    assert!(
        figures.nested >= 20 && figures.owner_came_back >= 20,
        "{name}: too little re-entry to check the counts: {figures:?}"
    );
    // Statements of several rows the surviving workers sent, and the rows in them.
    let coalesced = history.lines().fold((0u64, 0u64), |(s, r), l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        match f.get(1) {
            Some(&"COALESCED") => (
                s + f[2].parse::<u64>().unwrap(),
                r + f[3].parse::<u64>().unwrap(),
            ),
            _ => (s, r),
        }
    });
    if tasks > 1 && cfg!(feature = "_test-util") {
        assert!(
            coalesced.0 > 0,
            "{name}: {tasks} loops per worker never shared a statement"
        );
    }
    std::fs::remove_file(&log).unwrap();
    remove_traces(&log);
    eprintln!(
        "chaos on {name} ({tasks} loops a worker): {figures:?}, {rows} rows held (of the killed \
         worker) {} ms after the workers exited, {counts:?}, faults {faults:?}, coalesced \
         statements and their rows {coalesced:?}",
        looked_after.as_millis()
    );
}

/// Removes the workers' `DBLOCK_CHAOS_TRACE` files of the history `log` (`<log>.<pid>.trace`).
fn remove_traces(log: &Path) {
    let name = log.file_name().unwrap().to_string_lossy().into_owned();
    for entry in std::fs::read_dir(log.parent().unwrap()).unwrap().flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        if file.starts_with(&format!("{name}.")) && file.ends_with(".trace") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The checker can fail: each violation, planted in an otherwise valid history, is caught.
mod checker {
    use super::common::history::{check, error_kind, orphans, parse};
    use dblock::LockError;

    const A: &str = "aaaaaaaa-0000-4000-8000-000000000001";

    /// One hold of `key0` in a synthetic history, and an optional re-entry inside it.
    #[derive(Clone)]
    struct Spec {
        owner: String,
        token: u64,
        count: u32,
        start: i64,
        end: i64,
        lease_end: i64,
        lost_at_return: bool,
        lost_at_end: bool,
        /// (token, count, lease end) of a nested hold taken 10 µs in, ended 20 µs in.
        nested: Option<(u64, u32, i64)>,
    }

    /// 60 holds of `key0`, 10 ms apart, each 5 ms long, each by a fresh owner, the odd ones with
    /// a re-entry inside: a valid history.
    fn valid() -> Vec<Spec> {
        (0..60u64)
            .map(|i| {
                let (token, start) = (100 + 10 * i, 1_000_000 + i as i64 * 10_000);
                Spec {
                    owner: format!("owner-{i}"),
                    token,
                    count: 1,
                    start,
                    end: start + 5_000,
                    lease_end: start + 3_000_000,
                    lost_at_return: false,
                    lost_at_end: false,
                    nested: (i % 2 == 1).then_some((token, 2, start + 3_000_000)),
                }
            })
            .collect()
    }

    fn lines(specs: &[Spec]) -> String {
        let mut out = String::new();
        let mut line = |l: String| out += &format!("1 {l}\n");
        for s in specs {
            let (o, t) = (&s.owner, s.token);
            line(format!("TRY key0 {o} 1"));
            let lost = u8::from(s.lost_at_return);
            line(format!(
                "GOT key0 {t} {} {} {} {lost} 1 {o}",
                s.count, s.start, s.lease_end
            ));
            if let Some((nt, nc, nl)) = s.nested {
                line(format!("TRY key0 {o} 2"));
                line(format!("GOT key0 {nt} {nc} {} {nl} 0 2 {o}", s.start + 10));
                line(format!("END key0 {nt} {} 0 2", s.start + 20));
                line(format!("REL key0 {nt} ok {} 2", s.start + 30));
            }
            line(format!(
                "END key0 {t} {} {} 1",
                s.end,
                u8::from(s.lost_at_end)
            ));
            line(format!("REL key0 {t} ok {} 1", s.end + 100));
        }
        line("EXIT 2000000".into());
        out
    }

    /// What the checker says of a history: `Ok`, or the message it failed with.
    fn verdict(specs: &[Spec]) -> Result<(), String> {
        let history = lines(specs);
        let (holds, _) = parse(&history);
        std::panic::catch_unwind(|| check("synthetic", &holds, &history))
            .map(|_| ())
            .map_err(|p| {
                p.downcast_ref::<String>()
                    .cloned()
                    .unwrap_or_else(|| "?".into())
            })
    }

    #[track_caller]
    fn fails_with(specs: &[Spec], message: &str) {
        let e = verdict(specs).expect_err("the violation was not caught");
        assert!(e.contains(message), "caught, but as {e:?}");
    }

    /// `valid()` with hold `n` changed by `f`.
    fn planted(n: usize, f: impl Fn(&mut Spec)) -> Vec<Spec> {
        let mut specs = valid();
        f(&mut specs[n]);
        specs
    }

    #[test]
    fn catches_every_planted_violation() {
        verdict(&valid()).expect("the valid history passes");
        // A first hold counted twice (the issue: an owner's first hold after a lost reply is 2).
        fails_with(
            &planted(4, |s| s.count = 2),
            "a first hold counted as a re-entry",
        );
        // A re-entry counted once more than its nesting.
        fails_with(
            &planted(5, |s| s.nested = Some((s.token, 3, s.lease_end))),
            "a re-entry miscounted",
        );
        // A re-entry after the parent's lease ended is a new tenure: count 1, a new token ...
        let renewed = |count| {
            planted(5, move |s| {
                s.lease_end = s.start + 5;
                s.lost_at_end = true;
                s.nested = Some((s.token + 5, count, s.start + 3_000_000));
            })
        };
        verdict(&renewed(1)).expect("a new tenure inside an ended one");
        // ... that does not build on the old tenure's count ...
        fails_with(&renewed(2), "built on the old one");
        // ... and whose parent knew it had lost (else the two tenures overlap).
        let mut unaware = renewed(1);
        unaware[5].lost_at_end = false;
        fails_with(&unaware, "overlapping holds");
        // A grant returned dead.
        fails_with(&planted(6, |s| s.lost_at_return = true), "returned dead");
        // Fencing tokens out of order.
        fails_with(&planted(8, |s| s.token = 90), "fencing tokens out of order");
        // Two owners certainly holding one key at once: hold 10 ends after hold 11 began.
        fails_with(
            &planted(10, |s| s.end = s.start + 15_000),
            "overlapping holds",
        );
        // The same, but hold 10 knew its lease was gone, which ended before hold 11: fine.
        verdict(&planted(10, |s| {
            s.end = s.start + 15_000;
            s.lost_at_end = true;
            s.lease_end = s.start + 6_000;
        }))
        .expect("a hold that knew it was lost");
        // One tenure (key, token) granted to two owners.
        let mut shared = valid();
        shared[12].token = shared[11].token;
        shared[12].nested = None;
        fails_with(&shared, "granted to two owners");
    }

    #[test]
    fn catches_an_orphan() {
        let history = format!(
            "1 TRY long0 {A} 1\n1 GOT long0 7 1 1 60000001 0 1 {A}\n1 EXIT 5\n\
             2 TRY long1 owner-b 1\n2 GOT long1 9 1 1 60000001 0 1 owner-b\n"
        );
        let row = |key: &str, owner: &str, token| (key.to_owned(), Some(owner.to_owned()), token);
        // Worker 1 exited with long0 held: an orphan.
        let found = orphans(&history, &[row("long0", A, 7)], &[]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("GOT long0 7"), "{found:?}");
        // ... unless the caller allows it (a release the database lost).
        assert!(orphans(&history, &[row("long0", A, 7)], &[("long0".into(), 7)]).is_empty());
        // Worker 2 was killed (no EXIT): its hold may outlive it.
        assert!(orphans(&history, &[row("long1", "owner-b", 9)], &[]).is_empty());
        // A row of an owner no worker used.
        assert_eq!(
            orphans(&history, &[row("long1", "stranger", 9)], &[]).len(),
            1
        );
    }

    #[test]
    fn a_pool_time_out_is_untyped() {
        let db = |e| LockError::Database(e);
        assert!(error_kind(&db(sqlx::Error::PoolTimedOut)).is_err());
        assert!(error_kind(&db(sqlx::Error::PoolClosed)).is_err());
        assert!(error_kind(&db(sqlx::Error::Protocol("eh".into()))).is_err());
        assert!(error_kind(&LockError::Config("x".into())).is_err());
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(error_kind(&db(sqlx::Error::Io(refused)))
            .unwrap()
            .starts_with("io:ConnectionRefused"));
        let busy = LockError::Busy {
            key: "k".into(),
            waited: std::time::Duration::ZERO,
        };
        assert_eq!(error_kind(&busy).unwrap(), "busy");
    }
}
