//! SPEC §3's type promises, checked by the compiler: `Locker` is `Clone + Send + Sync`,
//! `LockGuard` is `Send`, `LockError` is `Send + Sync + 'static`, and every future and stream
//! the API returns is `Send` (so any of them can be spawned). The futures are made and dropped
//! unpolled: what is tested is their type.

use std::future::IntoFuture;
use std::time::Duration;

use dblock::sqlx::{Connection, SqliteConnection};
use dblock::{LockError, LockGuard, Locker};

fn send<T: Send>(_: &T) {}
fn send_sync_static<T: Send + Sync + 'static>() {}
fn clone_send_sync<T: Clone + Send + Sync>() {}

#[test]
fn the_public_types_cross_threads() {
    clone_send_sync::<Locker>();
    send_sync_static::<LockError>();
    send_sync_static::<dblock::LockInfo>();
    send_sync_static::<dblock::HeldLock>();
    send_sync_static::<dblock::Owner>();
    fn guard_send<T: Send>() {}
    guard_send::<LockGuard>();
    guard_send::<dblock::Leadership>();
    guard_send::<dblock::TxLock>();
    guard_send::<dblock::Watch>();
    guard_send::<dblock::Observe>();
}

#[tokio::test]
async fn every_future_the_api_returns_is_send() -> Result<(), Box<dyn std::error::Error>> {
    send(&Locker::connect("sqlite::memory:"));
    let locker = dblock::testing::locker().await?;
    let l = &locker;
    let d = Duration::from_secs(1);

    // Taking keys, every kind.
    send(
        &l.lock("k")
            .ttl(d)
            .wait(d)
            .min_hold(d)
            .max_hold(d)
            .once()
            .fair()
            .into_future(),
    );
    send(&l.read("k").into_future());
    send(&l.semaphore("k", 3).into_future());
    send(&l.lock_all(["a", "b"]).into_future());
    send(&l.steal("k").into_future());
    send(&l.leader("k").campaign());
    send(&l.leader("k").steal());
    send(&l.leader("k").current());
    send(&l.migrate());
    send(&l.shutdown());

    // A guard's calls.
    let guard = l.lock("g").await?;
    send(&guard.extend(d));
    send(&guard.lost());
    send(&guard.release());
    let guard = l.lock("h").await?;
    send(&guard.release_failed());

    // The operator's calls.
    send(&l.inspect("k"));
    send(&l.held());
    send(&l.permits("k"));
    send(&l.force_release("k"));
    send(&l.reset("k"));
    send(&l.purge(Duration::ZERO));
    send(&l.migration_status());
    send(&l.waiters("k"));

    // In the caller's transaction.
    let mut conn = SqliteConnection::connect("sqlite::memory:").await?;
    send(&l.lock_in(&mut conn, "t").wait(d).into_future());
    let guard = l.lock("f").await?;
    send(&guard.fence(&mut conn));
    send(&guard.succeed_in(&mut conn));
    send(&guard.release_in(&mut conn));
    send(&dblock::fence(&mut conn));
    send(&dblock::succeed_in(&mut conn));
    send(&dblock::release_in(&mut conn));
    send(&dblock::Owner::new().scope(async {}));

    // Leadership and the streams.
    let leading = l.leader("lead").campaign().await?;
    send(&leading.lost());
    send(&leading.fence(&mut conn));
    send(&leading.resign());
    send(&l.leader("lead").observe());
    send(&l.watch(""));
    Ok(())
}
