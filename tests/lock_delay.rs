//! Lock-delay on every backend: a lease that ends without a release keeps its key unavailable
//! to every owner for the delay more (database clock); a release, `force_release` or `steal`
//! ends it at once; the locker's default (`ConnectOptions::lock_delay`) applies when a request
//! sets none, and the attribute takes `lock_delay = ".."`.

mod common;

use std::time::{Duration, SystemTime};

use dblock::{distributed_lock, LockError, Locker};

const TTL: Duration = Duration::from_millis(800);
const DELAY: Duration = Duration::from_millis(1500);
const LIMIT: Duration = Duration::from_secs(30);

/// A holder that vanishes (its guard forgotten: no release, no renewal), as a crash leaves it.
async fn crash(l: &Locker, key: &str) -> SystemTime {
    let g = l.lock(key).ttl(TTL).lock_delay(DELAY).await.unwrap();
    let info = l.inspect(key).await.unwrap().unwrap();
    std::mem::forget(g);
    info.acquired_at
}

#[distributed_lock(key = "attr", locker = locker, ttl = "1s", lock_delay = "2s", renew = false)]
async fn with_delay(locker: &Locker) -> Result<Duration, LockError> {
    let info = locker.inspect("attr").await?.unwrap();
    Ok(info.expires_at.duration_since(info.acquired_at).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_holders_key_stays_unavailable_for_the_delay() {
    let (dbs, _dir) = common::all("lock_delay").await;
    for db in &dbs {
        let name = db.name;
        let l = common::own_table(db, "lock_delay").await;

        // After the lease (ttl) the key is still unavailable; after ttl + delay it is free.
        let acquired = crash(&l, "k").await;
        tokio::time::sleep(TTL + DELAY / 3).await;
        let e = l.lock("k").await.unwrap_err();
        assert!(e.is_busy(), "{name}: taken during the lock-delay: {e:?}");
        let next = l.lock("k").wait(LIMIT).await.unwrap();
        let taken = l.inspect("k").await.unwrap().unwrap().acquired_at;
        let after = taken.duration_since(acquired).unwrap();
        assert!(
            after >= TTL + DELAY,
            "{name}: taken {after:?} after the vanished holder's acquisition"
        );
        next.release().await.unwrap();

        // A release ends it at once; so do force_release and steal.
        let g = l.lock("r").ttl(TTL).lock_delay(DELAY).await.unwrap();
        g.release().await.unwrap();
        l.lock("r").await.unwrap().release().await.unwrap();
        crash(&l, "f").await;
        assert!(l.force_release("f").await.unwrap());
        l.lock("f").await.unwrap().release().await.unwrap();
        crash(&l, "s").await;
        l.steal("s").await.unwrap().release().await.unwrap();

        // The holder's own view of its lease is the ttl; the row's includes the delay.
        let g = l.lock("view").ttl(TTL).lock_delay(DELAY).await.unwrap();
        tokio::time::sleep(TTL + Duration::from_millis(100)).await;
        assert!(g.is_lost(), "{name}: the holder still counts on its lease");
        drop(g);

        // The locker's default, and the attribute.
        let defaulted = Locker::connect_with(&db.url, common::options_for(name).lock_delay(DELAY))
            .await
            .unwrap();
        let defaulted = common::as_named(name, defaulted).table(l.table_name());
        let g = defaulted.lock("d").ttl(TTL).await.unwrap();
        let info = defaulted.inspect("d").await.unwrap().unwrap();
        let span = info.expires_at.duration_since(info.acquired_at).unwrap();
        assert!(span >= TTL + DELAY, "{name}: {span:?}");
        g.release().await.unwrap();
        let span = with_delay(&l).await.unwrap();
        assert!(span >= Duration::from_secs(3), "{name}: {span:?}");
    }
}

/// The options of a locker on a pool of the caller's (`Locker::sqlite_with`, `mysql_with`,
/// `postgres_with`) apply: its lock-delay is the default of every request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locker_on_the_callers_pool_takes_its_options() {
    let (dbs, _dir) = common::all("lock_delay_pool").await;
    for db in &dbs {
        let name = db.name;
        let table = common::own_table(db, "lock_delay_pool").await;
        let options = dblock::ConnectOptions::new().lock_delay(DELAY);
        let l = match name {
            #[cfg(feature = "sqlite")]
            "sqlite" => {
                Locker::sqlite_with(sqlx::SqlitePool::connect(&db.url).await.unwrap(), options)
            }
            #[cfg(feature = "mysql")]
            "mariadb" => {
                Locker::mysql_with(sqlx::MySqlPool::connect(&db.url).await.unwrap(), options)
            }
            #[cfg(feature = "postgres")]
            "postgres" => {
                Locker::postgres_with(sqlx::PgPool::connect(&db.url).await.unwrap(), options)
            }
            _ => continue,
        };
        let l = l.table(table.table_name());
        let g = l.lock("d").ttl(TTL).await.unwrap();
        let info = l.inspect("d").await.unwrap().unwrap();
        let span = info.expires_at.duration_since(info.acquired_at).unwrap();
        assert!(span >= TTL + DELAY, "{name}: {span:?}");
        g.release().await.unwrap();
    }
}
