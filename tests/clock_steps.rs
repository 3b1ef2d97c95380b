//! Steps of the database server's clock while keys are held: dblock's expiry is the database's
//! clock, so a step moves every live lease at once. Each test runs a PostgreSQL cluster of its
//! own under libfaketime (`common::cluster::PrivatePg::start_with_clock`), whose time of day the
//! test steps; without PostgreSQL's server binaries or libfaketime it says SKIPPING and passes,
//! unless `DBLOCK_REQUIRE_SERVERS=1`.
//!
//! - **Forward** by more than the remaining lease (an NTP correction of a clock that was behind,
//!   a failover to a server whose clock is ahead): every lease ends at once on the database. The
//!   holder's fenced write is refused from the step on, another owner takes the key with a higher
//!   token, and the holder learns it lost at its next renewal: within one renewal period (ttl/3)
//!   of the step.
//! - **Back**: every lease lasts that much longer. A renewing holder keeps its key and its fenced
//!   writes commit; a lease nobody renews (its holder crashed) keeps its key for the step longer
//!   than its ttl — the error, measured here, is the step.
//!
//! In both, the fenced writes of the table the test writes are checked in commit order: their
//! fencing tokens never go down (no write of an old holder after a newer holder's).
#![cfg(feature = "postgres")]

mod common;

use std::time::{Duration, Instant};

use common::cluster::PrivatePg;
use dblock::sqlx::{self, PgPool};
use dblock::{LockError, LockGuard, Locker, Owner};

/// A cluster with a clock of its own, a locker on it (migrated), and an application pool with
/// the table of fenced writes; `None` where the set-up cannot run.
async fn setup(test: &str) -> Option<(PrivatePg, Locker, PgPool)> {
    let pg = PrivatePg::start_with_clock(test, &[])?;
    let locker = Locker::connect(&pg.url()).await.expect("connect");
    locker.migrate().await.expect("migrate");
    let pool = PgPool::connect(&pg.url()).await.expect("app pool");
    sqlx::query(
        "CREATE TABLE writes (id bigserial PRIMARY KEY, token bigint NOT NULL, who text NOT NULL)",
    )
    .execute(&pool)
    .await
    .expect("writes table");
    Some((pg, locker, pool))
}

/// One fenced write of `who` under `guard`: the fence and the insert in one transaction,
/// committed only if the fence held.
async fn fenced_write(pool: &PgPool, guard: &LockGuard, who: &str) -> Result<(), LockError> {
    let mut tx = pool.begin().await.map_err(LockError::Database)?;
    guard.fence(&mut *tx).await?;
    sqlx::query("INSERT INTO writes (token, who) VALUES ($1, $2)")
        .bind(guard.fencing_token() as i64)
        .bind(who)
        .execute(&mut *tx)
        .await
        .map_err(LockError::Database)?;
    tx.commit().await.map_err(LockError::Database)
}

/// The committed writes in commit order: their tokens never go down.
async fn check_history(pool: &PgPool) -> usize {
    let rows: Vec<(i64, i64, String)> =
        sqlx::query_as("SELECT id, token, who FROM writes ORDER BY id")
            .fetch_all(pool)
            .await
            .expect("read the writes");
    for pair in rows.windows(2) {
        assert!(
            pair[1].1 >= pair[0].1,
            "a write under an older token after a newer one: {pair:?}"
        );
    }
    rows.len()
}

#[tokio::test]
async fn a_forward_step_ends_every_lease_and_the_holder_learns_within_a_renewal() {
    let Some((pg, locker, pool)) = setup("a forward clock step").await else {
        return;
    };
    let ttl = Duration::from_secs(6);
    let old = locker.lock("k").ttl(ttl).await.expect("lock").auto_renew();
    fenced_write(&pool, &old, "old, before the step")
        .await
        .expect("a fenced write of the holder");
    // Mid-transaction when the clock steps.
    let mut tx = pool.begin().await.expect("begin");
    pg.set_clock(60);
    let stepped = Instant::now();
    let refused = old.fence(&mut *tx).await;
    assert!(refused.is_err(), "fenced after the step: {refused:?}");
    drop(tx);
    let newer = locker
        .lock("k")
        .owner(&Owner::new())
        .await
        .expect("another owner takes the key at once");
    assert!(newer.fencing_token() > old.fencing_token());
    fenced_write(&pool, &newer, "newer")
        .await
        .expect("the newer holder writes");
    let lost = tokio::time::timeout(ttl, old.lost()).await;
    let learned = stepped.elapsed();
    assert!(matches!(lost, Ok(LockError::Lost { .. })), "{lost:?}");
    // One renewal period (ttl/3), and a little for the statement.
    assert!(
        learned <= ttl / 3 + Duration::from_millis(1500),
        "{learned:?}"
    );
    assert!(fenced_write(&pool, &old, "old, after").await.is_err());
    assert_eq!(check_history(&pool).await, 2);
    println!("clock_step_forward_60s_to_lost_ms={}", learned.as_millis());
}

#[tokio::test]
async fn a_backward_step_lengthens_every_lease_by_the_step() {
    let Some((pg, locker, pool)) = setup("a backward clock step").await else {
        return;
    };
    let step = 10;
    let renewing = locker
        .lock("renewed")
        .ttl(Duration::from_secs(3))
        .await
        .expect("lock")
        .auto_renew();
    let ttl = Duration::from_secs(2);
    // A holder that crashed: its lease is never renewed nor released.
    let abandoned = locker.lock("abandoned").ttl(ttl).await.expect("lock");
    let taken_at = Instant::now();
    std::mem::forget(abandoned);
    pg.set_clock(-step);
    let other = locker
        .lock("abandoned")
        .owner(&Owner::new())
        .wait(Duration::from_secs(30))
        .await
        .expect("the key comes back once the lease ends on the stepped clock");
    let held_for = taken_at.elapsed();
    let error = held_for.saturating_sub(ttl);
    // The lease lasted its ttl plus the step (less what passed before the step).
    assert!(
        error >= Duration::from_secs(step as u64) - Duration::from_millis(800)
            && error <= Duration::from_secs(step as u64) + Duration::from_secs(2),
        "held {held_for:?} for a {ttl:?} lease after a {step} s step back"
    );
    drop(other);
    // Meanwhile the renewing holder kept its key, and its fenced writes commit.
    assert!(!renewing.is_lost());
    fenced_write(&pool, &renewing, "renewing, after the step")
        .await
        .expect("the renewing holder still writes");
    let info = locker
        .inspect("renewed")
        .await
        .expect("inspect")
        .expect("row");
    assert!(info.held && info.fencing_token == renewing.fencing_token());
    assert_eq!(check_history(&pool).await, 1);
    println!(
        "clock_step_back_{step}s_lease_error_ms={}",
        error.as_millis()
    );
    renewing.release().await.expect("release");
}
