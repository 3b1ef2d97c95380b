//! The chaos checker (`common/history.rs`, shared with `tests/chaos.rs`) through the failures of
//! replicated set-ups that `scripts/replicated.sh` brings up on loopback:
//! - **MariaDB Galera, 3 nodes**: worker processes spread over the nodes, each through a fault
//!   proxy of its own. Mid-run one node's mariadbd is killed (`kill -9`): the whole cluster stalls
//!   until it is evicted (about 6 s), and a second later the proxies of the workers on that node
//!   are re-pointed to the survivors, as a load balancer would. dblock's lock sessions must run
//!   with `wsrep_retry_autocommit=0` and `wsrep_sync_wait=1` (checked on the parent's locker and
//!   by every worker at exit, on a connection of its own pool made after the kill).
//! - **PostgreSQL primary + synchronous standby**: workers through proxies to the primary; mid-run
//!   the primary's walsender is stopped for half a second (commits pile up waiting for the
//!   standby: those in flight exist on the primary only), then the primary is stopped
//!   (`pg_ctl -m immediate stop`), the standby promoted, and the proxies re-pointed to it. dblock's
//!   releases are lazily durable (`synchronous_commit = off`), so some acknowledged releases are
//!   lost with the primary: their keys stay held on the promoted standby until their leases end.
//! - **PostgreSQL primary + asynchronous standby** (`postgres_asynchronous_failover_never_
//!   reissues_a_token`, a pair of its own): grants committed on the primary while its walsender is
//!   stopped are lost with it; the promoted standby's next fencing token must still be above every
//!   token they had.
//!
//! In the first two, a lock taken on the failing server just before the failure (60 s ttl) must
//! still be there on the survivor (same owner, same fencing token), and its holder must be able to
//! release it there. The workers' ttl (3 s) is deliberately shorter than Galera's stall: leases run out
//! while nothing commits, and grants that come back late must be given back, not returned.
//!
//! The fenced-write run with steals of `tests/chaos_kinds.rs` (`common/fenced.rs`: leases,
//! steals and `lock_in` transactions of one key, each writing its token in a fenced transaction;
//! the committed tokens must grow in commit order) runs here too: through the Galera node kill
//! (`galera_fenced_writes_through_a_node_kill`), and through a Patroni switchover and a killed
//! leader (`patroni_failover_fenced_writes_and_steals`, run by `scripts/patroni.sh test`).
//!
//! Runs only when the script exported the set-ups' URLs (`scripts/replicated.sh test` does it
//! all: install, up, this test, down); otherwise it says SKIPPING and passes, unless
//! `DBLOCK_REQUIRE_REPLICATED=1`. A killed node or a promoted standby stays that way: each `up`
//! allows one run.

#![cfg_attr(
    not(any(feature = "postgres", all(feature = "mysql", feature = "_test-util"))),
    allow(unused)
)]

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::history::{self, check, parse, Workload};
use common::proxy::Proxy;
use dblock::{LockGuard, LockInfo, Locker};

const WORKLOAD: Workload = Workload {
    run: Duration::from_secs(18),
    ttl: Duration::from_secs(3),
    keys: 3,
    // Longer than the run, the linger and the checks: a hold leaked at any moment of the run is
    // still live when the orphan check looks, right after the workers exit.
    long_ttl: Duration::from_secs(90),
    long_keys: 2,
    linger: Duration::from_secs(4),
};
/// When the failure is injected, after the workers started.
const FAULT_AT: Duration = Duration::from_secs(5);
/// Galera: how long the "load balancer" takes to re-point the proxies of the killed node (on
/// PostgreSQL they follow the promotion at once).
#[cfg(all(feature = "mysql", feature = "_test-util"))]
const REPOINT_AFTER: Duration = Duration::from_secs(1);
/// PostgreSQL: how long (seconds) the walsender is stopped before the primary is.
#[cfg(feature = "postgres")]
const WALSENDER_STALL: &str = "0.5";
/// The lock held across the failure.
const SURVIVOR_TTL: Duration = Duration::from_secs(60);

/// The two set-ups share two cores: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn require_replicated() -> bool {
    std::env::var("DBLOCK_REQUIRE_REPLICATED").is_ok_and(|v| v == "1")
}

/// The value of `var`, exported by `scripts/replicated.sh`; `None` (after a loud SKIPPING) when
/// the set-up is not up.
fn setup_url(var: &str, what: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ if require_replicated() => {
            panic!(
                "{var} is not set and DBLOCK_REQUIRE_REPLICATED=1: run scripts/replicated.sh test"
            )
        }
        _ => {
            common::shout(&format!(
                "SKIPPING the {what} chaos run: {var} is not set. `scripts/replicated.sh test` \
                 brings the replicated set-ups up on loopback, runs this test and tears them down \
                 (as root); DBLOCK_REQUIRE_REPLICATED=1 makes this a failure."
            ));
            None
        }
    }
}

/// Runs a subcommand of `scripts/replicated.sh`; its `name=value` lines on stdout.
async fn ctl(args: &[&str]) -> HashMap<String, String> {
    run_script("DBLOCK_REPLICATED_CTL", "replicated.sh", args).await
}

/// `scripts/<name>`, or the script the variable `var` names.
fn script_path(var: &str, name: &str) -> String {
    std::env::var(var)
        .unwrap_or_else(|_| format!("{}/../scripts/{name}", env!("CARGO_MANIFEST_DIR")))
}

/// `scripts/<name> <args>` (or the script the variable `var` names): its stdout.
fn run_script_blocking(var: &str, name: &str, args: &[String]) -> String {
    let script = script_path(var, name);
    let out = Command::new("bash")
        .arg(&script)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("run {script}: {e}"));
    assert!(out.status.success(), "{script} {args:?}: {}", out.status);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `scripts/<name> <args>` (or the script the variable `var` names): its `name=value` lines.
async fn run_script(var: &str, name: &str, args: &[&str]) -> HashMap<String, String> {
    let (var, name) = (var.to_owned(), name.to_owned());
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        run_script_blocking(&var, &name, &args)
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    })
    .await
    .unwrap()
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

/// The worker: runs only inside a child process (ignored in normal runs). On Galera it also
/// checks, at exit, the session settings of its locker's pool: by then its connections were made
/// after the kill, through a re-pointed proxy for the workers of the killed node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "worker entry point, started by the replicated chaos runs"]
async fn replicated_worker() {
    let locker = history::worker(&WORKLOAD).await;
    #[cfg(all(feature = "mysql", feature = "_test-util"))]
    if std::env::var("DBLOCK_CHAOS_URL").is_ok_and(|u| u.starts_with("mysql")) {
        assert_galera_session(&locker).await;
    }
    let _ = locker;
}

/// dblock's lock sessions on Galera: no automatic autocommit retry (its two-row answer to one
/// RETURNING statement), causal reads. Read on a connection of the locker's own pool (retried: a
/// pooled connection may be one the kill broke).
#[cfg(all(feature = "mysql", feature = "_test-util"))]
async fn assert_galera_session(locker: &Locker) {
    for (variable, want) in [("wsrep_retry_autocommit", "0"), ("wsrep_sync_wait", "1")] {
        let mut tries = 0;
        let value = loop {
            match dblock::test_util::mysql_session_variable(locker, variable).await {
                Ok(v) => break v,
                Err(e) if tries < 20 => {
                    tries += 1;
                    eprintln!("reading @@session.{variable}: {e}");
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(e) => panic!("reading @@session.{variable}: {e}"),
            }
        };
        assert_eq!(
            value.as_deref(),
            Some(want),
            "a lock session runs with {variable}={value:?}"
        );
    }
}

/// Worker `w`: the odd ones keep one owner and re-enter (see `common/history.rs`).
fn spawn(w: usize, url: &str, table: &str, log: &Path) -> Child {
    history::spawn_worker("replicated_worker", url, table, log, w % 2 == 1)
}

/// A lock taken just before the failure, through a proxy of its own to the server that fails.
struct Survivor {
    guard: LockGuard,
    before: LockInfo,
}

async fn take_survivor(holder: &Locker, observer: &Locker) -> Survivor {
    let guard = holder
        .lock("survivor")
        .ttl(SURVIVOR_TTL)
        .wait(Duration::from_secs(10))
        .await
        .expect("survivor lock");
    let before = observer
        .inspect("survivor")
        .await
        .unwrap()
        .expect("survivor row");
    assert!(before.held, "{before:?}");
    Survivor { guard, before }
}

/// After the failure: the row on the survivor is the same hold, and its holder releases it there.
/// Returns how the release went.
async fn check_survivor(name: &str, survivor: Survivor, observer: &Locker) -> String {
    let after = retry("inspect the survivor lock", || observer.inspect("survivor"))
        .await
        .expect("the survivor lock's row is gone");
    assert!(
        after.held
            && after.owner == survivor.before.owner
            && after.fencing_token == survivor.before.fencing_token,
        "{name}: the lock held across the failure changed:\n  before {:?}\n  after  {after:?}",
        survivor.before
    );
    let released = match survivor.guard.release().await {
        Ok(()) => "ok".to_owned(),
        Err(e) if e.is_outcome_unknown() => "outcome unknown (resolved in the background)".into(),
        Err(e) => panic!("{name}: releasing the survivor lock: {e:?}"),
    };
    // Released for certain, within its statement time-outs.
    let started = Instant::now();
    loop {
        let info = retry("inspect the survivor lock", || observer.inspect("survivor")).await;
        if info.as_ref().is_none_or(|i| !i.held) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{name}: the survivor lock is still held after its release: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    released
}

/// An operator query (or a poll of a replica's state), again until it succeeds, for 20 s at most
/// (a pool may still hand out connections the failure broke).
async fn retry<T, E, F, Fut>(what: &str, f: F) -> T
where
    E: std::fmt::Display + std::fmt::Debug,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let started = Instant::now();
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) if started.elapsed() < Duration::from_secs(20) => {
                eprintln!("{what}: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("{what}: {e:?}"),
        }
    }
}

#[cfg(any(feature = "postgres", all(feature = "mysql", feature = "_test-util")))]
/// A client of a surviving server that locks and unlocks a key of its own table in a loop until
/// told to stop: when it got its grants, to measure how long nothing could be granted.
fn probe(
    locker: Locker,
    stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<Vec<i64>> {
    tokio::spawn(async move {
        let mut grants = Vec::new();
        while !*stop.borrow() {
            match locker
                .lock("probe")
                .ttl(Duration::from_secs(10))
                .wait(Duration::from_secs(30))
                .await
            {
                Ok(g) => {
                    grants.push(now_us());
                    let _ = g.release().await;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        grants
    })
}

/// The longest time without a grant among `grants` (µs since the epoch) from 1 s before the
/// fault `at` to 20 s after it, and when that gap began, relative to the fault.
fn longest_gap(mut grants: Vec<i64>, at: i64) -> Option<(Duration, i64)> {
    grants.retain(|&g| g >= at - 1_000_000 && g <= at + 20_000_000);
    grants.sort_unstable();
    grants.windows(2).max_by_key(|w| w[1] - w[0]).map(|w| {
        (
            Duration::from_micros((w[1] - w[0]) as u64),
            (w[0] - at) / 1000,
        )
    })
}

fn gap(grants: Vec<i64>, at: i64) -> String {
    match longest_gap(grants, at) {
        Some((gap, from)) => format!("{} ms (from {from:+} ms)", gap.as_millis()),
        None => "n/a".to_owned(),
    }
}

/// Waits for every worker (none is killed: all must exit gracefully), then checks the table
/// (no orphan, right away, while the long leases are live; `allowed`: rows `(key, token)` whose
/// acknowledged release the failure lost) and the history. How the calls ended, and when each
/// hold began.
async fn finish(
    name: &str,
    children: Vec<Child>,
    log: &Path,
    observer: &Locker,
    allowed: &[(String, u64)],
) -> (history::Tally, Vec<i64>, history::Figures) {
    let statuses = history::wait_all(children).await;
    let history = std::fs::read_to_string(log).unwrap();
    let (holds, _) = parse(&history);
    history::check_no_orphans(name, &history, &holds, observer, allowed).await;
    history::assert_no_untyped_errors(name, &history);
    for (i, status) in statuses.iter().enumerate() {
        assert!(status.success(), "{name}: worker {i} failed: {status}");
    }
    let figures = check(name, &holds, &history);
    let starts = holds.iter().map(|h| h.start).collect();
    (history::tally(&history), starts, figures)
}

/// The figures of a run, one per line, on stderr (libtest's capture cannot hide them).
fn report(name: &str, tally: &history::Tally, figures: &history::Figures, lines: &[String]) {
    let verdict = if figures.holds == 0 {
        "measured, not required (see below)"
    } else {
        "no violation"
    };
    let mut out = format!(
        "FIGURES {name}\n  holds checked: {}, {verdict} ({} nested, {} first holds of an \
         owner back at a key, {} of them right after an unknown outcome)\n  lock() errors: \
         {:?}\n  release outcomes: {:?}\n",
        tally.grants,
        figures.nested,
        figures.owner_came_back,
        figures.after_unknown,
        tally.lock_errors,
        tally.releases
    );
    for l in lines {
        out += &format!("  {l}\n");
    }
    common::shout(&out);
}

fn ms(d: Duration) -> String {
    format!("{} ms", d.as_millis())
}

#[cfg(not(all(feature = "mysql", feature = "_test-util")))]
#[test]
#[ignore = "the Galera chaos run needs `--features mysql,_test-util` (or --all-features)"]
fn galera_needs_the_mysql_and_test_util_features() {}

#[cfg(all(feature = "mysql", feature = "_test-util"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn galera_node_killed_mid_run() {
    use sqlx::MySqlPool;

    let _one_at_a_time = SERIAL.lock().await;
    let Some(urls) = setup_url("DBLOCK_GALERA_URLS", "MariaDB Galera") else {
        return;
    };
    let name = "galera";
    let urls: Vec<String> = urls.split(',').map(str::to_owned).collect();
    assert_eq!(urls.len(), 3, "DBLOCK_GALERA_URLS: three node URLs");
    let hosts: Vec<String> = urls.iter().map(|u| common::host_of(u)).collect();
    const KILLED: usize = 2; // node 3

    // The cluster as the script left it: three nodes, synced.
    let plain = MySqlPool::connect(&urls[0]).await.expect("node 1");
    assert_eq!(
        cluster_size(&plain).await.unwrap(),
        "3",
        "a 3-node cluster (each `scripts/replicated.sh up` allows one run)"
    );

    let observer = Locker::connect(&urls[0])
        .await
        .unwrap()
        .table(&common::table_for("galera"));
    observer.migrate().await.unwrap();
    let table = observer.table_name().to_owned();
    // dblock's sessions differ from the server's defaults, which a plain session keeps.
    assert_galera_session(&observer).await;
    let plain_retry: String =
        sqlx::query_scalar("SELECT CAST(@@session.wsrep_retry_autocommit AS CHAR)")
            .fetch_one(&plain)
            .await
            .unwrap();
    assert_eq!(
        plain_retry, "1",
        "a plain session keeps the server default, so the check above reads dblock's own setting"
    );

    // Galera's conflict counters of the survivors, to count the conflicts dblock retried.
    let node2 = MySqlPool::connect(&urls[1]).await.expect("node 2");
    // Before the run: `lock_in` on two nodes, while all three are up.
    let across_nodes = lock_in_across_nodes(&urls, &table, &plain, &node2).await;
    let conflicts_before = conflicts(&plain).await + conflicts(&node2).await;

    let prober = Locker::connect(&urls[0])
        .await
        .unwrap()
        .table(&common::table_for("galera_probe"));
    prober.migrate().await.unwrap();

    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("history");
    let mut proxies = Vec::new();
    let mut children = Vec::new();
    for w in 0..6 {
        let node = w % 3;
        let proxy = Proxy::start(&hosts[node]).await;
        children.push(spawn(w, &proxy.url(&urls[node]), &table, &log));
        proxies.push((node, proxy));
    }
    let holder_proxy = Proxy::start(&hosts[KILLED]).await;
    let holder = Locker::connect(&holder_proxy.url(&urls[KILLED]))
        .await
        .unwrap()
        .table(&table);
    let (stop_probe, stop) = tokio::sync::watch::channel(false);
    let probing = probe(prober, stop);

    tokio::time::sleep(FAULT_AT - Duration::from_millis(500)).await;
    let survivor = take_survivor(&holder, &observer).await;
    let killed_at_us = now_us();
    let killed_at = Instant::now();
    ctl(&["kill-node", "3"]).await;
    // The cluster notices (polled on a task of its own: a query may wait out the stall)...
    let plain_ = plain.clone();
    let eviction = tokio::spawn(async move {
        while killed_at.elapsed() < Duration::from_secs(60) {
            if cluster_size(&plain_).await.is_ok_and(|s| s == "2") {
                return Some(killed_at.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    });
    // ... and a load balancer re-points the dead node's clients to the others.
    tokio::time::sleep(REPOINT_AFTER).await;
    let mut survivors = [0, 1].into_iter().cycle();
    let mut repointed = 0;
    for (node, proxy) in &proxies {
        if *node == KILLED {
            proxy.set_target(&hosts[survivors.next().unwrap()]);
            proxy.reset_all();
            repointed += 1;
        }
    }
    holder_proxy.set_target(&hosts[0]);
    holder_proxy.reset_all();
    let evicted = eviction.await.unwrap();
    let evicted = evicted.expect("node 3 was never evicted");

    let survivor_release = check_survivor(name, survivor, &observer).await;

    let (tally, starts, figures) = finish(name, children, &log, &observer, &[]).await;
    stop_probe.send_replace(true);
    let probe_grants = probing.await.unwrap();
    assert_eq!(cluster_size(&plain).await.unwrap(), "2");
    let conflicts_seen = conflicts(&plain).await + conflicts(&node2).await - conflicts_before;
    report(
        name,
        &tally,
        &figures,
        &[
            format!(
                "faults: kill -9 of node 3's mariadbd {} into the run; {repointed} worker \
                 proxies (and the holder's) re-pointed {} later",
                ms(FAULT_AT),
                ms(REPOINT_AFTER)
            ),
            format!(
                "node 3 evicted (cluster size 2 on node 1) {} after the kill",
                ms(evicted)
            ),
            format!(
                "longest time without a grant, 1 s before to 20 s after the kill: {} for a \
                 client of node 1, {} for the workers",
                gap(probe_grants, killed_at_us),
                gap(starts, killed_at_us)
            ),
            format!(
                "lock held on node 3 across the kill: same owner and token on node 1; its \
                 release: {survivor_release}"
            ),
            format!(
                "Galera conflicts on nodes 1 and 2 (wsrep_local_cert_failures + \
                 wsrep_local_bf_aborts), each a statement rolled back and retried: \
                 {conflicts_seen}"
            ),
            "lock sessions: wsrep_retry_autocommit=0, wsrep_sync_wait=1 (the parent's and \
             every worker's, after the kill)"
                .to_owned(),
            across_nodes,
        ],
    );
}

/// `lock_in` on Galera, across nodes: InnoDB's row lock is the node's own, so another node's
/// `lock_in` or lease of the same key does not wait for it: exclusion comes at commit, where
/// Galera certifies one of two conflicting transactions and rolls back the other (error 1213).
/// Required: of two `lock_in` transactions of one key on two nodes, at most one commits; a
/// lease taken on another node while a `lock_in` transaction is open means that transaction
/// does not commit; the committed row is the one that committed. What each call answered is
/// reported (docs/transactions.md says what it means for a user).
#[cfg(all(feature = "mysql", feature = "_test-util"))]
async fn lock_in_across_nodes(
    urls: &[String],
    table: &str,
    node1: &sqlx::MySqlPool,
    node2: &sqlx::MySqlPool,
) -> String {
    let l1 = Locker::connect(&urls[0]).await.unwrap().table(table);
    let l2 = Locker::connect(&urls[1]).await.unwrap().table(table);
    // Two transactions, one a node, on one key.
    let mut tx1 = node1.begin().await.unwrap();
    let mut tx2 = node2.begin().await.unwrap();
    let first = l1.lock_in(&mut *tx1, "galera:in").await;
    let second = l2.lock_in(&mut *tx2, "galera:in").await;
    let c1 = tx1.commit().await;
    let c2 = tx2.commit().await;
    let held = [
        first.as_ref().ok().filter(|_| c1.is_ok()),
        second.as_ref().ok().filter(|_| c2.is_ok()),
    ];
    let committed: Vec<&dblock::TxLock> = held.into_iter().flatten().collect();
    assert!(
        committed.len() <= 1,
        "two lock_in transactions of one key committed on two nodes: {first:?} {second:?}"
    );
    if let [winner] = committed[..] {
        let row = l1.inspect("galera:in").await.unwrap().unwrap();
        assert_eq!(row.fencing_token, winner.fencing_token(), "{row:?}");
    }
    let pair = format!(
        "lock_in on node 1 then node 2, one key: {} / {}; commits {} / {}",
        answer(&first),
        answer(&second),
        committed_or(&c1),
        committed_or(&c2)
    );

    // A lock_in transaction open on node 1, a lease of the same key on node 2.
    let mut tx1 = node1.begin().await.unwrap();
    let held_in = l1.lock_in(&mut *tx1, "galera:lease").await;
    let lease = l2.lock("galera:lease").wait(Duration::from_secs(2)).await;
    let c1 = tx1.commit().await;
    if let (Ok(_), Ok(_), Ok(())) = (&held_in, &lease, &c1) {
        panic!("a lease on node 2 and a lock_in transaction on node 1 both held one key");
    }
    let beside = format!(
        "lock_in open on node 1, lease on node 2: {} / lease {}; lock_in's commit {}",
        answer(&held_in),
        match &lease {
            Ok(g) => format!("granted (token {})", g.fencing_token()),
            Err(e) => format!("{e}"),
        },
        committed_or(&c1)
    );
    if let Ok(g) = lease {
        g.release().await.unwrap();
    }
    format!("{pair}; {beside}")
}

#[cfg(all(feature = "mysql", feature = "_test-util"))]
fn answer(taken: &Result<dblock::TxLock, dblock::LockError>) -> String {
    match taken {
        Ok(lock) => format!("taken (token {})", lock.fencing_token()),
        Err(e) => format!("{e}"),
    }
}

#[cfg(all(feature = "mysql", feature = "_test-util"))]
fn committed_or(commit: &Result<(), sqlx::Error>) -> String {
    match commit {
        Ok(()) => "committed".to_owned(),
        Err(e) => format!("failed ({e})"),
    }
}

/// A node's certification failures plus brute-force aborts since it started: statements rolled
/// back by Galera (error 1213 to the client, which dblock retries).
#[cfg(all(feature = "mysql", feature = "_test-util"))]
async fn conflicts(node: &sqlx::MySqlPool) -> u64 {
    let values: Vec<String> = sqlx::query_scalar(
        "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS \
         WHERE VARIABLE_NAME IN ('WSREP_LOCAL_CERT_FAILURES', 'WSREP_LOCAL_BF_ABORTS')",
    )
    .fetch_all(node)
    .await
    .unwrap();
    values.iter().map(|v| v.parse::<u64>().unwrap()).sum()
}

/// Galera's `wsrep_cluster_size` as one node sees it.
#[cfg(all(feature = "mysql", feature = "_test-util"))]
async fn cluster_size(node: &sqlx::MySqlPool) -> Result<String, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS \
         WHERE VARIABLE_NAME = 'WSREP_CLUSTER_SIZE'",
    )
    .fetch_one(node)
    .await
}

/// The holds the workers were told they released (`REL … ok`, the last release of the tenure)
/// that the promoted standby, just after its promotion, still shows held: releases the primary
/// acknowledged and lost (lazily durable). `(key, token)` of each: such a row stays held until its
/// lease ends, which the orphan check allows.
#[cfg(feature = "postgres")]
async fn releases_lost(url: &str, table: &str, log: &Path) -> Vec<(String, u64)> {
    let pool = sqlx::PgPool::connect(url)
        .await
        .expect("the promoted standby");
    let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT lock_key, fencing_token FROM \"{table}\" WHERE owner IS NOT NULL"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    pool.close().await;
    let history = std::fs::read_to_string(log).unwrap();
    let released: std::collections::HashSet<(&str, &str)> = history
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(1) == Some(&"REL") && f[4] == "ok" && f[6] == "1").then_some((f[2], f[3]))
        })
        .collect();
    rows.into_iter()
        .filter(|(key, token)| released.contains(&(key.as_str(), token.to_string().as_str())))
        .map(|(key, token)| (key, token as u64))
        .collect()
}

#[cfg(not(feature = "postgres"))]
#[test]
#[ignore = "the PostgreSQL promotion run needs `--features postgres` (or --all-features)"]
fn promotion_needs_the_postgres_feature() {}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_standby_promoted_mid_run() {
    use sqlx::PgPool;

    let _one_at_a_time = SERIAL.lock().await;
    let Some(primary_url) = setup_url("DBLOCK_PG_PRIMARY_URL", "PostgreSQL promotion") else {
        return;
    };
    let standby_url =
        std::env::var("DBLOCK_PG_STANDBY_URL").expect("DBLOCK_PG_STANDBY_URL with the primary's");
    let name = "postgres-promotion";
    let (primary_host, standby_host) =
        (common::host_of(&primary_url), common::host_of(&standby_url));

    // As the script left it: a primary whose standby replicates synchronously.
    let plain = PgPool::connect(&primary_url).await.expect("the primary");
    let sync: Option<String> = sqlx::query_scalar(
        "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'standby1'",
    )
    .fetch_optional(&plain)
    .await
    .unwrap();
    assert_eq!(
        sync.as_deref(),
        Some("sync"),
        "a synchronous standby (each `scripts/replicated.sh up` allows one run)"
    );
    plain.close().await;

    let observer = Locker::connect(&primary_url)
        .await
        .unwrap()
        .table(&common::table_for("promotion"));
    observer.migrate().await.unwrap();
    let table = observer.table_name().to_owned();
    let prober_table = common::table_for("promotion_probe");
    Locker::connect(&primary_url)
        .await
        .unwrap()
        .table(&prober_table)
        .migrate()
        .await
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("history");
    let mut proxies = Vec::new();
    let mut children = Vec::new();
    for w in 0..4 {
        let proxy = Proxy::start(&primary_host).await;
        children.push(spawn(w, &proxy.url(&primary_url), &table, &log));
        proxies.push(proxy);
    }
    let holder_proxy = Proxy::start(&primary_host).await;
    let holder = Locker::connect(&holder_proxy.url(&primary_url))
        .await
        .unwrap()
        .table(&table);

    tokio::time::sleep(FAULT_AT - Duration::from_millis(500)).await;
    let survivor = take_survivor(&holder, &observer).await;
    // The fault begins with the walsender's stop; the primary's follows WALSENDER_STALL later.
    let stopped_at_us = now_us();
    let stopped_at = Instant::now();
    let figures = ctl(&["failover", WALSENDER_STALL]).await;
    // Before any client reaches it (the proxies still point at the dead primary).
    let releases_lost = releases_lost(&standby_url, &table, &log).await;
    // The load balancer follows the promotion.
    for proxy in proxies.iter().chain([&holder_proxy]) {
        proxy.set_target(&standby_host);
        proxy.reset_all();
    }
    let repointed_after = stopped_at.elapsed();
    // The first grant on the promoted standby, by a fresh client.
    let promoted = loop {
        match Locker::connect(&standby_url).await {
            Ok(l) => break l,
            Err(e) => {
                assert!(stopped_at.elapsed() < Duration::from_secs(30), "{e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let first_grant = loop {
        match promoted
            .table(&prober_table)
            .lock("probe")
            .wait(Duration::from_secs(5))
            .await
        {
            Ok(g) => {
                let took = stopped_at.elapsed();
                g.release().await.unwrap();
                break took;
            }
            Err(e) => {
                assert!(stopped_at.elapsed() < Duration::from_secs(30), "{e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let observer = promoted.table(&table);
    let survivor_release = check_survivor(name, survivor, &observer).await;

    let (tally, starts, checked) = finish(name, children, &log, &observer, &releases_lost).await;
    let get = |k: &str| figures.get(k).map_or("?", String::as_str).to_owned();
    report(
        name,
        &tally,
        &checked,
        &[
            format!(
                "faults: walsender stopped (SIGSTOP) {} into the run; {WALSENDER_STALL} s later \
                 the primary stopped (pg_ctl -m immediate), which took {} ms; standby promoted \
                 (pg_ctl promote -w) in {} ms; 5 proxies re-pointed {} after the walsender stop",
                ms(FAULT_AT),
                get("stop_ms"),
                get("promote_ms"),
                ms(repointed_after)
            ),
            format!(
                "first grant on the promoted standby (a fresh client): {} after the walsender \
                 stop",
                ms(first_grant)
            ),
            format!(
                "longest time without a grant for the workers, 1 s before to 20 s after the \
                 walsender stop: {}",
                gap(starts, stopped_at_us)
            ),
            format!(
                "lock held across the promotion: same owner and token on the promoted standby; \
                 its release: {survivor_release}"
            ),
            format!(
                "acknowledged releases the promoted standby did not have (lazily durable; the \
                 key stays held until its lease ends): {}",
                releases_lost.len()
            ),
        ],
    );
}

/// Asynchronous replication and a failover that loses the primary's last commits: the promoted
/// standby has the key's row as it was before them, and its next grant's fencing token is still
/// above every token those lost commits handed out (a new tenure's token is never below the
/// database clock in µs). The lost grants themselves are what synchronous replication prevents
/// (their owners and the next one overlap); their tokens are never issued again, so a resource
/// that checks tokens refuses the stale owners. A pair of its own (`up postgres`), and a fresh
/// one left for the next run.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_asynchronous_failover_never_reissues_a_token() {
    use sqlx::PgPool;

    let _one_at_a_time = SERIAL.lock().await;
    let Some(_) = setup_url("DBLOCK_PG_PRIMARY_URL", "PostgreSQL asynchronous failover") else {
        return;
    };
    ctl(&["up", "postgres"]).await;
    let primary_url = std::env::var("DBLOCK_PG_PRIMARY_URL").unwrap();
    let standby_url = std::env::var("DBLOCK_PG_STANDBY_URL").unwrap();

    // Asynchronous: the primary's commits stop waiting for the standby.
    let plain = PgPool::connect(&primary_url).await.expect("the primary");
    for sql in [
        "ALTER SYSTEM SET synchronous_standby_names = ''",
        "SELECT pg_reload_conf()",
    ] {
        sqlx::raw_sql(sql).execute(&plain).await.unwrap();
    }
    retry("the standby replicating asynchronously", || async {
        let state: Option<String> = sqlx::query_scalar(
            "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'standby1'",
        )
        .fetch_optional(&plain)
        .await
        .map_err(|e| e.to_string())?;
        match state.as_deref() {
            Some("async") => Ok(()),
            other => Err(format!("sync_state {other:?}")),
        }
    })
    .await;

    let table = common::table_for("async_failover");
    let options = dblock::ConnectOptions::new().listen(false);
    let on_primary = Locker::connect_with(&primary_url, options.clone())
        .await
        .unwrap()
        .table(&table);
    on_primary.migrate().await.unwrap();
    // One tenure the standby has, released (read there until it shows).
    let kept = {
        let g = on_primary
            .lock("k")
            .ttl(Duration::from_secs(1))
            .await
            .unwrap();
        let token = g.fencing_token();
        g.release().await.unwrap();
        token
    };
    let standby = PgPool::connect(&standby_url).await.expect("the standby");
    let on_standby =
        format!("SELECT fencing_token FROM {table} WHERE lock_key = 'k' AND owner IS NULL");
    retry("the standby has the first tenure, released", || async {
        let token: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(on_standby.clone()))
            .fetch_optional(&standby)
            .await
            .map_err(|e| e.to_string())?;
        match token {
            Some(t) if t as u64 == kept => Ok(()),
            other => Err(format!("token {other:?}")),
        }
    })
    .await;
    standby.close().await;

    // The walsender stops at once, the primary 2 s later: what commits meanwhile is the
    // primary's alone.
    let failover = tokio::spawn(ctl(&["failover", "2"]));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut issued = Vec::new();
    let until = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < until {
        let g = on_primary
            .lock("k")
            .ttl(Duration::from_secs(1))
            .await
            .unwrap_or_else(|e| panic!("a grant on the primary before its stop: {e}"));
        issued.push(g.fencing_token());
        g.release().await.unwrap();
    }
    plain.close().await;
    drop(on_primary);
    let figures = failover.await.unwrap();
    let last_issued = *issued.iter().max().expect("grants before the stop");

    let promoted = Locker::connect_with(&standby_url, options)
        .await
        .unwrap()
        .table(&table);
    let row = promoted.inspect("k").await.unwrap().expect("the key's row");
    // The premise: the failover lost tenures (else this run proves nothing).
    assert!(
        row.fencing_token < last_issued,
        "no tenure lost: the promoted standby has token {}, the primary issued up to {last_issued}",
        row.fencing_token
    );
    let lost = issued.iter().filter(|t| **t > row.fencing_token).count();
    // A grant whose release the standby never had holds the key until its 1 s lease ends.
    let guard = promoted
        .lock("k")
        .wait(Duration::from_secs(10))
        .await
        .unwrap();
    let next = guard.fencing_token();
    assert!(
        next > last_issued,
        "token {next} issued again after the failover: the primary had issued up to {last_issued}"
    );
    guard.release().await.unwrap();
    common::shout(&format!(
        "postgres-async-failover: {} tenures on the primary during the walsender stall, {lost} \
         of them lost with it (the promoted standby has token {}, the primary issued up to \
         {last_issued}); the next grant's token {next} is above all (stop {} ms, promote {} ms)",
        issued.len(),
        row.fencing_token,
        figures.get("stop_ms").map_or("?", String::as_str),
        figures.get("promote_ms").map_or("?", String::as_str),
    ));
    // A fresh synchronous pair for whatever runs next.
    ctl(&["up", "postgres"]).await;
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL under Patroni behind HAProxy (`scripts/patroni.sh`).

/// The Patroni run's workload: as long as its faults take (the parent ends it with a stop file;
/// `run` is only a bound), with long leases longer than that.
const PATRONI_WORKLOAD: Workload = Workload {
    run: Duration::from_secs(240),
    ttl: Duration::from_secs(3),
    keys: 3,
    long_ttl: Duration::from_secs(300),
    long_keys: 2,
    linger: Duration::from_secs(4),
};
/// Quiet time before the first fault and after each recovery.
#[cfg(feature = "postgres")]
const PATRONI_SETTLE: Duration = Duration::from_secs(4);

/// The worker of the Patroni runs (child processes only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "worker entry point, started by the Patroni chaos runs"]
async fn patroni_worker() {
    history::worker(&PATRONI_WORKLOAD).await;
}

#[cfg(not(feature = "postgres"))]
#[test]
#[ignore = "the Patroni run needs `--features postgres` (or --all-features)"]
fn patroni_needs_the_postgres_feature() {}

/// `scripts/patroni.sh <args>`: its `name=value` lines.
#[cfg(feature = "postgres")]
async fn patroni(args: &[&str]) -> HashMap<String, String> {
    run_script("DBLOCK_PATRONI_CTL", "patroni.sh", args).await
}

/// One fault of the run and what it showed.
#[cfg(feature = "postgres")]
struct Event {
    name: &'static str,
    /// When it began and when the script saw a new leader writable behind HAProxy (µs).
    at: i64,
    recovered: i64,
    figures: HashMap<String, String>,
}

/// The chaos checker through HAProxy while Patroni's leader changes three ways: a planned
/// switchover (`patronictl switchover`), the leader's Patroni and PostgreSQL killed (SIGKILL),
/// and the leader's network cut (its link down, packets dropped) until another node leads and
/// it has demoted itself. Four worker processes lock and release through HAProxy's one URL the
/// whole time and are never restarted: dblock must follow each new leader by itself (a
/// connection left on the old one fails with an I/O error or, once it is a standby, 25006, and
/// is replaced). A prober measures the time without a grant after each event.
///
/// With `DBLOCK_PATRONI_MODE=sync` (`synchronous_mode: true`): no overlapping hold and no
/// fencing regression across every event (`history::check`), and no orphan but acknowledged
/// lazily durable releases that a fault lost (their keys stay held until their leases end).
/// With `async` the same is measured and reported, not required: a failover may lose
/// acknowledged grants, as docs/production.md says for an asynchronous standby.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patroni_failover() {
    let _one_at_a_time = SERIAL.lock().await;
    let Some(url) = setup_url("DBLOCK_PATRONI_URL", "Patroni failover") else {
        return;
    };
    let mode = std::env::var("DBLOCK_PATRONI_MODE").unwrap_or_else(|_| "sync".into());
    let sync = mode == "sync";
    let name = if sync {
        "patroni-synchronous"
    } else {
        "patroni-asynchronous"
    };
    let connect = || async { retry("connect through HAProxy", || Locker::connect(&url)).await };
    let observer = connect().await.table(&common::table_for("patroni"));
    retry("migrate", || observer.migrate()).await;
    let table = observer.table_name().to_owned();
    let prober = connect().await.table(&common::table_for("patroni_probe"));
    retry("migrate the probe table", || prober.migrate()).await;

    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("history");
    let stop_file = dir.path().join("stop");
    let children: Vec<Child> = (0..4)
        .map(|w| {
            history::worker_command("patroni_worker", &url, &table, &log, w % 2 == 1)
                .env("DBLOCK_CHAOS_STOP_FILE", &stop_file)
                .spawn()
                .unwrap()
        })
        .collect();
    let (stop_probe, stopped) = tokio::sync::watch::channel(false);
    let probe = probe(prober.clone(), stopped);

    let mut events = Vec::new();
    for (event, args) in [
        ("switchover", &["switchover"][..]),
        ("leader killed (SIGKILL)", &["kill-leader"][..]),
        ("leader's network cut", &["cut-leader"][..]),
    ] {
        tokio::time::sleep(PATRONI_SETTLE).await;
        let at = now_us();
        let figures = patroni(args).await;
        let recovered = now_us();
        // The old leader comes back as a replica, so the next event has a cluster of three.
        let old = figures.get("old_leader").cloned().unwrap_or_default();
        match event {
            "leader killed (SIGKILL)" => {
                patroni(&["start-node", &old]).await;
            }
            "leader's network cut" => {
                patroni(&["heal", &old]).await;
            }
            _ => {}
        }
        patroni(&["wait-replicas"]).await;
        events.push(Event {
            name: event,
            at,
            recovered,
            figures,
        });
    }
    tokio::time::sleep(PATRONI_SETTLE).await;
    std::fs::write(&stop_file, b"").unwrap();
    stop_probe.send(true).unwrap();
    let grants = probe.await.unwrap();

    let statuses = history::wait_all(children).await;
    let text = std::fs::read_to_string(&log).unwrap();
    let (holds, _) = parse(&text);
    history::assert_no_untyped_errors(name, &text);
    for (i, status) in statuses.iter().enumerate() {
        assert!(status.success(), "{name}: worker {i} failed: {status}");
    }
    // Acknowledged releases whose rows are still held: lost by a fault (lazily durable
    // releases commit without waiting for a standby), if released between a second before
    // the fault and the new leader.
    let held = retry("read the held rows", || observer.held()).await;
    let released_ok: Vec<(String, u64, i64)> = text
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(1) == Some(&"REL") && f[4] == "ok" && f[6] == "1").then(|| {
                (
                    f[2].to_owned(),
                    f[3].parse().unwrap(),
                    f[5].parse().unwrap(),
                )
            })
        })
        .collect();
    let in_a_fault = |t: i64| {
        events
            .iter()
            .any(|e| t >= e.at - 1_000_000 && t <= e.recovered + 1_000_000)
    };
    let lost: Vec<(String, u64)> = held
        .iter()
        .filter(|i| {
            released_ok
                .iter()
                .any(|(k, tok, t)| *k == i.key && *tok == i.fencing_token && in_a_fault(*t))
        })
        .map(|i| (i.key.clone(), i.fencing_token))
        .collect();
    let (overlaps, regressions) = history::violations(&holds);
    let checked = if sync {
        history::check_no_orphans(name, &text, &holds, &observer, &lost).await;
        history::check(name, &holds, &text)
    } else {
        // Not checked (asynchronous replication promises nothing across a failover):
        // `report` says so, and the violations counted are in the lines.
        history::Figures::default()
    };
    let tally = history::tally(&text);
    assert!(
        !tally.lock_errors.keys().any(|k| k.contains("25006")),
        "{name}: a read-only error reached a caller: {:?}",
        tally.lock_errors
    );

    let mut lines = vec![format!(
        "synchronous_mode: {sync}; 4 worker processes through HAProxy, never restarted; \
         overlapping tenures: {overlaps}, fencing regressions: {regressions}{}",
        if sync {
            " (required: 0)"
        } else {
            " (measured)"
        }
    )];
    for e in &events {
        let get = |k: &str| e.figures.get(k).map_or("?", String::as_str).to_owned();
        let mut line = format!(
            "{}: new leader n{} after {} ms, writable behind HAProxy after {} ms",
            e.name,
            get("new_leader"),
            get("new_leader_ms"),
            get("haproxy_writable_ms")
        );
        if let Some(d) = e.figures.get("demoted_ms") {
            line += &format!(", old leader demoted after {d} ms");
        }
        let gap_after = longest_gap(
            grants
                .iter()
                .copied()
                .filter(|&g| g <= e.recovered + 20_000_000)
                .collect(),
            e.at,
        );
        line += &match gap_after {
            Some((gap, from)) => format!(
                "; longest time without a grant (prober): {} ms, from {from:+} ms",
                gap.as_millis()
            ),
            None => "; no grant around it".to_owned(),
        };
        lines.push(line);
        assert!(
            grants.iter().any(|&g| g > e.recovered),
            "{name}: no grant after the {} recovered",
            e.name
        );
    }
    lines.push(format!(
        "acknowledged releases lost by a fault (keys held until their leases end): {}",
        lost.len()
    ));
    report(name, &tally, &checked, &lines);
}

/// The node of `scripts/patroni.sh` whose PostgreSQL runs under libfaketime.
#[cfg(feature = "postgres")]
const CLOCK_NODE: &str = "3";

/// Sets node 3's clock back to the real time when dropped, a failed assertion included: a
/// leader whose clock is ahead would end every lease the next run takes.
#[cfg(feature = "postgres")]
struct ClockBack;

#[cfg(feature = "postgres")]
impl Drop for ClockBack {
    fn drop(&mut self) {
        // Never a panic here (it may run while a failed assertion unwinds): said, not asserted.
        let script = script_path("DBLOCK_PATRONI_CTL", "patroni.sh");
        match Command::new("bash")
            .arg(&script)
            .args(["clock", CLOCK_NODE, "+0"])
            .stdout(Stdio::null())
            .status()
        {
            Ok(s) if s.success() => {}
            other => common::shout(&format!("{script} clock {CLOCK_NODE} +0: {other:?}")),
        }
    }
}

/// The fence and an INSERT of (token, who) into `writes` in one transaction, committed only if
/// the fence held.
#[cfg(feature = "postgres")]
async fn fenced_write(
    pool: &sqlx::PgPool,
    writes: &str,
    guard: &LockGuard,
    who: &str,
) -> Result<(), dblock::LockError> {
    use dblock::LockError;
    let mut tx = pool.begin().await.map_err(LockError::Database)?;
    guard.fence(&mut *tx).await?;
    // The table name is the test's own (`common::table_for`), not input.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {writes} (token, who) VALUES ($1, $2)"
    )))
    .bind(guard.fencing_token() as i64)
    .bind(who)
    .execute(&mut *tx)
    .await
    .map_err(LockError::Database)?;
    tx.commit().await.map_err(LockError::Database)
}

/// A pool through HAProxy, made now (no connection of it reached a former leader).
#[cfg(feature = "postgres")]
async fn app_pool(url: &str) -> sqlx::PgPool {
    retry("connect the application pool", || async {
        sqlx::PgPool::connect(url)
            .await
            .map_err(dblock::LockError::Database)
    })
    .await
}

/// From now on, a fresh connection through HAProxy every 20 ms: when (µs since the epoch) the
/// first attempt that reached a writable server other than the one first reached began (the
/// early end of when it became writable to clients), and that server's clock's offset from ours
/// (ms, at the middle of the attempt).
#[cfg(feature = "postgres")]
fn first_new_writable(url: &str) -> tokio::task::JoinHandle<(i64, i64)> {
    use sqlx::Connection;
    let url = url.to_owned();
    tokio::spawn(async move {
        let mut first: Option<String> = None;
        loop {
            let sent = now_us();
            let answer = async {
                let mut conn = sqlx::PgConnection::connect(&url).await?;
                sqlx::query_as::<_, (String, bool, i64)>(
                    "SELECT host(inet_server_addr()), pg_is_in_recovery(), \
                     (extract(epoch FROM clock_timestamp()) * 1000000)::int8",
                )
                .fetch_one(&mut conn)
                .await
            };
            if let Ok(Ok((server, recovering, clock_us))) =
                tokio::time::timeout(Duration::from_secs(1), answer).await
            {
                let at = now_us();
                match &first {
                    None => first = Some(server),
                    Some(old) if *old != server && !recovering => {
                        return (sent, (clock_us - (sent + at) / 2) / 1000);
                    }
                    Some(_) => {}
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
}

/// A Patroni switchover to a node whose clock is ahead (`scripts/patroni.sh clock 3 +60s`, then
/// `switchover-to 3`): every lease ends at once on the new leader, as on a single server whose
/// clock steps forward (tests/clock_steps.rs). A holder through HAProxy with a 6 s ttl, renewed
/// every 2 s, must learn `Lost` at its next renewal once the new leader is writable (within a
/// renewal period and a margin for the statement), its fenced writes must be refused there,
/// another owner must take the key at once with a higher fencing token, and the fenced writes
/// must commit in token order. Then node 3's clock goes back and it hands the leadership on.
///
/// `DBLOCK_PATRONI_CLOCK_STEP` (seconds, default 60) changes the step: with 0 the holder keeps
/// its key across the switchover and this test fails, as it must.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patroni_failover_to_a_clock_ahead() {
    use dblock::{LockError, Owner};
    use std::sync::Arc;

    let _one_at_a_time = SERIAL.lock().await;
    let Some(url) = setup_url("DBLOCK_PATRONI_URL", "Patroni clock-ahead failover") else {
        return;
    };
    let step: i64 = std::env::var("DBLOCK_PATRONI_CLOCK_STEP")
        .ok()
        .map_or(60, |s| {
            s.parse().expect("DBLOCK_PATRONI_CLOCK_STEP: seconds")
        });
    let name = "patroni-clock-ahead";
    let ttl = Duration::from_secs(6);

    // Node 3 a replica: the switchover is to it.
    let leader = tokio::task::spawn_blocking(|| {
        run_script_blocking("DBLOCK_PATRONI_CTL", "patroni.sh", &["leader".to_owned()])
    })
    .await
    .unwrap();
    if leader.trim() == CLOCK_NODE {
        // (In synchronous mode a switchover needs the synchronous standby in place.)
        patroni(&["wait-replicas"]).await;
        patroni(&["switchover"]).await;
        patroni(&["wait-replicas"]).await;
    }
    let clock_back = ClockBack;

    let connect = || async { retry("connect through HAProxy", || Locker::connect(&url)).await };
    let holder = connect().await.table(&common::table_for("patroni_clock"));
    retry("migrate", || holder.migrate()).await;
    let table = holder.table_name().to_owned();
    let writes = common::table_for("patroni_clock_writes");
    let app = app_pool(&url).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {writes} (id bigserial PRIMARY KEY, token bigint NOT NULL, who text NOT NULL)"
    )))
    .execute(&app)
    .await
    .expect("the table of fenced writes");

    let old = holder.lock("k").ttl(ttl).await.expect("lock").auto_renew();
    fenced_write(&app, &writes, &old, "old, before the switchover")
        .await
        .expect("a fenced write of the holder");
    app.close().await;
    let old = Arc::new(old);
    let lost = tokio::spawn({
        let old = old.clone();
        async move {
            let e = old.lost().await;
            (e, now_us())
        }
    });

    patroni(&["clock", CLOCK_NODE, &format!("{step:+}s")]).await;
    let writable = first_new_writable(&url);
    let figures = patroni(&["switchover-to", CLOCK_NODE]).await;
    let get = |k: &str| -> i64 {
        figures
            .get(k)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("switchover-to said no {k}: {figures:?}"))
    };
    let switchover_at_ms = get("switchover_at_ms");
    // The new leader writable behind HAProxy, as a client first sees it (the script's
    // `haproxy_writable_ms` comes after several checks in a row), and its clock stepped.
    let (writable_at_us, skew_ms) = tokio::time::timeout(Duration::from_secs(10), writable)
        .await
        .expect("no new writable leader seen through HAProxy")
        .unwrap();
    let writable_at_ms = writable_at_us / 1000;
    assert!(
        (skew_ms - step * 1000).abs() < 2000,
        "{name}: the new leader's clock is {skew_ms:+} ms off ours, not {step:+} s"
    );
    let lost = tokio::time::timeout(ttl, lost).await;
    let Ok(Ok((lost, lost_at_us))) = lost else {
        panic!(
            "{name}: the holder did not learn it lost the key within {ttl:?} of the new leader \
             writable (clock step {step:+} s; is_lost: {})",
            old.is_lost()
        );
    };
    assert!(matches!(lost, LockError::Lost { .. }), "{lost:?}");
    let lost_after_ms = lost_at_us / 1000 - writable_at_ms;
    // Held until the switchover began; learned at the next renewal on the new leader.
    assert!(
        lost_at_us / 1000 >= switchover_at_ms,
        "{name}: lost {} ms before the switchover began",
        switchover_at_ms - lost_at_us / 1000
    );
    assert!(
        lost_after_ms <= (ttl / 3 + Duration::from_millis(1500)).as_millis() as i64,
        "{name}: the holder learned it lost {lost_after_ms} ms after the new leader was writable"
    );

    // On the new leader: the old holder's fenced write refused, the key free at once.
    let app = app_pool(&url).await;
    let refused = fenced_write(&app, &writes, &old, "old, after the switchover").await;
    assert!(
        matches!(refused, Err(LockError::Lost { .. })),
        "{name}: the old holder's fenced write after the switchover: {refused:?}"
    );
    let other = connect().await.table(&table);
    let newer = other
        .lock("k")
        .owner(&Owner::new())
        .ttl(ttl)
        .await
        .expect("another owner takes the key at once");
    assert!(
        newer.fencing_token() > old.fencing_token(),
        "{name}: token {} after {}",
        newer.fencing_token(),
        old.fencing_token()
    );
    fenced_write(&app, &writes, &newer, "newer")
        .await
        .expect("the newer holder writes");
    let refused_again = fenced_write(&app, &writes, &old, "old, after the newer").await;
    assert!(
        matches!(refused_again, Err(LockError::Lost { .. })),
        "{refused_again:?}"
    );
    // The writes in commit order: tokens never go down; the old holder's one, then the newer's.
    let rows: Vec<(i64, i64, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id, token, who FROM {writes} ORDER BY id"
    )))
    .fetch_all(&app)
    .await
    .expect("read the writes");
    for pair in rows.windows(2) {
        assert!(
            pair[1].1 >= pair[0].1,
            "{name}: a write under an older token after a newer one: {pair:?}"
        );
    }
    let who: Vec<&str> = rows.iter().map(|r| r.2.as_str()).collect();
    assert_eq!(who, ["old, before the switchover", "newer"], "{rows:?}");
    let tokens = (old.fencing_token(), newer.fencing_token());
    newer.release().await.expect("release");
    drop(old);
    app.close().await;

    let at = |k: &str| figures.get(k).map_or("?", String::as_str).to_owned();
    common::shout(&format!(
        "FIGURES {name}\n  node {CLOCK_NODE}'s clock {step:+} s, switchover n{} -> n{}: new \
         leader after {} ms, writable behind HAProxy after {} ms (first seen after {} ms, its \
         clock {skew_ms:+} ms off ours; n{CLOCK_NODE} ready as the candidate in {} ms)\n  \
         holder (ttl {} ms, renewed every {} ms): lost() {lost_after_ms:+} \
         ms after the new leader was writable, {} ms after the switchover began\n  fencing \
         tokens: old {}, newer {} (taken at once); the old holder's fenced writes refused: 2; \
         fenced writes committed in token order: {}",
        at("old_leader"),
        at("new_leader"),
        at("new_leader_ms"),
        at("haproxy_writable_ms"),
        writable_at_ms - switchover_at_ms,
        at("candidate_ready_ms"),
        ttl.as_millis(),
        (ttl / 3).as_millis(),
        lost_at_us / 1000 - switchover_at_ms,
        tokens.0,
        tokens.1,
        rows.len(),
    ));

    // The clock back, then the leadership away from node 3, for whatever runs next.
    drop(clock_back);
    patroni(&["wait-replicas"]).await;
    let back = patroni(&["switchover"]).await;
    patroni(&["wait-replicas"]).await;
    common::shout(&format!(
        "{name}: n{CLOCK_NODE}'s clock back at +0, leader n{} after a switchover ({} ms)",
        back.get("new_leader").map_or("?", String::as_str),
        back.get("haproxy_writable_ms").map_or("?", String::as_str),
    ));
}

/// The fenced-write workers of the replicated runs (`common::fenced`): 3 processes.
#[cfg(any(feature = "postgres", all(feature = "mysql", feature = "_test-util")))]
const FENCED_WORKERS: usize = 3;

/// The fenced-write worker's plan on a replicated set-up: the ttl of the lease-only runs
/// (shorter than Galera's stall and Patroni's failover, so leases run out in them), `run` only a
/// bound (the parent ends it with a stop file), and on Galera a `seq` column for commit order.
#[cfg(any(feature = "postgres", all(feature = "mysql", feature = "_test-util")))]
fn fenced_plan(seq: bool) -> common::fenced::Plan {
    common::fenced::Plan {
        run: Duration::from_secs(120),
        ttl: WORKLOAD.ttl,
        linger: WORKLOAD.linger,
        lock_in: true,
        seq,
    }
}

/// The Patroni fenced-write worker (child processes only).
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "worker entry point, started by the Patroni fenced-write run"]
async fn patroni_fenced_worker() {
    common::fenced::fenced_worker(&fenced_plan(false)).await;
}

/// The Galera fenced-write worker (child processes only).
#[cfg(all(feature = "mysql", feature = "_test-util"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "worker entry point, started by the Galera fenced-write run"]
async fn galera_fenced_worker() {
    common::fenced::fenced_worker(&fenced_plan(true)).await;
}

/// What a fenced-write run committed and its workers said; asserts every worker exited.
#[cfg(any(feature = "postgres", all(feature = "mysql", feature = "_test-util")))]
async fn fenced_finish(
    name: &str,
    children: Vec<Child>,
    log: &Path,
) -> (String, common::fenced::Tally) {
    let statuses = history::wait_all(children).await;
    let text = std::fs::read_to_string(log).unwrap();
    history::assert_no_untyped_errors(name, &text);
    for (i, status) in statuses.iter().enumerate() {
        assert!(
            status.success(),
            "{name}: fenced worker {i} failed: {status}"
        );
    }
    let tally = common::fenced::tally(&text);
    assert_eq!(tally.exits, FENCED_WORKERS, "{name}");
    (text, tally)
}

/// The fenced writes' figures, and the checks every set-up requires: more than 10 writes
/// committed, a steal. Returns how many were out of order.
#[cfg(any(feature = "postgres", all(feature = "mysql", feature = "_test-util")))]
fn fenced_report(
    name: &str,
    faults: &str,
    tokens: &[i64],
    tally: &common::fenced::Tally,
    extra: &str,
) -> usize {
    let out_of_order = common::fenced::out_of_order(tokens);
    println!(
        "\n{name} fenced writes with steals: {faults}; {} steals; {} fenced writes committed; \
         fences refused (stolen or run out before the fence): {} of leases, {} of stealers; \
         out of order: {out_of_order}{extra}",
        tally.steals,
        tokens.len(),
        tally.refused_lease,
        tally.refused_steal,
    );
    assert!(
        tokens.len() > 10,
        "{name}: too few fenced writes: {tokens:?}"
    );
    assert!(tally.steals > 0, "{name}: no steal");
    out_of_order
}

/// The fenced-write run of `tests/chaos_kinds.rs` through Patroni's faults: 3 worker processes
/// through HAProxy take key `doc` by lease, by `steal` or with `lock_in`, each writing its
/// fencing token into an app table (`BIGSERIAL` key) in a transaction that fences it, through a
/// planned switchover and then the leader killed (SIGKILL), never restarted. A steal, or a lease
/// running out while the leader changes, lands between holders' grants and their commits.
///
/// With `DBLOCK_PATRONI_MODE=sync`, a committed transaction is on the synchronous standby before
/// its commit returns, and Patroni promotes only that standby: no committed grant, fence or write
/// is lost by either event, so the tokens in key order must strictly grow (the key is taken after
/// the fence or `lock_in`, which hold the lock's row until the commit; the sequence's values are
/// logged ahead, so a new leader only hands out higher ones). With `async` the order is measured
/// and reported, not required: a failover may lose committed grants, and with them hand out a
/// token again.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patroni_failover_fenced_writes_and_steals() {
    let _one_at_a_time = SERIAL.lock().await;
    let Some(url) = setup_url("DBLOCK_PATRONI_URL", "Patroni fenced-write") else {
        return;
    };
    let sync = std::env::var("DBLOCK_PATRONI_MODE").map_or(true, |m| m == "sync");
    let name = if sync {
        "patroni-synchronous"
    } else {
        "patroni-asynchronous"
    };
    let observer = retry("connect through HAProxy", || Locker::connect(&url))
        .await
        .table(&common::table_for("patroni_fenced"));
    retry("migrate", || observer.migrate()).await;
    let table = observer.table_name().to_owned();
    let app = common::fenced::App::connect(&url);
    let create =
        format!("CREATE TABLE {table}_w (id BIGSERIAL PRIMARY KEY, token BIGINT NOT NULL)");
    retry("create the app table", || async {
        app.execute(&create)
            .await
            .map_err(dblock::LockError::Database)
    })
    .await;

    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("history");
    let stop_file = dir.path().join("stop");
    let children: Vec<Child> = (0..FENCED_WORKERS)
        .map(|_| {
            history::worker_command("patroni_fenced_worker", &url, &table, &log, false)
                .env("DBLOCK_CHAOS_STOP_FILE", &stop_file)
                .spawn()
                .unwrap()
        })
        .collect();
    let started = Instant::now();
    let mut events = Vec::new();
    for (event, args) in [
        ("switchover", &["switchover"][..]),
        ("leader killed (SIGKILL)", &["kill-leader"][..]),
    ] {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let figures = patroni(args).await;
        if event == "leader killed (SIGKILL)" {
            let old = figures.get("old_leader").cloned().unwrap_or_default();
            patroni(&["start-node", &old]).await;
        }
        patroni(&["wait-replicas"]).await;
        let get = |k: &str| figures.get(k).map_or("?", String::as_str).to_owned();
        events.push(format!(
            "{event} (n{} to n{}, writable behind HAProxy after {} ms)",
            get("old_leader"),
            get("new_leader"),
            get("haproxy_writable_ms")
        ));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    std::fs::write(&stop_file, b"").unwrap();
    let (_, tally) = fenced_finish(name, children, &log).await;
    let select = format!("SELECT token FROM {table}_w ORDER BY id");
    let tokens = retry("read the fenced writes", || async {
        app.column(&select)
            .await
            .map_err(dblock::LockError::Database)
    })
    .await;
    let out_of_order = fenced_report(
        name,
        &format!(
            "{} in {} s: {}",
            events.len(),
            started.elapsed().as_secs(),
            events.join(", ")
        ),
        &tokens,
        &tally,
        if sync {
            " (required: 0)"
        } else {
            " (measured)"
        },
    );
    if sync {
        assert_eq!(
            out_of_order, 0,
            "{name}: a stale write committed: {tokens:?}"
        );
    }
}

/// The fenced-write run through a Galera node kill: 3 worker processes, one a node through
/// proxies of their own (as `galera_node_killed_mid_run` spreads its workers), take key `doc` by
/// lease, by `steal` or with `lock_in`, each writing its fencing token into an app table in a
/// transaction that fences it; mid-run node 3's mariadbd is killed (`kill -9`), the cluster
/// stalls until it is evicted (leases run out meanwhile), and its worker's proxy is re-pointed
/// to node 1.
///
/// The invariant: the committed writes' tokens grow in Galera's commit order. A row lock is the
/// node's own, so neither a fence nor a `lock_in` excludes anything on another node before the
/// commit: a lease taken or a key stolen on node 2 while a transaction holding it is open on
/// node 1 is granted (docs/transactions.md). But every such transaction writes the lock's row
/// (the fence is an `UPDATE` of it, `lock_in` writes the new tenure), as every grant and steal
/// does, so Galera certifies all of them on that one row: of two that overlap, the later to
/// certify is rolled back (1213 at its commit), and a transaction that commits saw every earlier
/// committed write of the row, its fence or `lock_in` then checking the newest tenure. So the
/// committed fenced writes are totally ordered by the lock row's versions, whose tokens only
/// grow; `lock_in` keeps its meaning across nodes here (its token is not unique before the
/// commit, but only a certified one commits), so it stays in. The table's auto-increment key is
/// not that order (each node hands out its own interleaved ids), so each write stores `seq`, one
/// more than the table's largest, in the same statement: by the same certification, two
/// committed writes never read the same largest, and `seq` numbers the commits (checked:
/// distinct). Ordered by `seq`, the tokens must strictly grow.
///
/// Leaves the cluster as it found it: node 3 started again and synced, for the next Galera run.
#[cfg(all(feature = "mysql", feature = "_test-util"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn galera_fenced_writes_through_a_node_kill() {
    use sqlx::MySqlPool;

    let _one_at_a_time = SERIAL.lock().await;
    let Some(urls) = setup_url("DBLOCK_GALERA_URLS", "MariaDB Galera fenced-write") else {
        return;
    };
    let name = "galera";
    let urls: Vec<String> = urls.split(',').map(str::to_owned).collect();
    assert_eq!(urls.len(), 3, "DBLOCK_GALERA_URLS: three node URLs");
    let hosts: Vec<String> = urls.iter().map(|u| common::host_of(u)).collect();
    const KILLED: usize = 2; // node 3
    let plain = MySqlPool::connect(&urls[0]).await.expect("node 1");
    if cluster_size(&plain).await.unwrap() != "3" {
        ctl(&["start-node", "3"]).await;
    }
    assert_eq!(cluster_size(&plain).await.unwrap(), "3");
    // Galera's conflict counters of the survivors: transactions certification rolled back.
    let node2 = MySqlPool::connect(&urls[1]).await.expect("node 2");
    let conflicts_before = conflicts(&plain).await + conflicts(&node2).await;

    let observer = Locker::connect(&urls[0])
        .await
        .unwrap()
        .table(&common::table_for("galera_fenced"));
    observer.migrate().await.unwrap();
    let table = observer.table_name().to_owned();
    let app = common::fenced::App::connect(&urls[0]);
    app.execute(&format!(
        "CREATE TABLE {table}_w (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
         token BIGINT NOT NULL, seq BIGINT NOT NULL)"
    ))
    .await
    .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("history");
    let stop_file = dir.path().join("stop");
    let mut proxies = Vec::new();
    let mut children = Vec::new();
    for node in 0..FENCED_WORKERS {
        let proxy = Proxy::start(&hosts[node]).await;
        children.push(
            history::worker_command(
                "galera_fenced_worker",
                &proxy.url(&urls[node]),
                &table,
                &log,
                false,
            )
            .env("DBLOCK_CHAOS_STOP_FILE", &stop_file)
            .spawn()
            .unwrap(),
        );
        proxies.push((node, proxy));
    }
    tokio::time::sleep(FAULT_AT).await;
    let killed_at = Instant::now();
    ctl(&["kill-node", "3"]).await;
    tokio::time::sleep(REPOINT_AFTER).await;
    for (node, proxy) in &proxies {
        if *node == KILLED {
            proxy.set_target(&hosts[0]);
            proxy.reset_all();
        }
    }
    let mut evicted = None;
    while killed_at.elapsed() < Duration::from_secs(30) {
        if cluster_size(&plain).await.is_ok_and(|s| s == "2") {
            evicted = Some(killed_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let evicted = evicted.expect("node 3 was never evicted");
    // The survivors' fenced writes after the eviction.
    tokio::time::sleep(Duration::from_secs(6)).await;
    std::fs::write(&stop_file, b"").unwrap();
    let (_, tally) = fenced_finish(name, children, &log).await;
    let rows: Vec<(i64, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT token, seq FROM {table}_w ORDER BY seq, id"
    )))
    .fetch_all(&plain)
    .await
    .unwrap();
    let tokens: Vec<i64> = rows.iter().map(|r| r.0).collect();
    let seqs: Vec<i64> = rows.iter().map(|r| r.1).collect();
    let conflicts_seen = conflicts(&plain).await + conflicts(&node2).await - conflicts_before;
    let seq_ties = seqs.windows(2).filter(|w| w[0] >= w[1]).count();
    let out_of_order = fenced_report(
        name,
        &format!(
            "kill -9 of node 3's mariadbd {} into the run, its worker re-pointed to node 1 {} \
             later, node 3 evicted after {}",
            ms(FAULT_AT),
            ms(REPOINT_AFTER),
            ms(evicted)
        ),
        &tokens,
        &tally,
        &format!(
            " (required: 0); writes that read the same largest seq: {seq_ties} (required: 0); \
             Galera conflicts on nodes 1 and 2 (wsrep_local_cert_failures + \
             wsrep_local_bf_aborts), each a transaction or statement rolled back: \
             {conflicts_seen}"
        ),
    );
    assert_eq!(
        seq_ties, 0,
        "{name}: two committed writes read the same largest seq: {rows:?}"
    );
    assert_eq!(out_of_order, 0, "{name}: a stale write committed: {rows:?}");
    // As found: three nodes, for the next run.
    let rejoin = ctl(&["start-node", "3"]).await;
    assert_eq!(cluster_size(&plain).await.unwrap(), "3");
    println!(
        "{name}: node 3 started again and synced in {} ms",
        rejoin.get("rejoin_ms").map_or("?", String::as_str)
    );
}
