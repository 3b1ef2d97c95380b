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
