//! PostgreSQL behind a transaction pooler, found out rather than configured: a plain URL through
//! PgBouncer (transaction pooling, 3 server connections) works whatever its
//! `ignore_startup_parameters`, a direct URL stays on the prepared path, and `pooler(false)`
//! through a pooler is a clear error. `.ci/run` starts the three PgBouncers (`.ci/pgbouncer`):
//! 6432 refuses unknown start-up parameters, 6433 drops `extra_float_digits`, 6434 drops
//! `extra_float_digits` and `options`.

mod common;

use std::time::Duration;

use dblock::{ConnectOptions, LockError, Locker};

/// The PgBouncers and what each does with start-up parameters.
fn poolers() -> Vec<(&'static str, String)> {
    let url = |port: u16| {
        std::env::var(format!("DBLOCK_PGBOUNCER_URL_{port}"))
            .unwrap_or_else(|_| format!("postgres://postgres@127.0.0.1:{port}/test"))
    };
    vec![
        ("refuses unknown parameters", common::pgbouncer_url()),
        ("drops extra_float_digits", url(6433)),
        ("drops extra_float_digits and options", url(6434)),
    ]
}

/// A plain URL through the pooler, or `None` (skipped, or a failure with the servers required)
/// when that PgBouncer is not running.
async fn plain(what: &str, url: &str) -> Option<Locker> {
    match Locker::connect(url).await {
        Ok(l) => Some(l),
        Err(e) if !common::require_servers() && e.to_string().contains("refused") => {
            common::shout(&format!("skipping PgBouncer that {what} at {url}: {e}"));
            None
        }
        Err(e) => panic!("PgBouncer that {what}, plain URL {url}: {e}"),
    }
}

/// Through each pooler, the plain URL is found to be a pooler and every kind of statement
/// works: migrate, contended lock and hand-off between two lockers, re-entry, fence, inspect,
/// release. The direct URL is not taken for a pooler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_url_through_a_transaction_pooler_just_works() {
    if let Ok(direct) = Locker::connect(&common::postgres_url()).await {
        assert!(
            !dblock::test_util::pooler_mode(&direct),
            "direct server taken for a pooler"
        );
    } else if common::require_servers() {
        panic!("PostgreSQL unreachable");
    }
    for (what, url) in poolers() {
        let Some(a) = plain(what, &url).await else {
            continue;
        };
        assert!(
            dblock::test_util::pooler_mode(&a),
            "{what}: not found to be a pooler"
        );
        let table = common::table_for("poolers");
        let a = a.table(&table);
        a.migrate()
            .await
            .unwrap_or_else(|e| panic!("{what}: migrate: {e}"));
        let b = plain(what, &url).await.unwrap().table(&table);
        for round in 0..20 {
            let g = a
                .lock("k")
                .await
                .unwrap_or_else(|e| panic!("{what} {round}: {e}"));
            let owner = dblock::Owner::new();
            let inner = a.lock("r").owner(&owner).await.unwrap();
            let again = a.lock("r").owner(&owner).await.unwrap();
            assert_eq!(again.hold_count(), 2, "{what}");
            let waiter = {
                let b = b.clone();
                tokio::spawn(async move { b.lock("k").wait(Duration::from_secs(5)).await })
            };
            tokio::time::sleep(Duration::from_millis(5)).await;
            g.release()
                .await
                .unwrap_or_else(|e| panic!("{what} {round}: release: {e}"));
            let h = waiter
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("{what} {round}: {e}"));
            assert!(b.inspect("k").await.unwrap().unwrap().held, "{what}");
            h.release().await.unwrap();
            again.release().await.unwrap();
            inner.release().await.unwrap();
        }
    }
}

/// `pooler(false)` forces the direct path: through a transaction pooler that is an error at
/// connect that names `pooler(true)`, never a failure deep inside a statement later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forcing_the_direct_path_through_a_pooler_is_a_clear_error() {
    for (what, url) in poolers() {
        if plain(what, &url).await.is_none() {
            continue;
        }
        let err = Locker::connect_with(&url, ConnectOptions::new().pooler(false))
            .await
            .expect_err("pooler(false) through a transaction pooler");
        let text = err.to_string();
        assert!(
            matches!(err, LockError::Config(_)) && text.contains("pooler(true)"),
            "{what}: {text}"
        );
    }
}

/// PgBouncer in session pooling mode that refuses unknown start-up parameters (6435): each
/// client has a server session of its own, so the plain URL stays on the prepared path, with
/// the settings set on each new connection instead of sent at start-up; locking and a hand-off
/// to a waiter work there.
/// (Before, the refusal alone meant pooler mode.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_pooler_that_refuses_start_up_settings_stays_on_the_prepared_path() {
    let url = std::env::var("DBLOCK_PGBOUNCER_URL_6435")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:6435/test".to_owned());
    let Some(locker) = plain("runs in session mode", &url).await else {
        return;
    };
    assert!(
        !dblock::test_util::pooler_mode(&locker),
        "a session pooler taken for a transaction pooler"
    );
    let locker = locker.table(&common::table_for("session_pooler"));
    locker.migrate().await.unwrap();
    let g = locker.lock("k").await.unwrap();
    let waiter = {
        let l = locker.clone();
        tokio::spawn(async move {
            let asked = std::time::Instant::now();
            let g = l.lock("k").wait(Duration::from_secs(10)).await.unwrap();
            let took = asked.elapsed();
            g.release().await.unwrap();
            took
        })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    g.release().await.unwrap();
    let took = waiter.await.unwrap();
    assert!(took < Duration::from_secs(3), "hand-off took {took:?}");
}
