//! `dblock watch` as a person sees it: in a pseudo-terminal (tmux), its screen read back while
//! a key is held and a fair waiter queues, then `q` ends it and the terminal session with it;
//! and `watch --json`, one snapshot a line, ended by Ctrl-C (SIGINT) with status 0.

mod common;

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Generous: the machine may be busy with other tests.
const DEADLINE: Duration = Duration::from_secs(60);

/// A fair waiter for `key` (held by someone else) in the background, once its ticket is in the
/// queue; its owner id. The task ends when it gets the key (and gives it back) or is aborted.
async fn queue_fair_waiter(db: &common::Db, key: &str) -> (String, tokio::task::JoinHandle<()>) {
    let owner = dblock::Owner::new();
    let id = owner.id().to_owned();
    let locker = db.locker.clone();
    let k = key.to_owned();
    let task = tokio::spawn(async move {
        if let Ok(g) = locker
            .lock(k)
            .owner(&owner)
            .fair()
            .wait(Duration::from_secs(120))
            .await
        {
            let _ = g.release().await;
        }
    });
    let start = Instant::now();
    while !db
        .locker
        .waiters(key)
        .await
        .unwrap()
        .iter()
        .any(|w| w.owner == id)
    {
        assert!(
            start.elapsed() < DEADLINE,
            "{}: the waiter never queued",
            db.name
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (id, task)
}

/// `dblock watch --json` every 100 ms on `db`'s table, cut by `filter` (`["--prefix", "p:"]`),
/// its output piped.
fn watch_json(db: &common::Db, filter: [&str; 2]) -> std::process::Child {
    common::cmd()
        .env("DATABASE_URL", &db.url)
        .args([
            "--table",
            db.table(),
            "watch",
            "--json",
            "--interval",
            "100ms",
        ])
        .args(filter)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn tmux_available() -> bool {
    Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// tmux on a server (socket) of the test's own, so no other tmux is touched.
fn tmux(socket: &str, args: &[&str]) -> std::process::Output {
    Command::new("tmux")
        .args(["-L", socket, "-f", "/dev/null"])
        .args(args)
        .output()
        .expect("run tmux")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_draws_held_keys_and_the_fair_queue_in_a_terminal_and_quits_on_q() {
    if !tmux_available() {
        assert!(
            !common::require_servers(),
            "tmux is not installed and DBLOCK_REQUIRE_SERVERS=1"
        );
        common::shout("SKIPPING the watch-in-a-terminal test: tmux is not installed.");
        return;
    }
    let (dbs, _dir) = common::all("watch_tty").await;
    for db in &dbs {
        let held = db
            .locker
            .lock("watch:held")
            .holder("watch-me")
            .ttl(Duration::from_secs(300))
            .await
            .unwrap();
        let red = db
            .locker
            .lock("watch:\u{1b}[31mred")
            .ttl(Duration::from_secs(300))
            .await
            .unwrap();
        let (waiter, task) = queue_fair_waiter(db, "watch:held").await;

        let socket = format!("dblock-cli-test-{}-{}", std::process::id(), db.name);
        let command = format!(
            "{} --table {} watch --interval 200ms",
            env!("CARGO_BIN_EXE_dblock"),
            db.table()
        );
        let out = tmux(
            &socket,
            &[
                "new-session",
                "-d",
                "-s",
                "watch",
                "-x",
                "120",
                "-y",
                "30",
                "-e",
                &format!("DATABASE_URL={}", db.url),
                &command,
            ],
        );
        assert!(
            out.status.success(),
            "{}: tmux: {}",
            db.name,
            common::stderr(&out)
        );

        // The screen, read until it shows what is held and who waits.
        let start = Instant::now();
        let screen = loop {
            let out = tmux(&socket, &["capture-pane", "-p", "-t", "watch"]);
            let screen = common::stdout(&out);
            if screen.contains("watch:held")
                && screen.contains(held.owner().id())
                && screen.contains("FAIR QUEUE")
                && screen.contains(&waiter)
            {
                break screen;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "{}: the screen never showed the key and its waiter:\n{screen}",
                db.name
            );
            assert!(
                tmux(&socket, &["has-session", "-t", "watch"])
                    .status
                    .success(),
                "{}: watch ended before it showed the key; its last screen:\n{screen}",
                db.name
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(
            screen.contains("dblock watch: table") && screen.contains("2 held, 1 waiting"),
            "{}:\n{screen}",
            db.name
        );
        // The ESC of a key is shown as an escape, not obeyed.
        assert!(
            screen.contains("watch:\\u{1b}[31mred"),
            "{}:\n{screen}",
            db.name
        );
        // The held key's row says one waits for it (QUEUED, right-aligned under its header).
        let lines: Vec<&str> = screen.lines().collect();
        let header = lines
            .iter()
            .find(|l| l.starts_with("KEY "))
            .unwrap_or_else(|| panic!("{}: no header:\n{screen}", db.name));
        let row = lines
            .iter()
            .find(|l| l.starts_with("watch:held "))
            .unwrap_or_else(|| panic!("{}: no row:\n{screen}", db.name));
        let end = header.find("QUEUED").unwrap() + "QUEUED".len();
        assert!(row[..end].ends_with(" 1"), "{}:\n{header}\n{row}", db.name);

        // A release shows at a later refresh.
        red.release().await.unwrap();
        let start = Instant::now();
        loop {
            let screen = common::stdout(&tmux(&socket, &["capture-pane", "-p", "-t", "watch"]));
            if !screen.contains("31mred") && screen.contains("1 held") {
                break;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "{}: the release never showed:\n{screen}",
                db.name
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        // `q` quits: the program ends, and the tmux session with it.
        let out = tmux(&socket, &["send-keys", "-t", "watch", "q"]);
        assert!(out.status.success(), "{}", db.name);
        let start = Instant::now();
        while tmux(&socket, &["has-session", "-t", "watch"])
            .status
            .success()
        {
            assert!(
                start.elapsed() < DEADLINE,
                "{}: watch did not quit on q",
                db.name
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = tmux(&socket, &["kill-server"]);
        held.release().await.unwrap();
        let _ = tokio::time::timeout(DEADLINE, task).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_json_streams_one_snapshot_a_line_until_interrupted() {
    let (dbs, _dir) = common::all("watch_json").await;
    for db in &dbs {
        let held = db
            .locker
            .lock("stream:held")
            .ttl(Duration::from_secs(300))
            .await
            .unwrap();
        let (waiter, task) = queue_fair_waiter(db, "stream:held").await;

        let mut child = watch_json(db, ["--prefix", "stream:"]);
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut snapshots = Vec::new();
        while snapshots.len() < 3 {
            let line = rx
                .recv_timeout(DEADLINE)
                .unwrap_or_else(|_| panic!("{}: no snapshot from watch --json", db.name));
            let v: Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("{}: not JSON ({e}): {line}", db.name));
            snapshots.push(v);
        }
        for v in &snapshots {
            assert_eq!(v["table"], db.table(), "{}", db.name);
            common::rfc3339_secs(v["at"].as_str().unwrap());
            let locks = v["locks"].as_array().unwrap();
            assert_eq!(locks.len(), 1, "{}: {v}", db.name);
            assert_eq!(locks[0]["key"], "stream:held");
            assert_eq!(locks[0]["owner"], held.owner().id());
            assert_eq!(locks[0]["kind"]["type"], "lock");
            let waiters = v["waiters"].as_array().unwrap();
            assert_eq!(waiters.len(), 1, "{}: {v}", db.name);
            assert_eq!(waiters[0]["key"], "stream:held");
            assert_eq!(waiters[0]["owner"], waiter.as_str());
            assert!(waiters[0]["ticket"].as_u64().is_some());
            assert!(waiters[0]["time_left_secs"].as_f64().unwrap() > 0.0);
            common::rfc3339_secs(waiters[0]["expires_at"].as_str().unwrap());
        }

        // Ctrl-C ends it, with status 0.
        let out = Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .output()
            .unwrap();
        assert!(out.status.success());
        let start = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "{}: watch ignored SIGINT",
                db.name
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_eq!(status.code(), Some(0), "{}", db.name);
        reader.join().unwrap();
        held.release().await.unwrap();
        let _ = tokio::time::timeout(DEADLINE, task).await;
    }
}

/// `watch --holder TEXT`: only the holds whose holder contains TEXT (one job's here), and only
/// the fair waiters of the keys those hold; the header of the terminal view names the filter
/// (checked in the library-free `--json` form: the same read).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_holder_shows_only_those_holds_and_their_waiters() {
    let (dbs, _dir) = common::all("watch_holder").await;
    for db in &dbs {
        let ttl = Duration::from_secs(300);
        let mine = db
            .locker
            .lock("pick:a")
            .holder("job-a")
            .ttl(ttl)
            .await
            .unwrap();
        let other = db
            .locker
            .lock("pick:b")
            .holder("job-b")
            .ttl(ttl)
            .await
            .unwrap();
        let (waiter, task_a) = queue_fair_waiter(db, "pick:a").await;
        let (_, task_b) = queue_fair_waiter(db, "pick:b").await;

        let mut child = watch_json(db, ["--holder", "/job-a"]);
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let line = lines.next().expect("a snapshot").unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        let v: Value = serde_json::from_str(&line).unwrap();
        let locks = v["locks"].as_array().unwrap();
        assert_eq!(locks.len(), 1, "{}: {v}", db.name);
        assert_eq!(locks[0]["key"], "pick:a", "{}", db.name);
        assert_eq!(locks[0]["owner"], mine.owner().id(), "{}", db.name);
        let waiters = v["waiters"].as_array().unwrap();
        assert_eq!(waiters.len(), 1, "{}: {v}", db.name);
        assert_eq!(waiters[0]["key"], "pick:a", "{}", db.name);
        assert_eq!(waiters[0]["owner"], waiter.as_str(), "{}", db.name);

        mine.release().await.unwrap();
        other.release().await.unwrap();
        for task in [task_a, task_b] {
            let _ = tokio::time::timeout(DEADLINE, task).await;
        }
    }
}
