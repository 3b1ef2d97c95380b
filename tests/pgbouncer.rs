//! PostgreSQL through PgBouncer in transaction pooling mode (`.ci/pgbouncer`: 3 server
//! connections shared by every client): what breaks without `ConnectOptions::pooler`, and that
//! it works with it. Every test that loops over `common::all()` also runs through PgBouncer
//! ("postgres-pgbouncer"); these are the ones only PgBouncer needs.

mod common;

#[cfg(not(feature = "postgres"))]
#[test]
#[ignore = "the PgBouncer tests need `--features postgres` (or --all-features)"]
fn pgbouncer_tests_need_the_postgres_feature() {}

#[cfg(feature = "postgres")]
mod through_pgbouncer {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use dblock::{ConnectOptions, LockError, Locker};

    use super::common;

    /// A pool of the test's own through PgBouncer (no start-up parameter PgBouncer refuses),
    /// `None` (said loudly) when PgBouncer is not running.
    async fn bouncer_pool(test: &str, max: u32) -> Option<sqlx::PgPool> {
        use std::str::FromStr;
        // Reachability and the SKIPPING/REQUIRE policy, as every other backend has them.
        common::pgbouncer(test).await?;
        let options = sqlx::postgres::PgConnectOptions::from_str(&common::pgbouncer_url())
            .unwrap()
            .extra_float_digits(None);
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(max)
            .connect_with(options)
            .await
            .unwrap();
        Some(pool)
    }

    /// 16 owners, 4 keys, 20 lock cycles each, through 3 shared server connections: every cycle
    /// succeeds, and per key the fencing tokens strictly increase (no overlapping holds).
    async fn many_owners(locker: Locker) -> Result<(), Vec<String>> {
        locker.migrate().await.map_err(|e| vec![e.to_string()])?;
        let tokens: Arc<Mutex<HashMap<usize, Vec<u64>>>> = Arc::default();
        let tasks: Vec<_> = (0..16)
            .map(|i| {
                let (l, tokens) = (locker.clone(), tokens.clone());
                tokio::spawn(async move {
                    for _ in 0..20 {
                        let g = l
                            .lock(format!("k{}", i % 4))
                            .wait(Duration::from_secs(60))
                            .await?;
                        tokens
                            .lock()
                            .unwrap()
                            .entry(i % 4)
                            .or_default()
                            .push(g.fencing_token());
                        tokio::task::yield_now().await;
                        g.release().await?;
                    }
                    Ok::<(), LockError>(())
                })
            })
            .collect();
        let mut errors = Vec::new();
        for t in tasks {
            if let Err(e) = t.await.unwrap() {
                errors.push(e.to_string());
            }
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        let tokens = tokens.lock().unwrap();
        assert_eq!(tokens.values().map(Vec::len).sum::<usize>(), 320);
        for (key, t) in tokens.iter() {
            assert!(
                t.windows(2).all(|w| w[0] < w[1]),
                "k{key}: tokens not strictly increasing: {t:?}"
            );
        }
        Ok(())
    }

    /// The issue's case. Without pooler mode this failed at once: "prepared statement
    /// \"sqlx_s_1\" already exists" (42P05) from most owners, since sqlx's named statements
    /// landed on server connections other clients had prepared the same names on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn many_owners_share_a_small_server_pool() {
        let Some(pool) = bouncer_pool("pgb_many", 16).await else {
            return;
        };
        let table = common::table_for("pgb_many");
        // A pool of the caller's own ...
        let users = Locker::postgres_with(pool, ConnectOptions::new().pooler(true)).table(&table);
        many_owners(users)
            .await
            .unwrap_or_else(|e| panic!("Locker::postgres_with: {} owners failed: {e:#?}", e.len()));
        // ... and the locker's own pool.
        let own = Locker::connect_with(
            &common::pgbouncer_url(),
            ConnectOptions::new().pooler(true).max_connections(16),
        )
        .await
        .unwrap()
        .table(&table);
        many_owners(own)
            .await
            .unwrap_or_else(|e| panic!("Locker::connect_with: {} owners failed: {e:#?}", e.len()));
    }

    /// The worst case: the application's own pool through the pooler, given to a plain
    /// `Locker::postgres(pool)`, next to a correctly configured locker. The plain one finds the
    /// pooler before its first statement (no prepared statement fails) and never LISTENs
    /// through it: a LISTEN there stayed on a shared server connection, and the other locker's
    /// statements then met its notifications ("unexpected message: NotificationResponse")
    /// until PgBouncer was restarted. Both run contended keys at once, so waiters set up
    /// LISTEN and releases NOTIFY; every cycle of both must succeed, and so must a third run of
    /// the configured one afterwards.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_applications_own_pool_finds_the_pooler_and_never_listens_through_it() {
        let Some(pool) = bouncer_pool("pgb_own_pool", 16).await else {
            return;
        };
        let plain = Locker::postgres(pool).table(&common::table_for("pgb_own_pool"));
        let configured = Locker::connect_with(
            &common::pgbouncer_url(),
            ConnectOptions::new().pooler(true).max_connections(16),
        )
        .await
        .unwrap()
        .table(&common::table_for("pgb_configured"));
        let (p, c) = tokio::join!(many_owners(plain.clone()), many_owners(configured.clone()));
        p.unwrap_or_else(|e| panic!("plain Locker::postgres(pool): {} failed: {e:#?}", e.len()));
        c.unwrap_or_else(|e| {
            panic!(
                "the pooler(true) locker beside it: {} failed: {e:#?}",
                e.len()
            )
        });
        #[cfg(feature = "_test-util")]
        assert!(
            dblock::test_util::pooler_mode(&plain),
            "the application's pool through PgBouncer not found to be a pooler"
        );
        many_owners(configured)
            .await
            .unwrap_or_else(|e| panic!("the pooler(true) locker afterwards: {e:#?}"));
    }

    /// Why pooler mode exists: the default (prepared statements) does not survive transaction
    /// pooling. If this ever passes, the pooler keeps prepared statements per client (PgBouncer
    /// ≥ 1.21 with `max_prepared_statements` can) and the docs of `ConnectOptions::pooler` may
    /// say so.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn prepared_statements_fail_through_it() {
        let Some(pool) = bouncer_pool("pgb_prepared", 16).await else {
            return;
        };
        let table = common::table_for("pgb_prepared");
        let setup = Locker::postgres_with(pool.clone(), ConnectOptions::new().pooler(true));
        setup.table(&table).migrate().await.unwrap();
        // `pooler(false)` forces the prepared path (a plain `Locker::postgres(pool)` finds the
        // pooler: the next test).
        let prepared =
            Locker::postgres_with(pool, ConnectOptions::new().pooler(false)).table(&table);
        let failed = many_owners(prepared)
            .await
            .expect_err("prepared statements worked");
        assert!(
            failed.iter().any(|e| e.contains("prepared statement")),
            "{failed:#?}"
        );
    }

    /// The other half of the design claim: sqlx's *unnamed* statements are not safe either.
    /// They are sent as Parse/Describe/Sync, then Bind/Execute/Sync; PgBouncer may hand the
    /// server connection to another client at the ReadyForQuery in between, and the Bind then
    /// runs that client's statement. Two kinds of query from 16 clients: results of the other
    /// kind come back (measured: about a third of 3,200). Simple queries (`raw_sql`, what
    /// pooler mode sends) never mix.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn unnamed_statements_get_other_clients_results_simple_queries_do_not() {
        let Some(pool) = bouncer_pool("pgb_unnamed", 16).await else {
            return;
        };
        let run = |simple: bool| {
            let pool = pool.clone();
            async move {
                let tasks: Vec<_> = (0..16i64)
                    .map(|i| {
                        let pool = pool.clone();
                        tokio::spawn(async move {
                            let mut wrong = 0;
                            for n in 0..100i64 {
                                let times = if i % 2 == 0 { 1 } else { 1000 };
                                let got: Result<i64, sqlx::Error> = if simple {
                                    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                                        "SELECT '{n}'::int8 * {times}"
                                    )))
                                    .fetch_one(&pool)
                                    .await
                                    .and_then(|r| sqlx::Row::try_get(&r, 0))
                                } else {
                                    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                                        "SELECT $1::int8 * {times}"
                                    )))
                                    .bind(n)
                                    .persistent(false)
                                    .fetch_one(&pool)
                                    .await
                                };
                                if !matches!(got, Ok(v) if v == n * times) {
                                    wrong += 1;
                                }
                            }
                            wrong
                        })
                    })
                    .collect();
                let mut wrong = 0;
                for t in tasks {
                    wrong += t.await.unwrap();
                }
                wrong
            }
        };
        assert_eq!(run(true).await, 0, "simple queries got wrong results");
        let unnamed = run(false).await;
        assert!(
            unnamed > 0,
            "no unnamed statement got another's result: the pooler keeps them per client now"
        );
    }

    /// A stock PgBouncer refuses the direct path's start-up parameters; the plain URL finds
    /// that out and connects in pooler mode, and `pooler(false)` says what to do instead.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stock_pgbouncer_is_found_from_the_plain_url() {
        if common::pgbouncer("pgb_startup").await.is_none() {
            return;
        }
        let url = common::pgbouncer_url();
        match Locker::connect_with(&url, ConnectOptions::new().pooler(false)).await {
            Err(LockError::Config(e)) => {
                assert!(
                    e.contains("startup parameter") && e.contains("pooler(true)"),
                    "{e}"
                )
            }
            other => panic!("expected a Config error naming pooler(true): {other:?}"),
        }
        let found = Locker::connect(&url)
            .await
            .unwrap()
            .table(&common::table_for("pgb_startup"));
        #[cfg(feature = "_test-util")]
        assert!(dblock::test_util::pooler_mode(&found));
        found.migrate().await.unwrap();
        found.lock("k").await.unwrap().release().await.unwrap();
    }

    /// A fenced transaction through PgBouncer, twice on the same client connection: the fence
    /// statement leaves nothing behind (a prepared fence would, and the second transaction,
    /// on another server connection, would not find it or find another client's).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fences_in_many_transactions_on_one_client_connection() {
        let Some(db) = common::pgbouncer("pgb_fence").await else {
            return;
        };
        let Some(one) = bouncer_pool("pgb_fence", 1).await else {
            return;
        };
        // Other clients busy on the few server connections meanwhile.
        let noise: Vec<_> = (0..4)
            .map(|i| {
                let l = db.locker.clone();
                tokio::spawn(async move {
                    for _ in 0..30 {
                        l.lock(format!("noise{i}")).await?.release().await?;
                    }
                    Ok::<(), LockError>(())
                })
            })
            .collect();
        let g = db.locker.lock("fenced").await.unwrap();
        for _ in 0..30 {
            let mut tx = one.begin().await.unwrap();
            g.fence(&mut *tx).await.unwrap();
            tx.commit().await.unwrap();
        }
        g.release().await.unwrap();
        for t in noise {
            t.await.unwrap().unwrap();
        }
    }
}
