//! `Locker::steal` and `LeaderRequest::steal` on every backend: the key is taken at once from
//! its holder with a larger fencing token; the old holder, mid-transaction, cannot commit a
//! fenced write after the steal; its `extend` fails with `Lost`, its renewal finds the key gone
//! and its `lost()` resolves; a locked body that is stolen from ends with `Err(Lost)`.

mod common;

use std::time::{Duration, Instant};

use dblock::{distributed_lock, LockError, Locker};
use sqlx::Row;

const TTL: Duration = Duration::from_secs(3);
const LIMIT: Duration = Duration::from_secs(30);

/// The old holder opens a transaction, writes, is stolen from, then fences: refused, and only
/// the new holder's write commits.
macro_rules! mid_transaction {
    ($pool:ty, $db:expr, $l:expr) => {{
        let (db, l): (&common::Db, &Locker) = ($db, $l);
        let table = common::table_for("steal_money");
        let pool = <$pool as common::TestPool>::open(&db.url).await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {table} (id INTEGER NOT NULL PRIMARY KEY, who VARCHAR(20) NOT NULL);
             INSERT INTO {table} (id, who) VALUES (1, 'nobody')"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let write = |who: &str| format!("UPDATE {table} SET who = '{who}' WHERE id = 1");

        let old = l.lock("k").ttl(TTL).await.unwrap().auto_renew();
        let begin = || async {
            let mut tx = pool.begin().await.unwrap();
            sqlx::raw_sql(sqlx::AssertSqlSafe(write("old")))
                .execute(&mut *tx)
                .await
                .unwrap();
            tx
        };
        // On a server the old holder's transaction is open across the steal. SQLite's write
        // transaction holds the file's one write lock, which no steal (no lock statement at
        // all) gets past: there the old holder writes just after it.
        let sqlite = db.name == "sqlite";
        let early = if sqlite { None } else { Some(begin().await) };

        // Another task is another owner: it steals the key.
        let thief = l.clone();
        let stolen_at = Instant::now();
        let new = tokio::spawn(async move { thief.steal("k").await })
            .await
            .unwrap()
            .unwrap();
        let mut old_tx = match early {
            Some(tx) => tx,
            None => begin().await,
        };
        assert!(new.fencing_token() > old.fencing_token(), "{}", db.name);
        let fenced = old.fence(&mut *old_tx).await;
        assert!(
            matches!(&fenced, Err(LockError::Lost { .. })),
            "{}: the old holder fenced after the steal: {fenced:?}",
            db.name
        );
        old_tx.rollback().await.unwrap();

        let mut tx = pool.begin().await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(write("new")))
            .execute(&mut *tx)
            .await
            .unwrap();
        new.fence(&mut *tx).await.unwrap();
        tx.commit().await.unwrap();
        let who: String = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SELECT who FROM {table} WHERE id = 1"
        )))
        .fetch_one(&pool)
        .await
        .unwrap()
        .get(0);
        assert_eq!(who, "new", "{}", db.name);

        // The old holder hears of it at its next renewal (about a third of its ttl).
        let lost = tokio::time::timeout(LIMIT, old.lost())
            .await
            .unwrap_or_else(|_| panic!("{}: old holder never lost the key", db.name));
        let heard = stolen_at.elapsed();
        assert!(lost.is_lost(), "{}: {lost:?}", db.name);
        let e = old.extend(TTL).await.unwrap_err();
        assert!(e.is_lost(), "{}: extend after the steal: {e:?}", db.name);
        drop(old);
        new.release().await.unwrap();
        heard
    }};
}

#[distributed_lock(key = "body", locker = locker, ttl = TTL)]
async fn long_body(locker: &Locker) -> Result<(), LockError> {
    tokio::time::sleep(LIMIT).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steal_takes_the_key_now_and_the_old_holder_cannot_commit() {
    let (dbs, _dir) = common::all("steal").await;
    for db in &dbs {
        let name = db.name;
        let l = common::own_table(db, "steal").await;

        let heard = match name {
            #[cfg(feature = "sqlite")]
            "sqlite" => mid_transaction!(sqlx::SqlitePool, db, &l),
            #[cfg(feature = "postgres")]
            n if common::is_postgres(n) => mid_transaction!(sqlx::PgPool, db, &l),
            #[cfg(feature = "mysql")]
            _ => mid_transaction!(sqlx::MySqlPool, db, &l),
            #[allow(unreachable_patterns)]
            other => panic!("no pool type for {other}"),
        };
        eprintln!("{name}: steal -> old holder's lost(): {heard:?}");
        assert!(heard < LIMIT, "{name}");
        let info = l.inspect("k").await.unwrap().unwrap();
        assert!(!info.held, "{name}");

        // A semaphore of the same name is another lock: its permits stay.
        let permit = l.semaphore("named", 2).await.unwrap();
        let holder = l.lock("named").await.unwrap();
        let thief = l.steal("named").await.unwrap();
        assert_eq!(l.permits("named").await.unwrap().len(), 1, "{name}");
        assert!(
            permit.release().await.is_ok(),
            "{name}: the permit was freed"
        );
        drop(holder);
        thief.release().await.unwrap();

        // A free key is simply taken; stealing from oneself is a re-entry.
        let g = l.steal("free").await.unwrap();
        let me = g.owner().clone();
        let again = l.steal("free").owner(&me).await.unwrap();
        assert_eq!(again.fencing_token(), g.fencing_token(), "{name}: re-entry");
        assert_eq!(again.hold_count(), 2, "{name}");
        drop(again);
        g.release().await.unwrap();

        // A locked body stolen from ends with Lost.
        let (l1, started) = (l.clone(), Instant::now());
        let body = tokio::spawn(async move { long_body(&l1).await });
        while l.inspect("body").await.unwrap().is_none_or(|i| !i.held) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let thief = l.steal("body").await.unwrap();
        let e = body.await.unwrap().unwrap_err();
        assert!(e.is_lost(), "{name}: {e:?}");
        assert!(started.elapsed() < LIMIT, "{name}");
        thief.release().await.unwrap();

        // A leader preempted.
        let leader = l.leader("lead").ttl(TTL).campaign().await.unwrap();
        let newer = l.leader("lead").ttl(TTL).steal().await.unwrap();
        assert!(newer.fencing_token() > leader.fencing_token(), "{name}");
        tokio::time::timeout(LIMIT, leader.lost())
            .await
            .unwrap_or_else(|_| panic!("{name}: the old leader never heard"));
        let current = l.leader("lead").current().await.unwrap().unwrap();
        assert_eq!(current.fencing_token, newer.fencing_token(), "{name}");
        drop(leader);
        newer.resign().await.unwrap();
    }
}

/// A steal or a force-release in the holder's own process ends its hold at once: `lost()`
/// resolves without waiting for a renewal or the lease (30 s, not renewed here), for a lock, a
/// read hold and a permit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holder_in_the_same_process_learns_at_once() {
    let (dbs, _dir) = common::all("steal_same").await;
    let at_once = Duration::from_secs(5);
    for db in &dbs {
        let name = db.name;
        let l = common::own_table(db, "steal_same").await;
        let ttl = Duration::from_secs(30);

        let old = l.lock("s").ttl(ttl).await.unwrap();
        let new = l.steal("s").await.unwrap();
        tokio::time::timeout(at_once, old.lost())
            .await
            .unwrap_or_else(|_| panic!("{name}: the stolen guard did not learn it"));
        assert!(
            !new.is_lost(),
            "{name}: the thief's own guard was marked lost"
        );
        assert!(old.extend(ttl).await.unwrap_err().is_lost(), "{name}");
        new.release().await.unwrap();

        let old = l.lock("f").ttl(ttl).await.unwrap();
        assert!(l.force_release("f").await.unwrap(), "{name}");
        tokio::time::timeout(at_once, old.lost())
            .await
            .unwrap_or_else(|_| panic!("{name}: the force-released guard did not learn it"));
        assert!(old.release().await.is_err(), "{name}");

        let read = l.read("r").ttl(ttl).await.unwrap();
        assert!(l.force_release("r").await.unwrap(), "{name}");
        tokio::time::timeout(at_once, read.lost())
            .await
            .unwrap_or_else(|_| panic!("{name}: the force-released read did not learn it"));

        let permit = l.semaphore("p", 2).ttl(ttl).await.unwrap();
        assert!(l.force_release("p").await.unwrap(), "{name}");
        tokio::time::timeout(at_once, permit.lost())
            .await
            .unwrap_or_else(|_| panic!("{name}: the force-released permit did not learn it"));

        // A key taken again after it was freed is a new tenure: not touched.
        let again = l.lock("f").ttl(ttl).await.unwrap();
        assert!(!again.is_lost(), "{name}");
        again.release().await.unwrap();
    }
}

/// A steal takes the key now also while callers of its own process wait for it: it does not
/// line up behind them (with no wait, behind them it would be busy without asking, after it
/// had ended the holder's lease each round). The waiters go on waiting, now for the thief.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steal_does_not_line_up_behind_its_own_process_waiters() {
    let (dbs, _dir) = common::all("steal_line").await;
    for db in &dbs {
        let l = &db.locker;
        let holder = common::connect(db).await.table(l.table_name());
        let held = holder.lock("job").ttl(LIMIT).await.unwrap();
        let waiter = {
            let l = l.clone();
            tokio::spawn(async move { l.lock("job").wait(LIMIT).await })
        };
        // The waiter is in the process's line once the key has been found busy by it.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let thief = l.clone();
        let stolen = tokio::spawn(async move { thief.steal("job").await })
            .await
            .unwrap();
        let stolen = stolen.unwrap_or_else(|e| panic!("{}: steal: {e}", db.name));
        assert!(stolen.fencing_token() > held.fencing_token(), "{}", db.name);
        assert!(!waiter.is_finished(), "{}: the waiter got the key", db.name);
        stolen.release().await.unwrap();
        let got = waiter.await.unwrap();
        assert!(got.is_ok(), "{}: {got:?}", db.name);
    }
}
