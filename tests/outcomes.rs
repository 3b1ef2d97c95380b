//! Work that runs once: every hold's outcome recorded by its release, `once`, `min_hold`,
//! `reset`, `shutdown`, and migrating a table made before these columns existed — on every
//! backend.

mod common;

use std::time::{Duration, Instant, SystemTime};

use dblock::{LockError, Locker, Outcome, Owner};

const SEC: Duration = Duration::from_secs(1);

/// The backend's locker on a table of its own (mariadb and mysql8-path share the one of
/// `common::all`, and these tests look at rows by key).
async fn outcome(l: &Locker, key: &str) -> (Option<Outcome>, Option<SystemTime>) {
    let info = l.inspect(key).await.unwrap().expect("row");
    (info.last_outcome, info.finished_at)
}

/// The outcome of `key` once the background release of a dropped guard has ended (its row no
/// longer held), within 5 s.
async fn settled_outcome(l: &Locker, key: &str) -> Option<Outcome> {
    let until = Instant::now() + 5 * SEC;
    loop {
        let info = l.inspect(key).await.unwrap().expect("row");
        if !info.held || Instant::now() > until {
            return info.last_outcome;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_release_records_how_the_hold_ended() {
    let (dbs, _dir) = common::all("outcome_paths").await;
    for db in &dbs {
        let l = &common::own_table(db, "outcome_paths").await;
        let before = SystemTime::now() - SEC;
        l.lock("ok").await.unwrap().release().await.unwrap();
        let (o, at) = outcome(l, "ok").await;
        assert_eq!(o, Some(Outcome::Succeeded), "{}", db.name);
        assert!(at.is_some_and(|t| t > before), "{}: {at:?}", db.name);

        l.lock("failed")
            .await
            .unwrap()
            .release_failed()
            .await
            .unwrap();
        assert_eq!(
            outcome(l, "failed").await.0,
            Some(Outcome::Failed),
            "{}",
            db.name
        );

        drop(l.lock("dropped").await.unwrap());
        assert!(common::time_until_free(l, "dropped", 5 * SEC)
            .await
            .is_some());
        // time_until_free took and released it again: look at a key dropped and left alone.
        // A guard dropped the ordinary way says nothing of the work: `Dropped`, not `Failed`.
        drop(l.lock("dropped2").await.unwrap());
        assert_eq!(
            settled_outcome(l, "dropped2").await,
            Some(Outcome::Dropped),
            "{}",
            db.name
        );
        // Dropped while its thread panics (the work did not finish): `Failed`.
        let g = l.lock("panicked").await.unwrap();
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _g = g;
            panic!("the work under the guard panicked");
        }));
        assert!(unwound.is_err());
        assert_eq!(
            settled_outcome(l, "panicked").await,
            Some(Outcome::Failed),
            "{}",
            db.name
        );

        let g = l.lock("forced").await.unwrap();
        assert!(l.force_release("forced").await.unwrap());
        assert_eq!(
            outcome(l, "forced").await.0,
            Some(Outcome::Failed),
            "{}",
            db.name
        );
        assert!(g.release().await.is_err());

        // A lease that ran out, taken over by another owner: recorded as failed, at its end.
        // (A lease of 1 s: with 200 ms, a commit stalled on a loaded CI machine delivered the
        // grant too late for its lease, and the call rightly answered `Lost`.)
        let g = l.lock("ranout").ttl(SEC).await.unwrap();
        let ends = g.expires_at();
        std::mem::forget(g); // as if the holder had died
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let next = l.lock("ranout").await.unwrap();
        let (o, at) = outcome(l, "ranout").await;
        assert_eq!(o, Some(Outcome::Failed), "{}", db.name);
        let at = at.unwrap();
        // At the lease's end, not at the take-over 300 ms later. (Where the guard's lease end
        // is the client's estimate, from the send, the two differ by the statement's delay
        // before it ran: 50 ms was within reach of a loaded machine.)
        let off = at.duration_since(ends).unwrap_or_else(|e| e.duration());
        assert!(
            off < Duration::from_millis(200),
            "{}: ended {at:?}, lease {ends:?}",
            db.name
        );
        next.release().await.unwrap();
        assert_eq!(
            outcome(l, "ranout").await.0,
            Some(Outcome::Succeeded),
            "{}",
            db.name
        );

        // Re-entry: only the last release of the tenure records.
        let me = Owner::new();
        let outer = l.lock("nested").owner(&me).await.unwrap();
        let inner = l.lock("nested").owner(&me).await.unwrap();
        inner.release_failed().await.unwrap();
        assert_eq!(outcome(l, "nested").await.0, None, "{}", db.name);
        outer.release().await.unwrap();
        assert_eq!(
            outcome(l, "nested").await.0,
            Some(Outcome::Succeeded),
            "{}",
            db.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_runs_until_the_work_succeeds() {
    let (dbs, _dir) = common::all("outcome_once").await;
    for db in &dbs {
        let l = &common::own_table(db, "outcome_once").await;
        // Failed: runnable again.
        l.lock("pay")
            .once()
            .await
            .unwrap()
            .release_failed()
            .await
            .unwrap();
        // Dropped (nothing said about the work): not done, runnable again.
        drop(l.lock("pay").once().await.unwrap());
        assert_eq!(
            settled_outcome(l, "pay").await,
            Some(Outcome::Dropped),
            "{}",
            db.name
        );
        // In progress elsewhere: busy, not done.
        let running = l.lock("pay").once().await.unwrap();
        let busy = l.lock("pay").once().await.unwrap_err();
        assert!(busy.is_busy(), "{}: {busy:?}", db.name);
        running.release().await.unwrap();
        // Succeeded: done, for good.
        for _ in 0..2 {
            match l.lock("pay").once().wait(SEC).await {
                Err(LockError::AlreadyDone { key, finished_at }) => {
                    assert_eq!(key, "pay");
                    if db.name != "mysql8-path" {
                        assert!(finished_at.is_some(), "{}", db.name);
                    }
                }
                other => panic!("{}: a done key was taken: {other:?}", db.name),
            }
        }
        // A plain lock is not refused (it is not `once` work).
        l.lock("pay").await.unwrap().release_failed().await.unwrap();
        assert!(
            l.lock("pay").once().await.is_ok(),
            "{}: after a failure",
            db.name
        );

        // A crashed holder's expired lease counts as a failure.
        let g = l
            .lock("crash")
            .once()
            .ttl(Duration::from_millis(500))
            .await
            .unwrap();
        std::mem::forget(g);
        tokio::time::sleep(Duration::from_millis(600)).await;
        let again = l.lock("crash").once().await;
        assert!(again.is_ok(), "{}: {again:?}", db.name);
        again.unwrap().release().await.unwrap();
        assert!(matches!(
            l.lock("crash").once().await,
            Err(LockError::AlreadyDone { .. })
        ));

        // The same after a success: a later holder (a plain lock) that crashes ended in
        // failure, whatever the hold before it did. `inspect` says so before anyone takes the
        // key over, and `once` runs the work again.
        l.lock("crash-after-ok")
            .once()
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        let g = l
            .lock("crash-after-ok")
            .ttl(Duration::from_millis(500))
            .await
            .unwrap();
        let lease_end = g.expires_at();
        std::mem::forget(g);
        tokio::time::sleep(Duration::from_millis(600)).await;
        let (last, finished) = outcome(l, "crash-after-ok").await;
        assert_eq!(
            last,
            Some(Outcome::Failed),
            "{}: a lease that ran out",
            db.name
        );
        if db.name != "mysql8-path" {
            // (the MySQL 8 path's expires_at() is the client's estimate)
            let finished = finished.expect("finished_at");
            let off = finished
                .duration_since(lease_end)
                .unwrap_or_else(|e| e.duration());
            assert!(
                off < Duration::from_millis(5),
                "{}: finished at the lease end, {off:?} off",
                db.name
            );
        }
        let again = l.lock("crash-after-ok").once().await;
        assert!(
            again.is_ok(),
            "{}: a crashed run is not done: {again:?}",
            db.name
        );
        again.unwrap().release().await.unwrap();

        // An operator resets it: runnable again.
        assert!(l.reset("crash").await.unwrap(), "{}", db.name);
        assert_eq!(outcome(l, "crash").await.0, None);
        l.lock("crash")
            .once()
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        // A held key is not reset.
        let held = l.lock("held").await.unwrap();
        assert!(!l.reset("held").await.unwrap(), "{}", db.name);
        held.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_hold_keeps_a_released_key_unavailable_to_others() {
    let (dbs, _dir) = common::all("outcome_min_hold").await;
    for db in &dbs {
        let l = &common::own_table(db, "outcome_min_hold").await;
        let started = Instant::now();
        let g = l.lock("job").min_hold(SEC).await.unwrap();
        g.release().await.unwrap();
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "{}: the holder's release waited",
            db.name
        );
        assert!(
            l.lock("job").await.unwrap_err().is_busy(),
            "{}: free before min_hold",
            db.name
        );
        let next = l.lock("job").wait(3 * SEC).await.unwrap();
        let after = started.elapsed();
        assert!(
            after >= Duration::from_millis(950) && after < Duration::from_millis(1800),
            "{}: available after {after:?}",
            db.name
        );
        next.release().await.unwrap();

        // The owner that released it waits too: its next call is a new hold, not a re-entry.
        let me = dblock::Owner::new();
        let g = l.lock("own").owner(&me).min_hold(60 * SEC).await.unwrap();
        g.release().await.unwrap();
        assert!(
            l.lock("own").owner(&me).await.unwrap_err().is_busy(),
            "{}: the releasing owner took the key back before min_hold",
            db.name
        );

        // A holder that dies keeps the key for min_hold too, even past its ttl.
        let started = Instant::now();
        let g = l
            .lock("crash")
            .ttl(Duration::from_millis(500))
            .min_hold(Duration::from_millis(1200))
            .await
            .unwrap();
        std::mem::forget(g);
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert!(l.lock("crash").await.unwrap_err().is_busy(), "{}", db.name);
        let next = l.lock("crash").wait(3 * SEC).await.unwrap();
        assert!(
            started.elapsed() >= Duration::from_millis(1150),
            "{}",
            db.name
        );
        next.release().await.unwrap();

        // An operator can end the wait.
        l.lock("reset")
            .min_hold(30 * SEC)
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        assert!(l.lock("reset").await.unwrap_err().is_busy());
        assert!(l.reset("reset").await.unwrap());
        l.lock("reset").await.unwrap().release().await.unwrap();
    }
}

#[dblock::distributed_lock(key = "body:{n}", locker = locker, renew = false, ttl = "30s")]
async fn quiet_body(locker: &Locker, n: u32) -> Result<(), LockError> {
    tokio::time::sleep(Duration::from_secs(3600)).await;
    let _ = n;
    Ok(())
}

#[dblock::distributed_lock(key = "body:{n}", locker = locker, ttl = "2s")]
async fn renewed_body(locker: &Locker, n: u32) -> Result<(), LockError> {
    tokio::time::sleep(Duration::from_secs(3600)).await;
    let _ = n;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_gives_every_key_back_at_once() {
    let (dbs, _dir) = common::all("outcome_shutdown").await;
    for db in &dbs {
        let other = &db.locker;
        let mine = common::connect(db).await.table(other.table_name());
        let held: Vec<_> = futures_join(&mine, 3).await;
        let renewed = mine
            .lock("renewed")
            .ttl(2 * SEC)
            .await
            .unwrap()
            .auto_renew();
        let (m1, m2) = (mine.clone(), mine.clone());
        let body1 = tokio::spawn(async move { quiet_body(&m1, 1).await });
        let body2 = tokio::spawn(async move { renewed_body(&m2, 2).await });
        tokio::time::sleep(Duration::from_millis(300)).await;

        let started = Instant::now();
        mine.shutdown().await;
        let took = started.elapsed();
        assert!(took < SEC, "{}: shutdown took {took:?}", db.name);
        for key in ["k0", "k1", "k2", "renewed", "body:1", "body:2"] {
            let g = other.lock(key).await.unwrap_or_else(|e| {
                panic!("{}: {key} not free right after shutdown: {e}", db.name)
            });
            assert_eq!(
                outcome(other, key).await.0,
                Some(Outcome::Failed),
                "{}: {key}",
                db.name
            );
            g.release().await.unwrap();
        }
        for body in [body1, body2] {
            let out = tokio::time::timeout(SEC, body)
                .await
                .expect("body ended")
                .unwrap();
            assert!(
                matches!(out, Err(LockError::Lost { .. })),
                "{}: {out:?}",
                db.name
            );
        }
        assert!(matches!(mine.lock("x").await, Err(LockError::ShutDown)));
        assert!(matches!(mine.inspect("x").await, Err(LockError::ShutDown)));
        // Shut down before bad input: the locker's state is said first, whatever the input.
        assert!(matches!(mine.inspect("").await, Err(LockError::ShutDown)));
        assert!(matches!(
            mine.purge(std::time::Duration::MAX).await,
            Err(LockError::ShutDown)
        ));
        for g in held {
            assert!(matches!(g.release().await, Err(LockError::ShutDown)));
        }
        assert!(renewed.is_lost());
        mine.shutdown().await; // idempotent
    }
}

/// `shutdown` covers the locker's `table()` copies (their holds, their later calls), and a call
/// still waiting for a key when it runs ends with `ShutDown` instead of taking the key later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_covers_table_copies_and_waiting_calls() {
    let (dbs, _dir) = common::all("outcome_shutdown_copies").await;
    for db in &dbs {
        let other = &db.locker;
        let other_b = &common::own_table(db, "outcome_shutdown_copies_b").await;
        let base = common::connect(db).await;
        let mine = base.table(other.table_name());
        let mine_b = base.table(other_b.table_name());
        let held_b = mine_b.lock("b").ttl(30 * SEC).await.unwrap();
        let busy = other.lock("wanted").ttl(30 * SEC).await.unwrap();
        let waiter = {
            let mine = mine.clone();
            tokio::spawn(async move { mine.lock("wanted").wait(10 * SEC).await.map(|_| ()) })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;

        mine.shutdown().await;
        // The copy's hold went back with the rest, recorded as failed.
        let g = other_b
            .lock("b")
            .await
            .unwrap_or_else(|e| panic!("{}: a table copy's key still held: {e}", db.name));
        assert_eq!(
            outcome(other_b, "b").await.0,
            Some(Outcome::Failed),
            "{}",
            db.name
        );
        g.release().await.unwrap();
        assert!(
            matches!(mine_b.lock("x").await, Err(LockError::ShutDown)),
            "{}: a table copy still takes locks",
            db.name
        );
        assert!(matches!(held_b.release().await, Err(LockError::ShutDown)));
        // The waiting call ends, without the key, as soon as its next attempt would go out.
        busy.release().await.unwrap();
        let waited = tokio::time::timeout(2 * SEC, waiter)
            .await
            .expect("a waiting call outlived the shutdown")
            .unwrap();
        assert!(
            matches!(waited, Err(LockError::ShutDown)),
            "{}: {waited:?}",
            db.name
        );
        let info = other.inspect("wanted").await.unwrap().unwrap();
        assert!(
            !info.held,
            "{}: the waiter took the key after shutdown",
            db.name
        );
    }
}

async fn futures_join(l: &Locker, n: usize) -> Vec<dblock::LockGuard> {
    let mut out = Vec::new();
    for i in 0..n {
        out.push(l.lock(format!("k{i}")).ttl(30 * SEC).await.unwrap());
    }
    out
}

/// A table made by 0001 alone (before outcomes and min_hold) gets 0002 from `migrate()`.
#[tokio::test]
async fn migrate_upgrades_a_table_from_before_outcomes() {
    let (dbs, _dir) = common::all("outcome_upgrade").await;
    for db in dbs.iter().filter(|d| d.name != "mysql8-path") {
        let table = common::table_for("old_schema");
        common::create_with_0001(db, &table).await;
        let l = db.locker.table(&table);
        l.migrate().await.unwrap();
        l.migrate().await.unwrap();
        l.lock("k").once().await.unwrap().release().await.unwrap();
        assert_eq!(
            outcome(&l, "k").await.0,
            Some(Outcome::Succeeded),
            "{}",
            db.name
        );
    }
}

/// `drain`: nothing new is taken (a new call, and a call waiting for a key, end with
/// `ShutDown`), the work already under a lock runs to its end (its re-entry still granted), and
/// the locker shuts down once it has; a hold still live when the grace runs out is released
/// by the shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_lets_running_work_finish_then_shuts_down() {
    let (dbs, _dir) = common::all("outcome_drain").await;
    for db in &dbs {
        let other = &db.locker;
        let mine = common::connect(db).await.table(other.table_name());
        // The running job: 1.4 s of work, re-entering its key half-way (a nested call).
        let job = {
            let mine = mine.clone();
            tokio::spawn(async move {
                let g = mine.lock("job").ttl(30 * SEC).await?;
                tokio::time::sleep(Duration::from_millis(700)).await;
                let again = mine.lock("job").owner(g.owner()).await?;
                assert_eq!(again.hold_count(), 2);
                again.release().await?;
                tokio::time::sleep(Duration::from_millis(700)).await;
                g.release().await
            })
        };
        let busy = other.lock("wanted").ttl(30 * SEC).await.unwrap();
        let waiter = {
            let mine = mine.clone();
            tokio::spawn(async move { mine.lock("wanted").wait(10 * SEC).await.map(|_| ()) })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;

        let started = Instant::now();
        let draining = {
            let mine = mine.clone();
            tokio::spawn(async move { mine.drain(20 * SEC).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            matches!(mine.lock("new").await, Err(LockError::ShutDown)),
            "{}: a new hold while draining",
            db.name
        );
        busy.release().await.unwrap();
        let waited = tokio::time::timeout(2 * SEC, waiter)
            .await
            .expect("a waiting call outlived the drain's start")
            .unwrap();
        assert!(
            matches!(waited, Err(LockError::ShutDown)),
            "{}: {waited:?}",
            db.name
        );
        assert_eq!(draining.await.unwrap(), 0, "{}: the job was cut", db.name);
        let took = started.elapsed();
        job.await
            .unwrap()
            .unwrap_or_else(|e| panic!("{}: the running job failed: {e}", db.name));
        assert!(took > Duration::from_millis(900), "{}: {took:?}", db.name);
        assert_eq!(
            outcome(other, "job").await.0,
            Some(Outcome::Succeeded),
            "{}",
            db.name
        );
        assert!(!other.inspect("wanted").await.unwrap().unwrap().held);
        assert!(matches!(mine.lock("x").await, Err(LockError::ShutDown)));

        // Work that outlasts the grace: released when it runs out.
        let cut = common::connect(db).await.table(other.table_name());
        let long = cut.lock("long").ttl(30 * SEC).await.unwrap();
        let started = Instant::now();
        assert_eq!(
            cut.drain(Duration::from_millis(300)).await,
            1,
            "{}",
            db.name
        );
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(300), "{}: {took:?}", db.name);
        let g = other
            .lock("long")
            .await
            .unwrap_or_else(|e| panic!("{}: still held after the drain: {e}", db.name));
        g.release().await.unwrap();
        assert!(matches!(long.release().await, Err(LockError::ShutDown)));
    }
}
