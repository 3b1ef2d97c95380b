//! Behaviour of the runtime API against every backend: real PostgreSQL and MariaDB servers and a
//! SQLite file. Each test runs its scenario once per reachable backend.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use dblock::{LockError, Locker, Owner};

const SEC: Duration = Duration::from_secs(1);

#[tokio::test]
async fn acquire_inspect_release() {
    let (dbs, _dir) = common::all("basic").await;
    for db in &dbs {
        let l = &db.locker;
        let before = SystemTime::now() - Duration::from_secs(5);
        let g = l.lock("basic").ttl(Duration::from_secs(30)).await.unwrap();
        assert_eq!(g.key(), "basic", "{}", db.name);
        assert_eq!(g.hold_count(), 1, "{}", db.name);
        assert!(
            g.expires_at() > before + Duration::from_secs(30),
            "{}: {:?}",
            db.name,
            g.expires_at()
        );

        let info = l.inspect("basic").await.unwrap().expect("row");
        assert!(info.held, "{}", db.name);
        assert_eq!(info.key, "basic");
        assert_eq!(info.owner.as_deref(), Some(g.owner().id()), "{}", db.name);
        assert_eq!(info.hold_count, 1);
        assert_eq!(info.fencing_token, g.fencing_token(), "{}", db.name);
        assert!(
            info.time_left > Duration::from_secs(25),
            "{}: {:?}",
            db.name,
            info.time_left
        );
        assert!(info
            .holder
            .as_deref()
            .unwrap_or("")
            .contains(&std::process::id().to_string()));

        g.release().await.unwrap();
        let info = l
            .inspect("basic")
            .await
            .unwrap()
            .expect("row kept when free");
        assert!(!info.held, "{}", db.name);
        assert_eq!(info.owner, None);
        assert_eq!(info.hold_count, 0);
        assert!(l.inspect("never-used").await.unwrap().is_none());
    }
}

#[tokio::test]
async fn a_held_key_is_busy_for_everyone_else() {
    let (dbs, _dir) = common::all("busy").await;
    for db in &dbs {
        let l = &db.locker;
        let g = l.lock("k").await.unwrap();
        let started = Instant::now();
        match l.lock("k").await {
            Err(LockError::Busy { key, waited }) => {
                assert_eq!(key, "k");
                assert!(waited < SEC, "{}: nowait took {waited:?}", db.name);
            }
            other => panic!("{}: expected Busy, got {other:?}", db.name),
        }
        // A second call in the same task, outside any owner scope, is another owner too.
        assert!(l.lock("k").await.unwrap_err().is_busy());
        assert!(started.elapsed() < 2 * SEC);
        // The holder is untouched by the refused attempts.
        let info = l.inspect("k").await.unwrap().unwrap();
        assert_eq!(
            (info.hold_count, info.fencing_token),
            (1, g.fencing_token()),
            "{}",
            db.name
        );
        g.release().await.unwrap();
        l.lock("k")
            .await
            .expect("free after release")
            .release()
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn reentry_counts_holds_in_the_row() {
    let (dbs, _dir) = common::all("reentry").await;
    for db in &dbs {
        let l = db.locker.clone();
        let owner = Owner::new();
        let name = db.name;
        owner
            .scope(async move {
                assert_eq!(
                    Owner::current().map(|o| o.id().to_owned()),
                    Some(Owner::current().unwrap().id().to_owned())
                );
                let a = l.lock("r").await.unwrap();
                let b = l.lock("r").await.unwrap();
                let c = l.lock("r").await.unwrap();
                assert_eq!(
                    (a.hold_count(), b.hold_count(), c.hold_count()),
                    (1, 2, 3),
                    "{name}"
                );
                assert_eq!(
                    a.fencing_token(),
                    c.fencing_token(),
                    "{name}: re-entry keeps the token"
                );
                assert_eq!(
                    l.inspect("r").await.unwrap().unwrap().hold_count,
                    3,
                    "{name}"
                );

                // Another owner is still excluded.
                assert!(
                    Owner::new().scope(l.lock("r")).await.unwrap_err().is_busy(),
                    "{name}"
                );

                c.release().await.unwrap();
                assert_eq!(
                    l.inspect("r").await.unwrap().unwrap().hold_count,
                    2,
                    "{name}"
                );
                // Out of order is fine: counts, not a stack.
                a.release().await.unwrap();
                assert_eq!(
                    l.inspect("r").await.unwrap().unwrap().hold_count,
                    1,
                    "{name}"
                );
                b.release().await.unwrap();
                let info = l.inspect("r").await.unwrap().unwrap();
                assert!(!info.held && info.hold_count == 0, "{name}: {info:?}");
            })
            .await;
    }
}

/// `reentrant(false)`: the owner's own hold is busy to the call, as another owner's is (one key
/// and `lock_all`); the call waits for it and then starts a new tenure. The default re-enters.
#[tokio::test]
async fn reentrant_false_finds_the_owners_own_hold_busy() {
    let (dbs, _dir) = common::all("no_reentry").await;
    for db in &dbs {
        let (l, name) = (&db.locker, db.name);
        let me = Owner::new();
        let first = l.lock("nr").owner(&me).await.unwrap();
        let err = l.lock("nr").owner(&me).reentrant(false).await.unwrap_err();
        assert!(err.is_busy(), "{name}: {err}");
        // The free key first: taken, then given back at the held one.
        let err = l
            .lock_all(["a-nr", "nr"])
            .owner(&me)
            .reentrant(false)
            .await
            .unwrap_err();
        assert!(
            matches!(&err, LockError::Busy { key, .. } if key == "nr"),
            "{name}: {err}"
        );
        assert!(
            !l.inspect("a-nr").await.unwrap().is_some_and(|i| i.held),
            "{name}: lock_all kept nothing"
        );
        assert_eq!(
            l.inspect("nr").await.unwrap().unwrap().hold_count,
            1,
            "{name}: a refused re-entry changes nothing"
        );
        let again = l.lock("nr").owner(&me).await.unwrap();
        assert_eq!(again.hold_count(), 2, "{name}: the default re-enters");
        again.release().await.unwrap();

        let (l2, me2) = (l.clone(), me.clone());
        let waiter = tokio::spawn(async move {
            l2.lock("nr")
                .owner(&me2)
                .reentrant(false)
                .wait(30 * SEC)
                .await
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !waiter.is_finished(),
            "{name}: the call waits for its own owner's hold"
        );
        let token = first.fencing_token();
        first.release().await.unwrap();
        let got = waiter.await.unwrap().unwrap();
        assert_eq!(got.hold_count(), 1, "{name}: a hold of its own");
        assert!(got.fencing_token() > token, "{name}: a new tenure");
        got.release().await.unwrap();

        // A hold whose lease ran out no longer counts, its guard still alive: a new tenure.
        let lapsed = l
            .lock("nr-lapsed")
            .owner(&me)
            .ttl(Duration::from_millis(500))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(700)).await;
        let after = l
            .lock("nr-lapsed")
            .owner(&me)
            .reentrant(false)
            .await
            .unwrap();
        assert_eq!(after.hold_count(), 1, "{name}");
        assert!(after.fencing_token() > lapsed.fencing_token(), "{name}");
        drop(lapsed);
        after.release().await.unwrap();
    }
}

#[tokio::test]
async fn owner_scope_carries_into_spawned_tasks_and_explicit_owner_wins() {
    let (dbs, _dir) = common::all("scope").await;
    for db in &dbs {
        let l = db.locker.clone();
        let owner = Owner::new();
        let g = l.lock("s").owner(&owner).await.unwrap();
        let l2 = l.clone();
        let count =
            tokio::spawn(owner.scope(async move { l2.lock("s").await.map(|g| g.hold_count()) }))
                .await
                .unwrap()
                .unwrap();
        assert_eq!(count, 2, "{}", db.name);
        // A plain spawned task is a new owner.
        let l3 = l.clone();
        let other = tokio::spawn(async move { l3.lock("s").await.map(|g| g.hold_count()) })
            .await
            .unwrap();
        assert!(other.unwrap_err().is_busy(), "{}", db.name);
        g.release().await.unwrap();
    }
}

/// `purge(ZERO)` right after a release deletes the row every time, whichever millisecond
/// (SQLite's tick) the release, the DELETE and the read of what it kept fall in: the clock
/// turning between the DELETE and that read once left the row kept and `0` returned.
#[tokio::test]
async fn purge_of_a_key_just_freed_deletes_it_every_time() {
    let (dbs, _dir) = common::all("purge_just_freed").await;
    for db in &dbs {
        let l = &db.locker;
        let mut last = 0u64;
        // SQLite's tick is a millisecond: about one round in twenty met the turn there. The
        // servers' is a microsecond; a few rounds check their statements.
        let rounds = if db.name == "sqlite" { 150 } else { 10 };
        for round in 0..rounds {
            let g = l.lock("pj").await.unwrap();
            assert!(g.fencing_token() > last, "{} round {round}", db.name);
            last = g.fencing_token();
            g.release().await.unwrap();
            assert_eq!(
                l.purge(Duration::ZERO).await.unwrap(),
                1,
                "{} round {round}: the free row is deleted",
                db.name
            );
        }
    }
}

#[tokio::test]
async fn fencing_tokens_strictly_increase_across_owners_and_purges() {
    let (dbs, _dir) = common::all("fencing").await;
    for db in &dbs {
        let l = &db.locker;
        let mut last = 0u64;
        for round in 0..6 {
            let g = l.lock("f").await.unwrap();
            assert!(
                g.fencing_token() > last,
                "{} round {round}: {} <= {last}",
                db.name,
                g.fencing_token()
            );
            last = g.fencing_token();
            g.release().await.unwrap();
            if round % 2 == 1 {
                assert_eq!(
                    l.purge(Duration::ZERO).await.unwrap(),
                    1,
                    "{}: purge deletes the free row",
                    db.name
                );
                assert!(l.inspect("f").await.unwrap().is_none());
            }
        }
        // Freed and purged at once (on SQLite, likely within the clock's millisecond).
        let g = l.lock("f").await.unwrap();
        assert!(g.fencing_token() > last, "{}", db.name);
        last = g.fencing_token();
        g.release().await.unwrap();
        assert_eq!(l.purge(Duration::ZERO).await.unwrap(), 1, "{}", db.name);
        let g = l.lock("f").await.unwrap();
        assert!(g.fencing_token() > last, "{}: a token back", db.name);
        last = g.fencing_token();
        g.release().await.unwrap();
        // Seeded from the database clock in µs: comparable to wall-clock µs.
        let now_us = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64;
        assert!(
            last > now_us - 3_600_000_000 && last < now_us + 3_600_000_000,
            "{}: {last}",
            db.name
        );
    }
}

/// A failover to a standby that had not received the last commits (asynchronous replication)
/// rolls a key's row back to an older token. The tokens handed out before it must not be handed
/// out again after it: every new tenure's token is at least the database clock in µs, so the
/// first takeover after the failover starts above every token issued before it. Simulated by
/// writing the row's older token back (what the promoted standby would hold), per kind of hold.
#[tokio::test]
async fn tokens_lost_to_a_rolled_back_failover_are_never_issued_again() {
    let (dbs, _dir) = common::all("rollback").await;
    for db in &dbs {
        let table = common::table_for("rollback");
        let l = db.locker.table(&table);
        l.migrate().await.unwrap();
        let pause = || tokio::time::sleep(Duration::from_millis(3));
        // `take` grants `key` (a row key prefix for a semaphore), returns its token, releases.
        macro_rules! case {
            ($kind:expr, $key:expr, $take:expr) => {{
                let first = $take;
                pause().await;
                let lost = $take;
                assert!(lost > first, "{} {}", db.name, $kind);
                // The failover: the promoted node has the row as it was after `first`.
                common::run_sql(
                    db.name,
                    &db.url,
                    &format!(
                        "UPDATE {table} SET fencing_token = {first} WHERE lock_key LIKE '{}%'",
                        $key
                    ),
                )
                .await;
                pause().await;
                let next = $take;
                assert!(
                    next > lost,
                    "{} {}: token {next} after a rollback to {first}, {lost} was issued before",
                    db.name,
                    $kind
                );
            }};
        }
        case!("lock", "k", {
            let g = l.lock("k").await.unwrap();
            let t = g.fencing_token();
            g.release().await.unwrap();
            t
        });
        case!("read", "r", {
            let g = l.read("r").await.unwrap();
            let t = g.fencing_token();
            g.release().await.unwrap();
            t
        });
        case!("semaphore", "s", {
            let g = l.semaphore("s", 1).await.unwrap();
            let t = g.fencing_token();
            g.release().await.unwrap();
            t
        });
        case!("lock_all", "m", {
            let gs = l.lock_all(["m1", "m2"]).await.unwrap();
            let t = gs.iter().map(|g| g.fencing_token()).min().unwrap();
            for g in gs {
                g.release().await.unwrap();
            }
            t
        });
    }
}

#[tokio::test]
async fn an_expired_lease_is_free_and_its_old_owner_is_refused() {
    let (dbs, _dir) = common::all("expiry").await;
    for db in &dbs {
        let l = &db.locker;
        let old = l.lock("e").ttl(Duration::from_millis(300)).await.unwrap();
        assert!(l.lock("e").await.unwrap_err().is_busy(), "{}", db.name);
        tokio::time::sleep(Duration::from_millis(450)).await;
        let info = l.inspect("e").await.unwrap().unwrap();
        assert!(!info.held, "{}: expired lease still reported held", db.name);

        let new = l.lock("e").await.expect("expired lease is free");
        assert!(new.fencing_token() > old.fencing_token(), "{}", db.name);
        assert!(
            matches!(old.extend(SEC).await, Err(LockError::NotHeld { .. })),
            "{}",
            db.name
        );
        assert!(
            matches!(old.release().await, Err(LockError::NotHeld { .. })),
            "{}",
            db.name
        );
        // The refused release changed nothing of the new owner's hold.
        let info = l.inspect("e").await.unwrap().unwrap();
        assert!(
            info.held && info.hold_count == 1 && info.owner.as_deref() == Some(new.owner().id())
        );
        new.release().await.unwrap();
    }
}

#[tokio::test]
async fn an_owner_whose_lease_expired_gets_a_new_tenure() {
    let (dbs, _dir) = common::all("retake").await;
    for db in &dbs {
        let l = &db.locker;
        let me = Owner::new();
        let first = l
            .lock("x")
            .owner(&me)
            .ttl(Duration::from_millis(500))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(650)).await;
        let second = l.lock("x").owner(&me).await.unwrap();
        assert_eq!(
            second.hold_count(),
            1,
            "{}: expired hold is not re-entered",
            db.name
        );
        assert!(
            second.fencing_token() > first.fencing_token(),
            "{}",
            db.name
        );
        // The old tenure's guard cannot touch the new one.
        assert!(first.release().await.is_err(), "{}", db.name);
        assert_eq!(
            l.inspect("x").await.unwrap().unwrap().hold_count,
            1,
            "{}",
            db.name
        );
        second.release().await.unwrap();
    }
}

#[tokio::test]
async fn extend_pushes_the_lease_and_never_shortens_it() {
    let (dbs, _dir) = common::all("extend").await;
    for db in &dbs {
        let l = &db.locker;
        let g = l.lock("x").ttl(Duration::from_millis(400)).await.unwrap();
        let first_end = g.expires_at();
        g.extend(Duration::from_secs(5)).await.unwrap();
        assert!(
            g.expires_at() > first_end + Duration::from_secs(3),
            "{}",
            db.name
        );
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(
            l.lock("x").await.unwrap_err().is_busy(),
            "{}: extended lease lapsed",
            db.name
        );
        let end = g.expires_at();
        g.extend(Duration::from_millis(100)).await.unwrap();
        assert!(
            g.expires_at() >= end,
            "{}: extend shortened the lease",
            db.name
        );
        assert!(l.inspect("x").await.unwrap().unwrap().time_left > SEC * 3);
        assert!(matches!(
            g.extend(Duration::ZERO).await,
            Err(LockError::Config(_))
        ));
        g.release().await.unwrap();
    }
}

#[tokio::test]
async fn keys_are_exact_byte_strings() {
    let (dbs, _dir) = common::all("keys").await;
    let tricky = [
        "a",
        "A",
        "a ",
        " a",
        "é",
        "e\u{301}",
        "'; DROP TABLE dblock_locks; --",
        "\" OR 1=1 -- `x` \\' %_",
        "SELECT * FROM dblock_locks WHERE lock_key = 'a'",
        "日本語のキー",
        // What a literal written into the statement text (PostgreSQL behind a pooler) must
        // survive: quotes, backslashes, placeholders, comment and dollar-quote openers.
        "\\",
        "'",
        "''",
        "\\'",
        "E'x'",
        "$1",
        "$$",
        "$q$",
        "-- not a comment",
        "/* not a comment",
        "line\nbreak\ttab\r",
    ];
    let max = "k".repeat(255);
    let quotes = "'".repeat(255);
    let backslashes = "\\".repeat(255);
    let longs = [max.as_str(), quotes.as_str(), backslashes.as_str()];
    for db in &dbs {
        let l = &db.locker;
        let owner = Owner::new();
        let mut guards = Vec::new();
        for key in tricky.iter().copied().chain(longs) {
            let g = l
                .lock(key)
                .owner(&owner)
                .await
                .unwrap_or_else(|e| panic!("{}: {key:?}: {e}", db.name));
            assert_eq!(
                g.hold_count(),
                1,
                "{}: {key:?} collided with another key",
                db.name
            );
            guards.push(g);
        }
        let held = l.held().await.unwrap();
        let mut keys: Vec<_> = held.iter().map(|i| i.key.clone()).collect();
        keys.sort();
        let mut want: Vec<String> = tricky
            .iter()
            .copied()
            .chain(longs)
            .map(str::to_owned)
            .collect();
        want.sort();
        assert_eq!(keys, want, "{}", db.name);
        for g in guards {
            g.release().await.unwrap();
        }
        assert!(l.held().await.unwrap().is_empty());
    }
}

#[tokio::test]
async fn bad_input_is_a_typed_error_and_writes_nothing() {
    let (dbs, _dir) = common::all("badinput").await;
    for db in &dbs {
        let l = &db.locker;
        let long = "x".repeat(256);
        for (key, ttl) in [("", SEC), (long.as_str(), SEC), ("nul\0byte", SEC)] {
            match l.lock(key).ttl(ttl).await {
                Err(LockError::InvalidKey { reason, .. }) => assert!(!reason.is_empty()),
                other => panic!("{}: {key:?}: expected InvalidKey, got {other:?}", db.name),
            }
        }
        match l.lock("zero-ttl").ttl(Duration::ZERO).await {
            Err(LockError::Config(msg)) => assert!(msg.contains("ttl"), "{msg}"),
            other => panic!("{}: expected Config, got {other:?}", db.name),
        }
        assert!(matches!(
            l.inspect("").await,
            Err(LockError::InvalidKey { .. })
        ));
        assert!(
            l.inspect("zero-ttl").await.unwrap().is_none(),
            "{}: zero ttl wrote a row",
            db.name
        );
        assert_eq!(
            l.purge(Duration::ZERO).await.unwrap(),
            0,
            "{}: rows were written",
            db.name
        );
        // A bad table name is reported, not panicked on, and does no harm.
        let bad = l.table("locks; DROP TABLE x");
        assert!(matches!(bad.lock("k").await, Err(LockError::Config(_))));
        assert!(matches!(bad.migrate().await, Err(LockError::Config(_))));
    }
}

#[tokio::test]
async fn waiting_acquires_after_release_and_gives_up_at_the_deadline() {
    let (dbs, _dir) = common::all("wait").await;
    for db in &dbs {
        let l = &db.locker;
        let g = l.lock("w").await.unwrap();
        let l2 = l.clone();
        let waiter = tokio::spawn(async move {
            let t = Instant::now();
            let g = l2
                .lock("w")
                .wait(Duration::from_secs(5))
                .await
                .map(|g| (t.elapsed(), g))?;
            Ok::<_, LockError>(g)
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        g.release().await.unwrap();
        let (took, g2) = waiter.await.unwrap().expect("waiter gets the lock");
        assert!(
            took >= Duration::from_millis(190) && took < Duration::from_secs(2),
            "{}: {took:?}",
            db.name
        );
        // The deadline: busy after about `wait`, never much past it.
        let wait = Duration::from_millis(400);
        match l.lock("w").wait(wait).await {
            Err(LockError::Busy { waited, .. }) => {
                assert!(
                    waited >= wait,
                    "{}: gave up early after {waited:?}",
                    db.name
                );
                // Through PgBouncer the attempt in flight at the deadline may sit in its queue
                // behind every other test's statements (3 server connections for all): the
                // call is then bounded by its hard cap, max(wait, 1 s), instead.
                let cap = if db.name == common::PGBOUNCER {
                    wait.max(SEC)
                } else {
                    wait
                };
                assert!(
                    waited < cap + Duration::from_millis(150),
                    "{}: overslept to {waited:?}",
                    db.name
                );
            }
            other => panic!("{}: {other:?}", db.name),
        }
        g2.release().await.unwrap();
    }
}

#[tokio::test]
async fn dropping_a_guard_releases_at_once() {
    let (dbs, _dir) = common::all("drop").await;
    for db in &dbs {
        let l = &db.locker;
        let g = l.lock("d").ttl(Duration::from_secs(60)).await.unwrap();
        drop(g);
        let took = common::time_until_free(l, "d", Duration::from_secs(5)).await;
        let took = took.unwrap_or_else(|| panic!("{}: not released after drop", db.name));
        assert!(
            took < Duration::from_millis(500),
            "{}: drop released after {took:?}",
            db.name
        );
    }
}

#[tokio::test]
async fn a_cancelled_acquire_leaves_no_hold_behind() {
    let (dbs, _dir) = common::all("cancel").await;
    for db in &dbs {
        let l = &db.locker;
        for i in 0..20 {
            let key = format!("c{i}");
            // Cancel after a varying slice of the round trip.
            let cut = Duration::from_micros(50 + 100 * i);
            let _ =
                tokio::time::timeout(cut, l.lock(key.as_str()).ttl(Duration::from_secs(60))).await;
            let took = common::time_until_free(l, &key, Duration::from_secs(5)).await;
            assert!(
                took.is_some(),
                "{}: key {key} orphaned by a cancelled acquire",
                db.name
            );
        }
    }
}

#[tokio::test]
async fn force_release_and_purge_for_operators() {
    let (dbs, _dir) = common::all("admin").await;
    for db in &dbs {
        let l = &db.locker;
        let stuck = l.lock("stuck").await.unwrap();
        let other = l.lock("other").await.unwrap();
        l.lock("free").await.unwrap().release().await.unwrap();
        let held: Vec<_> = l.held().await.unwrap().into_iter().map(|i| i.key).collect();
        assert_eq!(
            held,
            vec!["other".to_string(), "stuck".to_string()],
            "{}",
            db.name
        );

        assert!(l.force_release("stuck").await.unwrap(), "{}", db.name);
        assert!(
            !l.force_release("stuck").await.unwrap(),
            "{}: second force_release",
            db.name
        );
        assert!(!l.force_release("no-such-key").await.unwrap());
        assert!(
            matches!(stuck.release().await, Err(LockError::NotHeld { .. })),
            "{}",
            db.name
        );
        let next = l.lock("stuck").await.expect("free after force_release");
        assert!(next.fencing_token() > 0);

        // Nothing is purged that was freed less than an hour ago; held rows never.
        assert_eq!(
            l.purge(Duration::from_secs(3600)).await.unwrap(),
            0,
            "{}",
            db.name
        );
        assert_eq!(
            l.purge(Duration::ZERO).await.unwrap(),
            1,
            "{}: only `free` goes",
            db.name
        );
        assert!(l.inspect("other").await.unwrap().unwrap().held);
        other.release().await.unwrap();
        next.release().await.unwrap();
    }
}

#[tokio::test]
async fn migrate_is_idempotent_and_safe_in_parallel() {
    let (dbs, _dir) = common::all("migrate").await;
    for db in &dbs {
        let fresh = db.locker.table(&common::table_for("migrate_par"));
        let runs: Vec<_> = (0..8)
            .map(|_| {
                tokio::spawn({
                    let f = fresh.clone();
                    async move { f.migrate().await }
                })
            })
            .collect();
        for r in runs {
            r.await
                .unwrap()
                .unwrap_or_else(|e| panic!("{}: concurrent migrate: {e}", db.name));
        }
        fresh.migrate().await.unwrap();
        fresh.lock("k").await.unwrap().release().await.unwrap();
    }
}

/// 16 owners in one process doing read-modify-write on a counter that only the lock protects.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_owners_never_overlap() {
    let (dbs, _dir) = common::all("mutex16").await;
    for db in &dbs {
        let counter = Arc::new(AtomicU64::new(0));
        let tokens = Arc::new(Mutex::new(Vec::new()));
        let per_owner = 12;
        let tasks: Vec<_> = (0..16)
            .map(|_| {
                let (l, counter, tokens) = (db.locker.clone(), counter.clone(), tokens.clone());
                tokio::spawn(async move {
                    for _ in 0..per_owner {
                        let g = l
                            .lock("counter")
                            .wait(Duration::from_secs(60))
                            .await
                            .expect("lock");
                        let seen = counter.load(Ordering::SeqCst);
                        tokens.lock().unwrap().push(g.fencing_token());
                        tokio::task::yield_now().await;
                        tokio::time::sleep(Duration::from_micros(200)).await;
                        counter.store(seen + 1, Ordering::SeqCst);
                        g.release().await.expect("release");
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(
            counter.load(Ordering::SeqCst),
            16 * per_owner,
            "{}: lost updates",
            db.name
        );
        let tokens = tokens.lock().unwrap();
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "{}: tokens not strictly increasing",
            db.name
        );
    }
}

/// Named in the test output when this build leaves a backend out (see `common`).
#[cfg(not(feature = "postgres"))]
#[test]
#[ignore = "the PostgreSQL statement tests and the PostgreSQL half of \
            server_side_connection_kills_are_survived need `--features postgres` (or --all-features)"]
fn postgres_only_tests_need_the_postgres_feature() {}

/// Named in the test output when this build leaves MariaDB out (see `common`).
#[cfg(not(feature = "mysql"))]
#[test]
#[ignore = "the MariaDB half of server_side_connection_kills_are_survived needs `--features mysql` \
            (or --all-features)"]
fn mariadb_only_tests_need_the_mysql_feature() {}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_busy_attempts_write_nothing() {
    let (dbs, _dir) = common::all("pgquiet").await;
    let Some(db) = dbs.iter().find(|d| d.name == "postgres") else {
        return;
    };
    let g = db.locker.lock("hot").await.unwrap();
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let table = db.locker.table_name().to_owned();
    let q = format!("SELECT xmin::text, xmax::text FROM \"{table}\" WHERE lock_key = 'hot'");
    let before: (String, String) = sqlx::query_as(sqlx::AssertSqlSafe(q.clone()))
        .fetch_one(&pool)
        .await
        .unwrap();
    for _ in 0..50 {
        assert!(db.locker.lock("hot").await.unwrap_err().is_busy());
    }
    let after: (String, String) = sqlx::query_as(sqlx::AssertSqlSafe(q))
        .fetch_one(&pool)
        .await
        .unwrap();
    // No new row version (xmin) and no row lock left behind (xmax) by 50 busy attempts.
    assert_eq!(before, after);
    assert_eq!(after.1, "0", "a busy attempt locked the row");
    g.release().await.unwrap();
}

/// Lock statements stay correct and error-free on a pool whose connections default to
/// SERIALIZABLE: serialization failures are rolled back by the server and retried.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_serializable_pool_retries_serialization_failures() {
    if common::all("pgser")
        .await
        .0
        .iter()
        .all(|d| d.name != "postgres")
    {
        return;
    }
    use std::str::FromStr;
    let opts = sqlx::postgres::PgConnectOptions::from_str(&common::postgres_url())
        .unwrap()
        .options([("default_transaction_isolation", "serializable")]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect_with(opts)
        .await
        .unwrap();
    let l = Locker::postgres(pool).table(&common::table_for("pgser"));
    l.migrate().await.unwrap();
    let counter = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (l, counter) = (l.clone(), counter.clone());
            tokio::spawn(async move {
                for _ in 0..15 {
                    let g = l
                        .lock("hot")
                        .wait(Duration::from_secs(30))
                        .await
                        .expect("no error leaks out");
                    let v = counter.load(Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    counter.store(v + 1, Ordering::SeqCst);
                    g.release().await.expect("release");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(counter.load(Ordering::SeqCst), 120);
}

#[tokio::test]
async fn database_down_is_a_typed_error() {
    for (url, built) in [
        (
            "postgres://postgres@127.0.0.1:1/test",
            cfg!(feature = "postgres"),
        ),
        ("mysql://root@127.0.0.1:1/test", cfg!(feature = "mysql")),
        (
            "sqlite:///nonexistent-dir/for/dblock/locks.db",
            cfg!(feature = "sqlite"),
        ),
    ] {
        let started = Instant::now();
        match Locker::connect(url).await {
            // A port nothing listens on is named at once (not after the pool's 3 s of retries).
            Err(LockError::Database(e)) if built && !url.starts_with("sqlite") => {
                assert!(
                    e.to_string().to_lowercase().contains("refused"),
                    "{url}: {e}"
                );
                let took = started.elapsed();
                assert!(
                    took < Duration::from_millis(500),
                    "{url}: named after {took:?}"
                );
            }
            Err(LockError::Database(_)) if built => {}
            // A backend this build leaves out: said so, by name.
            Err(LockError::Config(msg)) if !built => {
                assert!(msg.contains("without the"), "{url}: {msg}")
            }
            other => panic!("{url}: expected a typed error, got {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(10));
    }
    match Locker::connect("redis://127.0.0.1/").await {
        Err(LockError::Config(msg)) => assert!(msg.contains("redis"), "{msg}"),
        other => panic!("{other:?}"),
    }
    match Locker::connect("postgres://user:hunter2@[::1:bad/db").await {
        Err(e) => assert!(!e.to_string().contains("hunter2"), "password leaked: {e}"),
        Ok(_) => panic!("bad URL accepted"),
    }
}

/// Connections killed from the server side while the pool holds them: the next lock call still
/// works (the broken connection is replaced and the attempt recognised, not counted twice).
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[tokio::test]
async fn server_side_connection_kills_are_survived() {
    let (dbs, _dir) = common::all("kills").await;
    // Not through PgBouncer: its few server connections serve every client of the test run, so
    // killing them would hit other tests; the client side of PgBouncer never sees the kill.
    for db in dbs
        .iter()
        .filter(|d| d.name != "sqlite" && d.name != common::PGBOUNCER)
    {
        // A pool of its own, recognisable on the server, so other tests' connections live on.
        let db = &isolated(db).await;
        let l = &db.locker;
        // Warm the pool so it holds idle connections.
        let gs: Vec<_> = futures_join(l, 4).await;
        for g in gs {
            g.release().await.unwrap();
        }
        kill_other_connections(db).await;
        let me = Owner::new();
        let g = l
            .lock("after-kill")
            .owner(&me)
            .await
            .expect("lock after kill");
        assert_eq!(g.hold_count(), 1, "{}", db.name);
        assert_eq!(
            l.inspect("after-kill").await.unwrap().unwrap().hold_count,
            1,
            "{}",
            db.name
        );
        kill_other_connections(db).await;
        g.release().await.expect("release after kill");
        assert!(
            !l.inspect("after-kill").await.unwrap().unwrap().held,
            "{}",
            db.name
        );
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn futures_join(l: &Locker, n: usize) -> Vec<dblock::LockGuard> {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let l = l.clone();
            tokio::spawn(async move { l.lock(format!("warm{i}")).await.unwrap() })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[cfg(feature = "postgres")]
const KILL_APP: &str = "dblock_kill_test";
#[cfg(feature = "mysql")]
const KILL_DB: &str = "dblock_kill_test";

/// The same backend through a pool that only this test uses: a PostgreSQL application_name,
/// or a MariaDB database of its own.
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn isolated(db: &common::Db) -> common::Db {
    let url = match db.name {
        #[cfg(feature = "postgres")]
        "postgres" => format!("{}?application_name={KILL_APP}", db.url),
        #[cfg(feature = "mysql")]
        "mariadb" | "mysql8-path" => {
            let pool = sqlx::MySqlPool::connect(&db.url).await.unwrap();
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "CREATE DATABASE IF NOT EXISTS {KILL_DB}"
            )))
            .execute(&pool)
            .await
            .unwrap();
            format!("{}/{KILL_DB}", db.url.rsplit_once('/').unwrap().0)
        }
        other => panic!("no connections to kill on {other}"),
    };
    let locker = common::as_named(
        db.name,
        Locker::connect(&url)
            .await
            .unwrap()
            .table(db.locker.table_name()),
    );
    locker.migrate().await.unwrap();
    common::Db {
        name: db.name,
        url,
        locker,
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn kill_other_connections(db: &common::Db) {
    match db.name {
        #[cfg(feature = "postgres")]
        "postgres" => {
            let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
            sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                 WHERE pid <> pg_backend_pid() AND datname = current_database()
                   AND application_name = 'dblock_kill_test' AND state = 'idle'",
            )
            .execute(&pool)
            .await
            .unwrap();
        }
        #[cfg(feature = "mysql")]
        "mariadb" | "mysql8-path" => {
            let pool = sqlx::MySqlPool::connect(&db.url).await.unwrap();
            let ids: Vec<i64> = sqlx::query_scalar(
                "SELECT ID FROM information_schema.PROCESSLIST
                 WHERE ID <> CONNECTION_ID() AND COMMAND = 'Sleep' AND DB = DATABASE()",
            )
            .fetch_all(&pool)
            .await
            .unwrap();
            for id in ids {
                let _ = sqlx::query(sqlx::AssertSqlSafe(format!("KILL {id}")))
                    .execute(&pool)
                    .await;
            }
        }
        other => panic!("no connections to kill on {other}"),
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// The test hook that reads a MySQL session variable on a connection of the locker's own pool
/// (the Galera run checks `wsrep_retry_autocommit` with it): there, the pool's own setting
/// (`Locker::connect` sets `innodb_lock_wait_timeout` to 1 s, the shortest MySQL has, so that
/// a transaction holding a lease row makes a call busy rather than blocked; the server's
/// default is 50); `None` on other backends; an error for anything but a name.
#[cfg(feature = "_test-util")]
#[tokio::test]
async fn mysql_session_variable_hook_reads_the_lockers_own_sessions() {
    use dblock::test_util::mysql_session_variable;
    let (dbs, _dir) = common::all("sessvar").await;
    for db in &dbs {
        let read = mysql_session_variable(&db.locker, "innodb_lock_wait_timeout")
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", db.name));
        let mysql = matches!(db.name, "mariadb" | "mysql8-path");
        let expected = mysql.then(|| "1".to_owned());
        assert_eq!(read, expected, "{}", db.name);
        assert!(
            mysql_session_variable(&db.locker, "x; DROP TABLE y")
                .await
                .is_err(),
            "{}",
            db.name
        );
    }
}

/// `wait(Duration::MAX)` means "as long as it takes" (no overflow panic), and a sub-microsecond
/// ttl is a typed error (its grant can never arrive live), not a panic or an expired guard.
#[tokio::test]
async fn extreme_durations_are_handled() {
    let (dbs, _dir) = common::all("extreme").await;
    for db in &dbs {
        let g = db.locker.lock("k").await.unwrap();
        let waited = tokio::time::timeout(
            Duration::from_millis(300),
            db.locker.lock("k").wait(Duration::MAX),
        )
        .await;
        assert!(waited.is_err(), "{}: wait(MAX) returned early", db.name);
        g.release().await.unwrap();
        // A lease shorter than a round trip has always ended by the time its grant arrives: it
        // is given back, never returned (a grant is only ever returned live).
        let tiny = db.locker.lock("tiny").ttl(Duration::from_nanos(1)).await;
        assert!(
            matches!(tiny, Err(LockError::Lost { .. })),
            "{}: {tiny:?}",
            db.name
        );
    }
}

/// The longest valid table name (schema.table, 127 bytes) still gets working NOTIFY hand-offs
/// on PostgreSQL (the channel is a short hash, PostgreSQL allows 63 bytes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_table_names_work_with_contended_releases() {
    let (dbs, _dir) = common::all("longname").await;
    for db in &dbs {
        let schema = if common::is_postgres(db.name) {
            "public"
        } else if db.name == "sqlite" {
            "main"
        } else {
            "test"
        };
        // 63 bytes after the schema, unique to this process (parallel suites must not collide).
        let unique = format!("{}{}", common::table_for("longname"), "l".repeat(63));
        let name = format!("{schema}.{}", &unique[..63]);
        let l = db.locker.table(&name);
        l.migrate().await.unwrap();
        let g = l.lock("k").await.unwrap();
        let l2 = l.clone();
        let waiter = tokio::spawn(async move { l2.lock("k").wait(Duration::from_secs(10)).await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        g.release()
            .await
            .unwrap_or_else(|e| panic!("{}: contended release failed: {e}", db.name));
        waiter.await.unwrap().unwrap().release().await.unwrap();
    }
}

/// Called from a thread with no tokio runtime (here, another executor): every call is a typed
/// `NoRuntime` error instead of a panic inside tokio or sqlx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outside_a_tokio_runtime_calls_are_a_typed_error() {
    let (dbs, _dir) = common::all("noruntime").await;
    for db in dbs {
        let name = db.name;
        let l = db.locker.clone();
        let outcome = std::thread::spawn(move || {
            futures_executor::block_on(async {
                let lock = l.lock("k").wait(Duration::from_secs(1)).await;
                let migrate = l.migrate().await;
                let inspect = l.inspect("k").await;
                let connect = Locker::connect("sqlite::memory:").await;
                [
                    lock.map(drop).unwrap_err(),
                    migrate.unwrap_err(),
                    inspect.unwrap_err(),
                    connect.map(drop).unwrap_err(),
                ]
            })
        })
        .join()
        .unwrap_or_else(|_| panic!("{name}: a call outside a runtime panicked"));
        for e in outcome {
            assert!(matches!(e, LockError::NoRuntime), "{name}: {e:?}");
            assert!(e.to_string().contains("tokio runtime"), "{e}");
        }
        // A guard taken inside the runtime and released from outside it: an error, no panic.
        // (Its lease then simply runs out; mariadb and mysql8-path share a table, hence the key.)
        let g = db.locker.lock(format!("outside-{name}")).await.unwrap();
        let released = std::thread::spawn(move || futures_executor::block_on(g.release()))
            .join()
            .unwrap_or_else(|_| panic!("{name}: release outside a runtime panicked"));
        assert!(matches!(released, Err(LockError::NoRuntime)), "{name}");
    }
}

/// Every other public call made outside a tokio runtime (a guard's `lost()`, a leadership's,
/// the streams, the kinds of lock, the operator's calls, `shutdown`): a typed `NoRuntime`
/// error or a documented effect, never a panic, never a future that hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outside_a_tokio_runtime_nothing_panics_or_hangs() {
    use futures_core::Stream;
    use std::pin::Pin;
    async fn next<S: Stream + Unpin>(s: &mut S) -> Option<S::Item> {
        std::future::poll_fn(|cx| Pin::new(&mut *s).poll_next(cx)).await
    }
    let (dbs, _dir) = common::all("noruntime2").await;
    for db in dbs {
        let name = db.name;
        // A locker of its own: its shutdown below must not end the others'.
        let l = common::connect(&db).await.table(db.locker.table_name());
        let key = format!("outside2-{name}");
        let guard = l.lock(&key).ttl(Duration::from_secs(30)).await.unwrap();
        let leadership = l.leader(format!("{key}-lead")).campaign().await.unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let k = key.clone();
        std::thread::spawn(move || {
            let errors = futures_executor::block_on(async {
                let mut observe = l.leader(format!("{k}-lead")).observe();
                let mut watch = l.watch(&k);
                let leader_lost = leadership.lost().await;
                let out = vec![
                    ("guard.lost", Err(guard.lost().await)),
                    ("leadership.lost", Err(leader_lost)),
                    ("extend", guard.extend(Duration::from_secs(30)).await),
                    (
                        "lock_all",
                        l.lock_all([format!("{k}a"), format!("{k}b")])
                            .await
                            .map(drop),
                    ),
                    ("read", l.read(format!("{k}r")).await.map(drop)),
                    ("semaphore", l.semaphore(format!("{k}s"), 2).await.map(drop)),
                    ("permits", l.permits(format!("{k}s")).await.map(drop)),
                    (
                        "campaign",
                        l.leader(format!("{k}c")).campaign().await.map(drop),
                    ),
                    (
                        "current",
                        l.leader(format!("{k}c")).current().await.map(drop),
                    ),
                    ("steal", l.steal(&k).await.map(drop)),
                    ("force_release", l.force_release(&k).await.map(drop)),
                    ("held", l.held().await.map(drop)),
                    ("purge", l.purge(Duration::from_secs(3600)).await.map(drop)),
                    ("reset", l.reset(format!("{k}x")).await.map(drop)),
                    (
                        "observe",
                        next(&mut observe).await.expect("an item").map(drop),
                    ),
                    ("watch", next(&mut watch).await.expect("an item").map(drop)),
                ];
                // Each stream is over after its error.
                assert!(next(&mut observe).await.is_none(), "observe goes on");
                assert!(next(&mut watch).await.is_none(), "watch goes on");
                l.shutdown().await;
                let after = l.inspect(&k).await.map(drop);
                drop(leadership);
                drop(guard);
                (out, after)
            });
            let _ = tx.send(errors);
        });
        let (errors, after) = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{name}: a call outside a runtime panicked or hung: {e}"));
        for (call, result) in errors {
            let e = result.expect_err(call);
            assert!(matches!(e, LockError::NoRuntime), "{name}: {call}: {e:?}");
        }
        assert!(
            matches!(after, Err(LockError::NoRuntime | LockError::ShutDown)),
            "{name}: {after:?}"
        );
        // The holds were left to their leases: the key is still held (nothing was sent).
        let row = db.locker.inspect(&key).await.unwrap().expect("a row");
        assert!(row.held, "{name}");
        db.locker.force_release(&key).await.unwrap();
    }
}

/// One owner holding the same key name in two tables holds two locks: releasing a hold of one
/// never changes the other's count. And two lockers of one table (a `table()` copy, a second
/// connection) share one owner's re-entry.
#[tokio::test]
async fn an_owners_holds_are_counted_per_table() {
    let (dbs, _dir) = common::all("per_table").await;
    for db in &dbs {
        let name = db.name;
        let a = db.locker.clone();
        let b = a.table(&format!("{}_b", a.table_name()));
        b.migrate().await.unwrap();
        // A second connection to the same table.
        let a2 = common::connect(db).await.table(a.table_name());
        Owner::new()
            .scope(async move {
                let outer = a.lock("k").await.unwrap();
                let inner = a2.lock("k").await.unwrap();
                assert_eq!(
                    (outer.hold_count(), inner.hold_count()),
                    (1, 2),
                    "{name}: a second locker of the same table re-enters"
                );
                assert_eq!(inner.fencing_token(), outer.fencing_token(), "{name}");
                let other = b.lock("k").await.unwrap();
                assert_eq!(
                    other.hold_count(),
                    1,
                    "{name}: another table is another lock"
                );

                inner.release().await.unwrap();
                let row = a.inspect("k").await.unwrap().unwrap();
                assert!(
                    row.held && row.hold_count == 1,
                    "{name}: the outer hold of table a must survive the inner release, got {row:?}"
                );
                assert!(
                    Owner::new().scope(a.lock("k")).await.unwrap_err().is_busy(),
                    "{name}: another owner took the key while the outer hold runs"
                );
                other.release().await.unwrap();
                assert!(a.inspect("k").await.unwrap().unwrap().held, "{name}");
                outer.release().await.unwrap();
                assert!(!a.inspect("k").await.unwrap().unwrap().held, "{name}");
                assert!(!b.inspect("k").await.unwrap().unwrap().held, "{name}");
            })
            .await;
    }
}

/// A statement that times out waiting for a row lock (PostgreSQL `lock_timeout`, 55P03; MariaDB
/// `max_statement_time`, 1969, or `innodb_lock_wait_timeout`, 1205) was rolled back by the
/// server: the call sends it again within its `wait`, instead of failing. Here another
/// transaction row-locks the lease row for a second while the statement time-out is 300 ms.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_timed_out_on_a_row_lock_is_sent_again() {
    let (dbs, _dir) = common::all("row_lock_timeout").await;
    for db in dbs
        .iter()
        .filter(|d| d.name == "postgres" || d.name == "mariadb")
    {
        let name = db.name;
        db.locker.lock("k").await.unwrap().release().await.unwrap(); // the row exists
        let quick = Locker::connect_with(
            &db.url,
            dblock::ConnectOptions::new().statement_timeout(Duration::from_millis(300)),
        )
        .await
        .unwrap()
        .table(db.locker.table_name());
        let select = format!(
            "SELECT lock_key FROM {} WHERE lock_key = 'k' FOR UPDATE",
            db.locker.table_name()
        );
        macro_rules! hold_row_lock {
            ($pool:ty) => {{
                let pool = <$pool>::connect(&db.url).await.unwrap();
                let mut tx = pool.begin().await.unwrap();
                sqlx::query(sqlx::AssertSqlSafe(select.clone()))
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
                let started = Instant::now();
                let quick = quick.clone();
                let waiter = tokio::spawn(async move {
                    quick
                        .lock("k")
                        .wait(5 * SEC)
                        .await
                        .map(|g| (g, Instant::now()))
                });
                tokio::time::sleep(Duration::from_millis(1000)).await;
                let committed = Instant::now();
                tx.commit().await.unwrap();
                let (g, taken) = waiter.await.unwrap().unwrap_or_else(|e| {
                    panic!("{name}: a lock-wait time-out failed the call: {e:?}")
                });
                assert!(taken >= committed, "{name}");
                assert!(started.elapsed() < 4 * SEC, "{name}");
                g.release().await.unwrap();
            }};
        }
        match name {
            #[cfg(feature = "postgres")]
            "postgres" => hold_row_lock!(sqlx::PgPool),
            #[cfg(feature = "mysql")]
            "mariadb" => hold_row_lock!(sqlx::MySqlPool),
            _ => {}
        }
    }
}

#[cfg(not(any(feature = "postgres", feature = "mysql")))]
#[test]
#[ignore = "row-lock time-outs are server errors: needs --features postgres or mysql"]
fn a_statement_timed_out_on_a_row_lock_is_sent_again() {}

/// Waiters of one key in one process get it in the order they arrived (the process's line: only
/// the head asks the database, and a release by the process wakes it), not in whatever order
/// their backoff happens to bring them back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_of_one_process_get_the_key_in_arrival_order() {
    let (dbs, _dir) = common::all("arrival_order").await;
    for db in &dbs {
        let holder = db.locker.lock("hot").await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for i in 0..8 {
            let (l, order) = (db.locker.clone(), order.clone());
            waiters.push(tokio::spawn(async move {
                let g = l.lock("hot").wait(Duration::from_secs(20)).await.unwrap();
                order.lock().unwrap().push(i);
                tokio::time::sleep(Duration::from_millis(5)).await;
                g.release().await.unwrap();
            }));
            // Arrive one after another, each past its first (busy) attempt.
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
        // Long enough for every waiter's backoff to have grown apart.
        tokio::time::sleep(Duration::from_millis(300)).await;
        holder.release().await.unwrap();
        for w in waiters {
            w.await.unwrap();
        }
        assert_eq!(
            *order.lock().unwrap(),
            (0..8).collect::<Vec<_>>(),
            "{}: not in arrival order",
            db.name
        );
    }
}

/// A newcomer of the process does not go ahead of the process's waiters already in line: freed
/// while the head of the line sleeps in its backoff, the key goes to the head, and a newcomer
/// with one attempt finds it busy. (Before, the newcomer's first attempt took it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newcomers_do_not_go_ahead_of_the_processs_line() {
    let (dbs, _dir) = common::all("no_barging").await;
    for db in &dbs {
        let key = format!("line:{}", db.name);
        let holder = db.locker.lock(&key).await.unwrap();
        let first = holder.fencing_token();
        let (l, k) = (db.locker.clone(), key.clone());
        let waiter = tokio::spawn(async move {
            let g = l.lock(&k).wait(Duration::from_secs(20)).await.unwrap();
            let token = g.fencing_token();
            // Held a while: on a loaded machine the waiter's pause may end between the
            // operator's release and the newcomer's attempt, and a waiter that took the key and
            // gave it back at once would leave it free for the newcomer.
            tokio::time::sleep(Duration::from_secs(2)).await;
            g.release().await.unwrap();
            token
        });
        // The waiter's backoff grows to its cap (125–250 ms pauses).
        tokio::time::sleep(Duration::from_millis(700)).await;
        // Freed by an operator: nothing in this process wakes the waiter.
        assert!(db.locker.force_release(&key).await.unwrap());
        drop(holder);
        let newcomer = db.locker.lock(&key).await;
        assert!(
            matches!(newcomer, Err(LockError::Busy { .. })),
            "{}: a newcomer went ahead of the line: {:?}",
            db.name,
            newcomer.map(|g| g.fencing_token())
        );
        // The waiter's tenure (the newcomer's `Busy` above says it took none).
        assert!(waiter.await.unwrap() > first, "{}", db.name);
    }
}
