//! PostgreSQL hand-off: a release NOTIFYs the key only when a waiter asked for it, and the
//! waiter's locker wakes on it. (How fast that is, is measured in the benchmark.)

mod common;

#[cfg(not(all(feature = "postgres", feature = "_test-util")))]
#[test]
#[ignore = "the hand-off test needs `--features postgres,_test-util` (or --all-features)"]
fn handoff_needs_the_postgres_feature() {}

#[cfg(all(feature = "postgres", feature = "_test-util"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_notifies_only_when_someone_waits() {
    let Some(db) = common::postgres("handoff").await else {
        return;
    };
    use std::time::Duration;
    let l = &db.locker;
    let mut listener = sqlx::postgres::PgListener::connect(&db.url).await.unwrap();
    listener
        .listen(&dblock::test_util::notify_channel(l).unwrap())
        .await
        .unwrap();

    // Uncontended: no NOTIFY at all.
    l.lock("quiet").await.unwrap().release().await.unwrap();
    let nothing = tokio::time::timeout(Duration::from_millis(300), listener.recv()).await;
    assert!(
        nothing.is_err(),
        "uncontended release notified: {nothing:?}"
    );

    // Contended: the waiter flags the row, the release notifies the key.
    let g = l.lock("hot").await.unwrap();
    let l2 = l.clone();
    let waiter = tokio::spawn(async move { l2.lock("hot").wait(Duration::from_secs(10)).await });
    until_a_waiter_flags(l.table_name(), "hot").await;
    g.release().await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("a notification")
        .unwrap();
    assert_eq!(n.payload(), "hot");
    let got = waiter.await.unwrap().expect("waiter acquires");
    // Its acquisition cleared the flag: its own release is quiet again.
    got.release().await.unwrap();
    let nothing = tokio::time::timeout(Duration::from_millis(300), listener.recv()).await;
    assert!(
        nothing.is_err(),
        "release after the episode notified: {nothing:?}"
    );
}

/// Waits until a waiter of `key` has flagged its row, asking the release to NOTIFY (a waiter
/// does that once its LISTEN is in place, which takes a few connections' set-up: a fixed pause
/// before the release was a guess), at most 10 s.
#[cfg(all(feature = "postgres", feature = "_test-util"))]
async fn until_a_waiter_flags(table: &str, key: &str) {
    use std::time::{Duration, Instant};
    let sql = format!("SELECT count(*) FROM {table} WHERE lock_key = '{key}' AND contended");
    let deadline = Instant::now() + Duration::from_secs(10);
    while common::run_sql("postgres", &common::postgres_url(), &sql).await == 0 {
        assert!(Instant::now() < deadline, "no waiter flagged `{key}`");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Through PgBouncer in transaction mode a LISTEN would stay on one shared server connection, so
/// pooler mode opens none: waiters poll, and never ask a release to NOTIFY.
#[cfg(all(feature = "postgres", feature = "_test-util"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_a_pooler_waiters_poll_and_nobody_notifies() {
    let Some(db) = common::pgbouncer("handoff_pgb").await else {
        return;
    };
    use std::time::Duration;
    let l = &db.locker;
    // Watching from a direct connection: NOTIFY would reach it.
    let mut listener = sqlx::postgres::PgListener::connect(&common::postgres_url())
        .await
        .unwrap();
    listener
        .listen(&dblock::test_util::notify_channel(l).unwrap())
        .await
        .unwrap();
    let g = l.lock("hot").await.unwrap();
    let l2 = l.clone();
    let waiter = tokio::spawn(async move { l2.lock("hot").wait(Duration::from_secs(10)).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    g.release().await.unwrap();
    let got = waiter
        .await
        .unwrap()
        .expect("the waiter polls its way to the lock");
    let nothing = tokio::time::timeout(Duration::from_millis(300), listener.recv()).await;
    assert!(nothing.is_err(), "a release notified: {nothing:?}");
    got.release().await.unwrap();
}

/// Pooler mode with `listen_url` straight to PostgreSQL: the waiter LISTENs there and flags the
/// row through PgBouncer (a waiter only does that once its LISTEN is in place), and the release
/// (through PgBouncer) NOTIFYs the key: the waiter is woken instead of waiting for its next poll.
#[cfg(all(feature = "postgres", feature = "_test-util"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_a_pooler_a_direct_listen_url_wakes_waiters() {
    let Some(db) = common::pgbouncer("handoff_pgb_listen").await else {
        return;
    };
    use std::time::Duration;
    let options = dblock::ConnectOptions::new()
        .pooler(true)
        .listen_url(common::postgres_url());
    let l = dblock::Locker::connect_with(&db.url, options)
        .await
        .unwrap()
        .table(db.locker.table_name());
    let mut listener = sqlx::postgres::PgListener::connect(&common::postgres_url())
        .await
        .unwrap();
    listener
        .listen(&dblock::test_util::notify_channel(&l).unwrap())
        .await
        .unwrap();
    let g = l.lock("hot").await.unwrap();
    let l2 = l.clone();
    let waiter = tokio::spawn(async move { l2.lock("hot").wait(Duration::from_secs(10)).await });
    until_a_waiter_flags(l.table_name(), "hot").await;
    g.release().await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("a notification")
        .unwrap();
    assert_eq!(n.payload(), "hot");
    let got = waiter.await.unwrap().expect("waiter acquires");
    got.release().await.unwrap();
}

/// Setting LISTEN up never holds a waiter past its `wait` (a LISTEN server that does not answer
/// used to cost sqlx's 30 s connect time-out), and a set-up cut short is tried again by the
/// next waiter: once the server answers, that waiter LISTENs.
#[cfg(all(feature = "postgres", feature = "_test-util"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listen_that_does_not_answer_never_outlasts_wait() {
    use common::proxy::{Mode, Proxy};
    use std::time::{Duration, Instant};
    let Some(db) = common::postgres("handoff_listen_blackhole").await else {
        return;
    };
    let server = db
        .url
        .split('@')
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap()
        .to_owned();
    let proxy = Proxy::start(&server).await;
    proxy.set(Mode::Blackhole);
    let options = dblock::ConnectOptions::new().listen_url(proxy.url(&db.url));
    let l = dblock::Locker::connect_with(&db.url, options)
        .await
        .unwrap()
        .table(db.locker.table_name());
    let holder = db
        .locker
        .lock("hot")
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();

    let started = Instant::now();
    let busy = l
        .lock("hot")
        .wait(Duration::from_secs(1))
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert!(busy.is_busy(), "{busy:?}");
    assert!(
        took < Duration::from_millis(1800),
        "wait = 1 s took {took:?} while LISTEN hung"
    );

    // The server answers again: the next waiter sets LISTEN up and is woken by the release.
    proxy.set(Mode::Pass);
    let channel = dblock::test_util::notify_channel(&l).unwrap();
    let l2 = l.clone();
    let waiter = tokio::spawn(async move { l2.lock("hot").wait(Duration::from_secs(20)).await });
    let watcher = sqlx::PgPool::connect(&db.url).await.unwrap();
    let listening = async {
        loop {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN \"' || $1 || '\"'",
            )
            .bind(&channel)
            .fetch_one(&watcher)
            .await
            .unwrap();
            if n > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), listening)
        .await
        .expect("the next waiter set LISTEN up");
    holder.release().await.unwrap();
    let got = waiter.await.unwrap().expect("waiter acquires");
    got.release().await.unwrap();
}

/// A locker dropped without `shutdown()` (every clone, guard and copy gone) closes its LISTEN
/// connection within a second: services that make lockers per tenant or per test do not pile
/// up connections until `max_connections`.
#[cfg(all(feature = "postgres", feature = "_test-util"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_locker_closes_its_listen_connection() {
    let Some(db) = common::postgres("listen_drop").await else {
        return;
    };
    use std::time::{Duration, Instant};
    let watcher = sqlx::PgPool::connect(&db.url).await.unwrap();
    let locker = dblock::Locker::connect(&db.url)
        .await
        .unwrap()
        .table(db.locker.table_name());
    let channel = dblock::test_util::notify_channel(&locker).unwrap();
    let listening = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN \"' || $1 || '\"'",
        )
        .bind(&channel)
        .fetch_one(&watcher)
        .await
        .unwrap()
    };
    // A waiter sets LISTEN up (the holder is another locker: no release of this one's reaches
    // its listener before it is dropped).
    let holder = db.locker.lock("k").await.unwrap();
    let busy = locker.lock("k").wait(Duration::from_millis(1500)).await;
    assert!(busy.unwrap_err().is_busy());
    let until = Instant::now() + Duration::from_secs(10);
    while listening().await == 0 {
        assert!(Instant::now() < until, "LISTEN was never set up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(locker);
    let dropped = Instant::now();
    while listening().await > 0 {
        assert!(
            dropped.elapsed() < Duration::from_secs(1),
            "the LISTEN connection outlived its locker by a second"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    holder.release().await.unwrap();
}
