//! Leases that outlive the work: renewal by the locker's one background task, the lost-lock
//! signal, and renewal stopping the moment the work ends.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dblock::{distributed_lock, LockError, Locker};

#[distributed_lock(key = "long", locker = locker, ttl = "1s")]
async fn long_body(locker: &Locker, secs: u64) -> Result<Instant, LockError> {
    tokio::time::sleep(Duration::from_secs(secs)).await;
    Ok(Instant::now())
}

/// Another owner tries all along; returns when it first got the lock.
async fn contender(locker: Locker, key: &'static str, stop: Arc<AtomicBool>) -> Option<Instant> {
    while !stop.load(Ordering::SeqCst) {
        if let Ok(g) = locker.lock(key).ttl(Duration::from_secs(1)).await {
            let at = Instant::now();
            g.release().await.unwrap();
            return Some(at);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_keeps_a_1s_lock_through_a_5s_body() {
    let (dbs, _dir) = common::all("renew5").await;
    for db in &dbs {
        let stop = Arc::new(AtomicBool::new(false));
        let l = db.locker.clone();
        let body = tokio::spawn(async move { long_body(&l, 5).await });
        tokio::time::sleep(Duration::from_millis(100)).await; // the body holds the lock by now
        let other = tokio::spawn(contender(db.locker.clone(), "long", stop.clone()));
        let ended = body.await.unwrap().expect("body kept its lock");
        let got = tokio::time::timeout(Duration::from_secs(5), other)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(
            got >= ended,
            "{}: the other owner got the lock while the body ran",
            db.name
        );
        assert!(
            got - ended < Duration::from_millis(500),
            "{}: hand-off took {:?}",
            db.name,
            got - ended
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_renew_keeps_a_handle_alive_and_stops_at_release() {
    let (dbs, _dir) = common::all("renewh").await;
    for db in &dbs {
        let l = &db.locker;
        let g = l
            .lock("h")
            .ttl(Duration::from_millis(600))
            .await
            .unwrap()
            .auto_renew();
        tokio::time::sleep(Duration::from_millis(2000)).await;
        assert!(!g.is_lost(), "{}", db.name);
        assert!(
            l.lock("h").await.unwrap_err().is_busy(),
            "{}: renewed lease lapsed",
            db.name
        );
        g.release().await.unwrap();
        let after = l.inspect("h").await.unwrap().unwrap();
        tokio::time::sleep(Duration::from_millis(700)).await;
        let later = l.inspect("h").await.unwrap().unwrap();
        assert_eq!(
            after.expires_at, later.expires_at,
            "{}: renewed after release",
            db.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_renewal_the_lease_simply_ends_at_its_ttl() {
    #[distributed_lock(key = "short", locker = locker, ttl = "500ms", renew = false)]
    async fn short(locker: &Locker) -> Result<(), LockError> {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        Ok(())
    }
    let (dbs, _dir) = common::all("norenew").await;
    for db in &dbs {
        let l = db.locker.clone();
        let body = tokio::spawn(async move { short(&l).await });
        tokio::time::sleep(Duration::from_millis(800)).await;
        let g = db
            .locker
            .lock("short")
            .await
            .expect("the lease ended at its ttl");
        g.release().await.unwrap();
        body.await.unwrap().expect("the body itself completes");
    }
}

#[distributed_lock(key = "victim", locker = locker, ttl = "900ms")]
async fn victim(locker: &Locker, reached_end: &AtomicBool) -> Result<(), LockError> {
    tokio::time::sleep(Duration::from_secs(5)).await;
    reached_end.store(true, Ordering::SeqCst);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_release_during_a_body_cancels_it_with_lost() {
    let (dbs, _dir) = common::all("lost").await;
    for db in &dbs {
        let reached_end = Arc::new(AtomicBool::new(false));
        let (l, flag) = (db.locker.clone(), reached_end.clone());
        let started = Instant::now();
        let body = tokio::spawn(async move { victim(&l, &flag).await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            db.locker.force_release("victim").await.unwrap(),
            "{}",
            db.name
        );
        // Someone else takes it right away.
        let thief = db
            .locker
            .lock("victim")
            .ttl(Duration::from_secs(30))
            .await
            .unwrap();
        let outcome = body.await.unwrap();
        assert!(
            matches!(outcome, Err(LockError::Lost { .. })),
            "{}: {outcome:?}",
            db.name
        );
        assert!(
            !reached_end.load(Ordering::SeqCst),
            "{}: body ran on after losing the lock",
            db.name
        );
        // Detected by the next renewal: within about ttl/3 of the theft.
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{}: took {:?}",
            db.name,
            started.elapsed()
        );
        // No renewal afterwards: the thief's lease is untouched by the old owner.
        let before = db.locker.inspect("victim").await.unwrap().unwrap();
        tokio::time::sleep(Duration::from_millis(800)).await;
        let after = db.locker.inspect("victim").await.unwrap().unwrap();
        assert_eq!(before.expires_at, after.expires_at, "{}", db.name);
        assert_eq!(after.owner.as_deref(), Some(thief.owner().id()));
        thief.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handle_api_reports_a_lost_lock() {
    let (dbs, _dir) = common::all("losth").await;
    for db in &dbs {
        let g = db
            .locker
            .lock("x")
            .ttl(Duration::from_millis(900))
            .await
            .unwrap()
            .auto_renew();
        db.locker.force_release("x").await.unwrap();
        let lost = tokio::time::timeout(Duration::from_secs(3), g.lost())
            .await
            .expect("lost resolves");
        assert!(lost.is_lost(), "{}", db.name);
        assert!(g.is_lost());
        assert!(matches!(g.release().await, Err(LockError::NotHeld { .. })));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_leases_are_renewed_together() {
    let (dbs, _dir) = common::all("many").await;
    for db in &dbs {
        let mut guards = Vec::new();
        for i in 0..40 {
            let g = db
                .locker
                .lock(format!("m{i}"))
                .ttl(Duration::from_millis(900))
                .await
                .unwrap();
            guards.push(g.auto_renew());
        }
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert_eq!(
            db.locker.held().await.unwrap().len(),
            40,
            "{}: some leases lapsed",
            db.name
        );
        assert!(guards.iter().all(|g| !g.is_lost()));
        for g in guards {
            g.release().await.unwrap();
        }
        assert!(db.locker.held().await.unwrap().is_empty());
    }
}
