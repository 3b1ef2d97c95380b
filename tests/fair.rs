//! Fair waiting across processes (`LockRequest::fair`, `fair = true`): callers of one key in
//! different processes get it in the order they arrived, through tickets in the database; a
//! dead waiter holds the queue up for its ticket's lease at most; a dropped waiter leaves at
//! once; a re-entry never queues. The waiters in other processes are this test binary itself,
//! started with `DBLOCK_CHILD` set to run only `child_entry`.

mod common;

use std::io::Write;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use dblock::{LockError, Locker, Owner};

/// Runs only inside a child process (ignored in normal runs): a fair waiter for the key in
/// `DBLOCK_CHILD_KEY` that says which tenure (fencing token) it got, holds it a moment and
/// releases it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "child process entry point, started by the other tests"]
async fn child_entry() {
    let (role, locker) = common::child_locker().await;
    let key = std::env::var("DBLOCK_CHILD_KEY").unwrap();
    match role.as_str() {
        "fair-waiter" => {
            let guard = locker
                .lock(&key)
                .fair()
                .ttl(Duration::from_secs(10))
                .wait(Duration::from_secs(60))
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(30)).await;
            let token = guard.fencing_token();
            guard.release().await.unwrap();
            // The parent stops reading after this line: exit before libtest prints more.
            println!("GOT {token}");
            std::io::stdout().flush().unwrap();
            std::process::exit(0);
        }
        other => panic!("unknown role {other}"),
    }
}

fn waiter(db: &common::Db, key: &str) -> Child {
    common::child_command(db, "fair-waiter")
        .env("DBLOCK_CHILD_KEY", key)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// A task that waits fairly for `key` (a minute at most), releases it at once, and answers the
/// tenure it had.
fn fair_turn(locker: &Locker, key: &str) -> tokio::task::JoinHandle<Result<u64, LockError>> {
    let (locker, key) = (locker.clone(), key.to_owned());
    tokio::spawn(async move {
        let g = locker
            .lock(&key)
            .fair()
            .wait(Duration::from_secs(60))
            .await?;
        let token = g.fencing_token();
        g.release().await?;
        Ok(token)
    })
}

/// How many live tickets the queue of `db`'s lock table has for `key`.
async fn queued(db: &common::Db, key: &str) -> i64 {
    let queue = format!("{}_queue", db.locker.table_name());
    let now = match db.name {
        "sqlite" => "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)",
        n if common::is_postgres(n) => "statement_timestamp()",
        _ => "UTC_TIMESTAMP(6)",
    };
    let sql = format!(
        "SELECT CAST(COUNT(*) AS {}) FROM {queue} WHERE lock_key = '{key}' AND expires_at > {now}",
        if db.name == "sqlite" || common::is_postgres(db.name) {
            "BIGINT"
        } else {
            "SIGNED"
        }
    );
    common::run_sql(db.name, &common::direct_url(db), &sql).await
}

/// Polls until the queue of `key` holds `n` live tickets.
async fn until_queued(db: &common::Db, key: &str, n: i64) {
    let start = Instant::now();
    loop {
        let now = queued(db, key).await;
        if now == n {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{}: {now} tickets queued, waited for {n}",
            db.name
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Five processes queue for a held key one after another; released, the key goes to them in
/// the order they queued: their tenures (fencing tokens) rise with their arrival. Without the
/// queue, whichever process polls first after a release wins (the chance that five pollers win
/// in arrival order by luck is 1 in 120).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_get_the_key_in_the_order_they_queued() {
    let (dbs, _dir) = common::all("fair").await;
    for db in &dbs {
        let key = format!("printer:{}", db.name);
        let holder = db.locker.lock(&key).fair().await.unwrap();
        let first = holder.fencing_token();
        let mut children = Vec::new();
        for i in 0..5 {
            children.push(waiter(db, &key));
            until_queued(db, &key, i + 1).await;
        }
        holder.release().await.unwrap();
        let mut tokens = Vec::new();
        for c in &mut children {
            let token: u64 = common::read_marker(c, "GOT").await.parse().unwrap();
            let status = c.wait().unwrap();
            assert!(status.success(), "{}: a waiter failed: {status}", db.name);
            tokens.push(token);
        }
        // Tenures by arrival: each waiter's token above the one queued before it.
        assert!(
            tokens[0] > first && tokens.windows(2).all(|w| w[1] > w[0]),
            "{}: the key did not go in arrival order (tenures by arrival): {first} then {tokens:?}",
            db.name
        );
        until_queued(db, &key, 0).await;
    }
}

/// A waiter killed while queued (no chance to leave) holds the queue up until its ticket's
/// lease (5 s) runs out, and no longer: a fair newcomer with one attempt finds the key busy
/// while the dead ticket is live, a patient one gets it once it ran out; a caller without
/// `fair()` does not look at the queue.
///
/// The waiter that dies queues behind a live fair waiter of this process, so it only ever
/// reads the queue and never attempts the key: a process killed while its attempt is on the
/// wire may still take the key, because the server runs a statement whose client is gone to
/// its end (PostgreSQL and MariaDB notice the closed connection only when they answer). Its
/// attempt, landing after the holder's release, then held the key for its ttl, which is a
/// dead holder's case, not a dead waiter's (one CI run in many: the unfair call below was
/// busy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_waiter_holds_the_queue_up_for_its_tickets_lease_at_most() {
    let (dbs, _dir) = common::all("fair_dead").await;
    // Every backend's waiter dies first, so their tickets' leases run out together.
    let mut killed = Vec::new();
    for db in &dbs {
        let key = format!("dead:{}", db.name);
        let holder = db.locker.lock(&key).await.unwrap();
        let ahead = fair_turn(&db.locker, &key);
        until_queued(db, &key, 1).await;
        let mut child = waiter(db, &key);
        until_queued(db, &key, 2).await;
        child.kill().unwrap(); // SIGKILL: its ticket stays
        child.wait().unwrap();
        killed.push(Instant::now());
        let first = holder.fencing_token();
        holder.release().await.unwrap();
        // The live waiter ahead has the next tenure, releases it and leaves the queue.
        let ahead = ahead.await.unwrap().unwrap();
        assert!(ahead > first, "{}: the key's next tenure", db.name);

        let once = db.locker.lock(&key).fair().await;
        assert!(
            matches!(once, Err(LockError::Busy { .. })),
            "{}: a fair newcomer went ahead of a live ticket: {:?}",
            db.name,
            once.map(|g| g.fencing_token())
        );
        let unfair = match db.locker.lock(&key).await {
            Ok(g) => g,
            Err(e) => panic!(
                "{}: an unfair caller did not take the free key ({e}); the key's row: {:?}",
                db.name,
                db.locker.inspect(&key).await
            ),
        };
        unfair.release().await.unwrap();
    }
    for (db, killed) in dbs.iter().zip(killed) {
        let key = format!("dead:{}", db.name);
        // The other backends' set-up above may have taken longer than the ticket's lease: then
        // the key is free on the first attempt.
        let asked = killed.elapsed();
        let g = db
            .locker
            .lock(&key)
            .fair()
            .wait(Duration::from_secs(20))
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", db.name));
        let waited = killed.elapsed();
        assert!(
            waited >= Duration::from_secs(3)
                && waited < asked.max(Duration::from_secs(5)) + Duration::from_secs(3),
            "{}: got the key {waited:?} after the waiter died, asked {asked:?} after (its \
             ticket's lease is 5 s)",
            db.name
        );
        g.release().await.unwrap();
        until_queued(db, &key, 0).await;
    }
}

/// A fair waiter whose call is dropped leaves the queue at once, and the next one in line gets
/// the key as soon as it is released; an owner that holds the key re-enters with `fair()`
/// without queueing behind the waiters that wait for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_waiters_leave_and_reentry_never_queues() {
    let (dbs, _dir) = common::all("fair_drop").await;
    for db in &dbs {
        let key = format!("drop:{}", db.name);
        let me = Owner::new();
        let holder = db.locker.lock(&key).owner(&me).await.unwrap();
        let dropped = fair_turn(&db.locker, &key);
        until_queued(db, &key, 1).await;
        let next = fair_turn(&db.locker, &key);
        until_queued(db, &key, 2).await;

        // Re-entry with waiters queued: at once, not behind them.
        let again = tokio::time::timeout(
            Duration::from_secs(2),
            db.locker.lock(&key).owner(&me).fair(),
        )
        .await
        .unwrap_or_else(|_| panic!("{}: the re-entry queued behind its waiters", db.name))
        .unwrap();
        assert_eq!(again.hold_count(), 2, "{}", db.name);
        again.release().await.unwrap();

        dropped.abort();
        let _ = dropped.await;
        until_queued(db, &key, 1).await;

        let released = Instant::now();
        let first = holder.fencing_token();
        holder.release().await.unwrap();
        let token = next.await.unwrap().unwrap();
        assert!(
            token > first,
            "{}: the key went to someone else than the next waiter",
            db.name
        );
        assert!(
            released.elapsed() < Duration::from_secs(2),
            "{}: the next waiter took {:?} after the release",
            db.name,
            released.elapsed()
        );
        until_queued(db, &key, 0).await;
    }
}

/// A lock table whose queue table is missing (migration 0004 not applied, as after applying
/// only the older files by hand): `fair()` names the table and the fix instead of a raw
/// "relation does not exist".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_without_the_queue_table_names_the_fix() {
    let (dbs, _dir) = common::all("fair_old").await;
    for db in &dbs {
        let key = format!("old:{}", db.name);
        let table = common::table_for("fair_old");
        let old = common::as_named(db.name, db.locker.table(&table));
        old.migrate().await.unwrap();
        common::run_sql(
            db.name,
            &common::direct_url(db),
            &format!("DROP TABLE {table}_queue"),
        )
        .await;
        let err = old
            .lock(&key)
            .fair()
            .await
            .expect_err("fair without a queue table");
        let text = err.to_string();
        assert!(
            matches!(err, LockError::Config(_)) && text.contains("migrate()"),
            "{}: {text}",
            db.name
        );
        // Without `fair()` the table works as before.
        old.lock(&key).await.unwrap().release().await.unwrap();
    }
}

/// The attribute's `fair = true` waits in the queue like `.fair()`: with a ticket queued ahead
/// (a waiter of another owner), the body runs only after that waiter had the key.
#[cfg(feature = "macros")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_attribute_waits_in_the_queue() {
    #[dblock::distributed_lock(key = "job:{id}", locker = locker, fair = true, wait = "20s")]
    async fn job(locker: &Locker, id: &str) -> Result<u64, LockError> {
        Ok(dblock::current()
            .expect("inside a locked body")
            .fencing_token)
    }

    let (dbs, _dir) = common::all("fair_attr").await;
    for db in &dbs {
        let id = db.name;
        let key = format!("job:{id}");
        let holder = db.locker.lock(&key).await.unwrap();
        let first = holder.fencing_token();
        let ahead = fair_turn(&db.locker, &key);
        until_queued(db, &key, 1).await;
        let locker = db.locker.clone();
        let body = tokio::spawn(async move { job(&locker, id).await });
        until_queued(db, &key, 2).await;
        holder.release().await.unwrap();
        // The waiter ahead had the key first, the body after it.
        let ahead = ahead.await.unwrap().unwrap();
        assert!(ahead > first, "{}", db.name);
        assert!(body.await.unwrap().unwrap() > ahead, "{}", db.name);
    }
}
