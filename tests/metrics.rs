//! Metrics through the `metrics` facade (feature `metrics`), captured with a recording
//! recorder: acquire latency, wait and hold time, busy and lost counts, renewal failures and
//! held locks, labelled by the key TEMPLATE (never the concrete key) and the backend.
//!
//! One test function: the recorder is process-wide and taking a snapshot drains it.

mod common;

// Without the `metrics` feature (plain `cargo test`) the test is listed as ignored, naming the flag
// that runs it, instead of being left out of the build without a word.
#[cfg(not(all(feature = "metrics", feature = "macros", feature = "sqlite")))]
#[test]
#[ignore = "needs --features metrics (with the default sqlite and macros; or --all-features)"]
fn metrics_need_the_metrics_feature() {}

#[cfg(all(feature = "metrics", feature = "macros", feature = "sqlite"))]
mod measured {
    use super::common;
    use std::collections::HashMap;
    use std::time::Duration;

    use dblock::{distributed_lock, LockError, Locker};
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    #[distributed_lock(key = "order:{id}", locker = locker, wait = "50ms")]
    async fn settle(locker: &Locker, id: u64) -> Result<(), LockError> {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let _ = id;
        Ok(())
    }

    /// Not renewed, capped: the cap ends the body, and counts as renewal's cap does.
    #[distributed_lock(key = "unrenewed:{id}", locker = locker, ttl = "10s", max_hold = "300ms", renew = false)]
    async fn unrenewed(locker: &Locker, id: u64) -> Result<(), LockError> {
        tokio::time::sleep(Duration::from_secs(10)).await;
        let _ = id;
        Ok(())
    }

    #[distributed_lock(key = ["acct:{a}", "acct:{b}"], locker = locker)]
    async fn transfer(locker: &Locker, a: u64, b: u64) -> Result<(), LockError> {
        Ok(())
    }

    /// (metric name, key label, outcome label) → what was recorded.
    type Seen = HashMap<(String, String, String), DebugValue>;

    /// Each series' name, `backend` label (`None`: it has none), `key` and `kind` labels.
    type Series = Vec<(String, Option<String>, String, String)>;

    /// What was recorded, and each series' labels.
    fn seen(snapshot: metrics_util::debugging::Snapshot) -> (Seen, Series) {
        let mut backends = Vec::new();
        let seen = snapshot
            .into_vec()
            .into_iter()
            .map(|(ck, _, _, value)| {
                let key = ck.key();
                let find = |name: &str| {
                    key.labels()
                        .find(|l| l.key() == name)
                        .map(|l| l.value().to_owned())
                };
                let label = |name: &str| find(name).unwrap_or_default();
                backends.push((
                    key.name().to_owned(),
                    find("backend"),
                    label("key"),
                    label("kind"),
                ));
                (
                    (key.name().to_owned(), label("key"), label("outcome")),
                    value,
                )
            })
            .collect();
        (seen, backends)
    }

    fn samples(seen: &Seen, name: &str, key: &str, outcome: &str) -> usize {
        match seen.get(&(name.into(), key.into(), outcome.into())) {
            Some(DebugValue::Histogram(v)) => v.len(),
            Some(DebugValue::Counter(n)) => *n as usize,
            Some(DebugValue::Gauge(g)) => g.into_inner() as usize,
            None => 0,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lock_calls_are_measured_by_key_template() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("the only recorder of this test binary");

        let (db, _dir) = common::sqlite("metrics").await;
        let locker = &db.locker;

        // Five calls of the attribute on five keys: one template.
        for id in 1..=5 {
            settle(locker, id).await.unwrap();
        }
        // Several keys: one call, labelled by both templates; each hold by them too.
        transfer(locker, 1, 2).await.unwrap();
        // A busy call: the key is held by someone else for longer than the call's wait.
        let holder = locker.lock("order:9").await.unwrap();
        assert!(matches!(
            settle(locker, 9).await,
            Err(LockError::Busy { .. })
        ));
        holder.release().await.unwrap();

        // The handle API with a template of its own; a lease lost while held (force-released,
        // found gone by renewal); renewal failing once the table is gone.
        let g = locker
            .lock("job:7")
            .metrics_key("job:{n}")
            .ttl(Duration::from_millis(600))
            .await
            .unwrap()
            .auto_renew();
        assert!(locker.force_release("job:7").await.unwrap());
        tokio::time::timeout(Duration::from_secs(5), g.lost())
            .await
            .expect("renewal finds it gone");
        drop(g);
        let doomed = locker.table(&common::table_for("metrics_doomed"));
        doomed.migrate().await.unwrap();
        let g = doomed
            .lock("renew-me")
            .ttl(Duration::from_millis(600))
            .await
            .unwrap()
            .auto_renew();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP TABLE \"{}\"",
            doomed.table_name()
        )))
        .execute(&sqlx::SqlitePool::connect(&db.url).await.unwrap())
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(700)).await;
        drop(g);
        tokio::time::sleep(Duration::from_millis(200)).await;

        // A hold renewed up to its max_hold: counted once, and lost at the cap.
        let capped = locker
            .lock("capped:1")
            .metrics_key("capped:{n}")
            .ttl(Duration::from_millis(300))
            .max_hold(Duration::from_millis(500))
            .await
            .unwrap()
            .auto_renew();
        tokio::time::timeout(Duration::from_secs(30), capped.lost())
            .await
            .expect("lost at the cap");
        drop(capped);
        let ended = unrenewed(locker, 1).await;
        assert!(matches!(ended, Err(LockError::Lost { .. })), "{ended:?}");

        // A semaphore's permit: labelled `kind = permit`.
        let permit = locker
            .semaphore("exports:7", 2)
            .metrics_key("exports:{n}")
            .await
            .unwrap();
        permit.release().await.unwrap();

        let (seen, backends) = seen(snapshotter.snapshot());
        let keys: Vec<&String> = seen.keys().map(|(_, k, _)| k).collect();
        assert!(
            keys.iter().all(|k| !k.chars().any(|c| c.is_ascii_digit())),
            "a concrete key became a label: {keys:?}"
        );
        let t = "order:{id}";
        assert_eq!(
            samples(&seen, "dblock_acquire_seconds", t, "acquired"),
            5,
            "{seen:#?}"
        );
        assert_eq!(samples(&seen, "dblock_acquire_seconds", t, "busy"), 1);
        assert_eq!(samples(&seen, "dblock_busy_total", t, ""), 1);
        assert_eq!(samples(&seen, "dblock_wait_seconds", t, ""), 1);
        assert_eq!(samples(&seen, "dblock_hold_seconds", t, ""), 5);
        assert_eq!(
            samples(&seen, "dblock_held", t, ""),
            0,
            "every hold given back"
        );
        assert_eq!(
            samples(&seen, "dblock_acquire_seconds", "job:{n}", "acquired"),
            1
        );
        let both = "acct:{a}, acct:{b}";
        assert_eq!(
            samples(&seen, "dblock_acquire_seconds", both, "acquired"),
            1
        );
        assert_eq!(samples(&seen, "dblock_hold_seconds", both, ""), 2);
        assert_eq!(samples(&seen, "dblock_lost_total", "job:{n}", ""), 1);
        assert_eq!(
            samples(&seen, "dblock_max_hold_reached_total", "capped:{n}", ""),
            1,
            "{seen:#?}"
        );
        assert_eq!(
            samples(&seen, "dblock_max_hold_reached_total", "unrenewed:{id}", ""),
            1,
            "{seen:#?}"
        );
        assert_eq!(
            samples(&seen, "dblock_acquire_seconds", "(handle)", "acquired"),
            2
        );
        assert!(
            samples(&seen, "dblock_renewal_failures_total", "", "") >= 1,
            "{seen:#?}"
        );
        // Every series is dblock's and says which backend.
        assert!(seen.keys().all(|(name, _, _)| name.starts_with("dblock_")));
        assert_eq!(backends.len(), seen.len());
        assert_eq!(
            samples(&seen, "dblock_acquire_seconds", "exports:{n}", "acquired"),
            1
        );
        for (name, _, key, kind) in &backends {
            let expected = match key.as_str() {
                "exports:{n}" => "permit",
                "" => "", // the renewal counter: backend only
                _ => "lock",
            };
            assert_eq!(kind, expected, "{name} {key}");
        }
        let unlabelled: Vec<_> = backends
            .iter()
            .filter(|(_, backend, _, _)| backend.as_deref() != Some("sqlite"))
            .collect();
        assert!(
            unlabelled.is_empty(),
            "series without `backend = sqlite`: {unlabelled:?}"
        );
    }
}
