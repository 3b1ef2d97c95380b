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
    tokio::time::sleep(Duration::from_millis(300)).await;
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
    tokio::time::sleep(Duration::from_millis(300)).await;
    g.release().await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("a notification")
        .unwrap();
    assert_eq!(n.payload(), "hot");
    let got = waiter.await.unwrap().expect("waiter acquires");
    got.release().await.unwrap();
}
