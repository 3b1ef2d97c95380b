//! `dblock::testing`: the test locker on tokio's paused clock, its fault hooks and assertions,
//! as a user's tests would use them (every test here runs on a paused clock unless it says
//! otherwise, and checks that paused time, not real time, passed).

use std::time::Duration;

use dblock::{distributed_lock, testing, LockError, Locker, Owner};

const SECOND: Duration = Duration::from_secs(1);

/// Real time a test may take where paused time passes: far below what it waits on the clock.
const REAL_BOUND: Duration = Duration::from_secs(3);

fn took_little_real_time(since: std::time::Instant) {
    let real = since.elapsed();
    assert!(real < REAL_BOUND, "{real:?} of real time");
}

#[tokio::test(start_paused = true)]
async fn a_lease_runs_out_when_the_paused_clock_passes_its_ttl() -> Result<(), LockError> {
    let locker = testing::locker().await?;
    let first = locker.lock("k").ttl(10 * SECOND).await?;
    let other = Owner::new();
    tokio::time::advance(9 * SECOND).await;
    let early = locker.lock("k").owner(&other).await;
    assert!(matches!(early, Err(LockError::Busy { .. })), "{early:?}");
    tokio::time::advance(2 * SECOND).await;
    let second = locker.lock("k").owner(&other).await?;
    assert!(second.fencing_token() > first.fencing_token());
    let info = testing::assert_held(&locker, "k").await;
    assert_eq!(info.owner.as_deref(), Some(other.id()));
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_wait_for_a_busy_key_takes_paused_time_not_real_time() -> Result<(), LockError> {
    let locker = testing::locker().await?;
    let _held = locker.lock("k").ttl(60 * SECOND).await?;
    let (paused, real) = (tokio::time::Instant::now(), std::time::Instant::now());
    let waited = locker.lock("k").owner(&Owner::new()).wait(5 * SECOND).await;
    assert!(matches!(waited, Err(LockError::Busy { .. })), "{waited:?}");
    let on_the_clock = paused.elapsed();
    assert!(
        on_the_clock >= 5 * SECOND && on_the_clock < 7 * SECOND,
        "{on_the_clock:?}"
    );
    took_little_real_time(real);
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn renewal_keeps_a_lease_through_an_hour_of_paused_time() -> Result<(), LockError> {
    let locker = testing::locker().await?;
    let real = std::time::Instant::now();
    // A renewal each 10 s of the clock: 360 statements, well within the real-time bound on a
    // loaded machine (a 3 s ttl's 3,600 took 1.5 s alone and 3.9 s beside the whole suite).
    let guard = locker.lock("k").ttl(30 * SECOND).await?.auto_renew();
    tokio::time::sleep(Duration::from_secs(3600)).await;
    let info = testing::assert_held(&locker, "k").await;
    assert_eq!(info.fencing_token, guard.fencing_token());
    assert!(info.time_left <= 30 * SECOND, "{:?}", info.time_left);
    guard.release().await?;
    testing::assert_free(&locker, "k").await;
    took_little_real_time(real);
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn an_expired_holder_learns_it_lost_at_its_next_renewal() -> Result<(), LockError> {
    let locker = testing::locker().await?;
    let guard = locker.lock("k").ttl(30 * SECOND).await?.auto_renew();
    let start = tokio::time::Instant::now();
    assert_eq!(testing::expire(&locker, "k").await?, 1);
    testing::assert_free(&locker, "k").await;
    let lost = tokio::time::timeout(30 * SECOND, guard.lost()).await;
    assert!(matches!(lost, Ok(LockError::Lost { .. })), "{lost:?}");
    // The next renewal, about ttl/3 after the grant.
    assert!(start.elapsed() <= 11 * SECOND, "{:?}", start.elapsed());
    let taken = locker.lock("k").owner(&Owner::new()).await?;
    assert!(taken.fencing_token() > guard.fencing_token());
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_stopped_renewal_lets_the_lease_run_out_at_its_ttl() -> Result<(), LockError> {
    let locker = testing::locker().await?;
    let guard = locker.lock("k").ttl(10 * SECOND).await?.auto_renew();
    assert_eq!(testing::stop_renewal(&locker, "k"), 1);
    assert_eq!(testing::stop_renewal(&locker, "other"), 0);
    tokio::time::sleep(9 * SECOND).await;
    testing::assert_held(&locker, "k").await;
    tokio::time::sleep(2 * SECOND).await;
    testing::assert_free(&locker, "k").await;
    // The lease ended with no one else on the key: the guard holds nothing any more.
    let late = guard.extend(10 * SECOND).await;
    assert!(matches!(late, Err(LockError::NotHeld { .. })), "{late:?}");
    Ok(())
}

/// `remaining()` counts down on the local clock from the acquire's send time plus the ttl;
/// an extension moves it on; past the ttl it is zero.
#[tokio::test(start_paused = true)]
async fn remaining_counts_down_to_the_end_of_the_lease() -> Result<(), LockError> {
    let locker = testing::locker().await?;
    let guard = locker.lock("k").ttl(10 * SECOND).await?;
    let left = guard.remaining();
    assert!(left <= 10 * SECOND && left > 9 * SECOND, "{left:?}");
    tokio::time::sleep(4 * SECOND).await;
    let left = guard.remaining();
    assert!(left <= 6 * SECOND && left > 5 * SECOND, "{left:?}");
    guard.extend(10 * SECOND).await?;
    let left = guard.remaining();
    assert!(left <= 10 * SECOND && left > 9 * SECOND, "{left:?}");
    tokio::time::sleep(11 * SECOND).await;
    assert_eq!(guard.remaining(), Duration::ZERO);
    assert!(guard.is_lost());
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn failed_statements_fail_calls_until_healed() -> Result<(), LockError> {
    let locker = testing::locker().await?;
    testing::fail_next(&locker, 1_000)?;
    let refused = locker.lock("k").wait(2 * SECOND).await;
    assert!(
        matches!(refused, Err(LockError::Database(_))),
        "{refused:?}"
    );
    testing::fail_next(&locker, 0)?;
    testing::assert_free(&locker, "k").await;
    // One failure is retried, as a dropped connection is.
    testing::fail_next(&locker, 1)?;
    let guard = locker.lock("k").await?;
    testing::assert_held(&locker, "k").await;
    guard.release().await?;
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_lost_reply_never_leaks_the_key() -> Result<(), LockError> {
    let locker = testing::locker().await?;
    // The acquire commits; its reply is lost. Whatever the call says, the key is not left held.
    testing::lose_next_replies(&locker, 1)?;
    let taken = locker.lock("a").ttl(60 * SECOND).await;
    match taken {
        Ok(guard) => guard.release().await?,
        Err(e) => assert!(!matches!(e, LockError::Busy { .. }), "{e:?}"),
    }
    tokio::time::sleep(5 * SECOND).await;
    testing::assert_free(&locker, "a").await;

    // The release commits; its reply is lost.
    let guard = locker.lock("b").ttl(60 * SECOND).await?;
    testing::lose_next_replies(&locker, 1)?;
    let _ = guard.release().await;
    tokio::time::sleep(5 * SECOND).await;
    testing::assert_free(&locker, "b").await;
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn each_test_locker_is_a_database_of_its_own() -> Result<(), LockError> {
    let (one, two) = (testing::locker().await?, testing::locker().await?);
    let _held = one.lock("k").await?;
    testing::assert_free(&two, "k").await;
    let _also = two.lock("k").await?;
    Ok(())
}

#[tokio::test]
async fn the_hooks_refuse_a_locker_that_is_not_a_test_locker() -> Result<(), LockError> {
    let locker = Locker::connect("sqlite::memory:").await?;
    locker.migrate().await?;
    assert!(matches!(
        testing::fail_next(&locker, 1),
        Err(LockError::Config(_))
    ));
    assert!(matches!(
        testing::expire(&locker, "k").await,
        Err(LockError::Config(_))
    ));
    // On the real clock, the test locker is a plain one.
    let test = testing::locker().await?;
    test.lock("k").await?.release().await?;
    Ok(())
}

#[tokio::test(start_paused = true)]
#[should_panic(expected = "held by")]
async fn assert_free_names_who_holds_the_key() {
    let locker = testing::locker().await.unwrap();
    let _held = locker.lock("k").holder("worker-7").await.unwrap();
    testing::assert_free(&locker, "k").await;
}

#[tokio::test(start_paused = true)]
#[should_panic(expected = "never taken")]
async fn assert_held_says_a_key_was_never_taken() {
    let locker = testing::locker().await.unwrap();
    testing::assert_held(&locker, "k").await;
}

/// A user's locked function, tested for its busy path and its lost path.
#[distributed_lock(key = "order:{order_id}", locker = locker, ttl = "30s", wait = "5s")]
async fn settle(locker: &Locker, order_id: u64, work: Duration) -> Result<u64, LockError> {
    tokio::time::sleep(work).await;
    Ok(order_id)
}

#[tokio::test(start_paused = true)]
async fn a_locked_function_reports_busy_after_its_wait() -> Result<(), LockError> {
    let locker = testing::locker().await?;
    let _other = locker.lock("order:7").owner(&Owner::new()).await?;
    let start = tokio::time::Instant::now();
    let busy = settle(&locker, 7, SECOND).await;
    assert!(matches!(busy, Err(LockError::Busy { .. })), "{busy:?}");
    assert!(start.elapsed() >= 5 * SECOND, "{:?}", start.elapsed());
    assert_eq!(settle(&locker, 8, SECOND).await?, 8);
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_locked_function_ends_with_lost_when_its_lease_is_taken() -> Result<(), LockError> {
    let locker = testing::locker().await?;
    let running = tokio::spawn({
        let locker = locker.clone();
        async move { settle(&locker, 7, Duration::from_secs(600)).await }
    });
    tokio::time::sleep(SECOND).await;
    testing::assert_held(&locker, "order:7").await;
    testing::expire(&locker, "order:7").await?;
    let ended = running.await.expect("no panic");
    assert!(matches!(ended, Err(LockError::Lost { .. })), "{ended:?}");
    Ok(())
}

/// `testing::steal`: another owner takes the key from a running locked function, which ends
/// with `Lost`; the thief holds it with a larger token.
#[tokio::test(start_paused = true)]
async fn a_locked_function_ends_with_lost_when_its_key_is_stolen() -> Result<(), LockError> {
    let locker = testing::locker().await?;
    let running = tokio::spawn({
        let locker = locker.clone();
        async move { settle(&locker, 9, Duration::from_secs(600)).await }
    });
    tokio::time::sleep(SECOND).await;
    let before = testing::assert_held(&locker, "order:9").await;
    let thief = testing::steal(&locker, "order:9").await?;
    assert!(thief.fencing_token() > before.fencing_token);
    let ended = running.await.expect("no panic");
    assert!(matches!(ended, Err(LockError::Lost { .. })), "{ended:?}");
    let now = testing::assert_held(&locker, "order:9").await;
    assert_eq!(now.fencing_token, thief.fencing_token());
    Ok(())
}

/// Fencing tokens never go back after a purge, even when the key is freed, purged and taken
/// again within one millisecond of the database's clock (here, a paused one), and
/// `purge(Duration::ZERO)` still deletes every row not held: it waits for the clock's next
/// tick before it deletes a row a new row of its key could not start above.
#[tokio::test(start_paused = true)]
async fn a_purged_key_never_gets_an_old_fencing_token_back() -> Result<(), LockError> {
    let locker = testing::locker().await?;
    let mut last = 0;
    for _ in 0..3 {
        let g = locker.lock("k").await?;
        assert!(
            g.fencing_token() > last,
            "{} after {last}",
            g.fencing_token()
        );
        last = g.fencing_token();
        g.release().await?;
        assert_eq!(locker.purge(Duration::ZERO).await?, 1, "the free row");
        assert!(locker.inspect("k").await?.is_none());
    }
    Ok(())
}

/// Code under test that relies on the process default locker (no `locker = ...`).
#[distributed_lock(key = "job:{name}", ttl = "30s", wait = "2s")]
async fn job(name: &str, work: Duration) -> Result<u64, LockError> {
    tokio::time::sleep(work).await;
    Ok(dblock::current().unwrap().fencing_token)
}

#[tokio::test(start_paused = true)]
async fn with_default_gives_each_test_its_own_default_locker() -> Result<(), LockError> {
    // No `set_default` in this binary: outside a scope there is no default.
    assert!(matches!(
        job("x", Duration::ZERO).await,
        Err(LockError::NoLocker)
    ));
    let (a, b) = (testing::locker().await?, testing::locker().await?);
    // The same key at the same time in two scopes: two databases, so neither waits.
    let started = tokio::time::Instant::now();
    let (in_a, in_b) = tokio::join!(
        testing::with_default(&a, job("x", Duration::from_secs(10))),
        testing::with_default(&b, job("x", Duration::from_secs(10))),
    );
    assert!(
        started.elapsed() < Duration::from_secs(11),
        "neither waited"
    );
    // Each took the key in its own locker's database.
    assert_eq!(a.inspect("job:x").await?.unwrap().fencing_token, in_a?);
    assert_eq!(b.inspect("job:x").await?.unwrap().fencing_token, in_b?);
    // Inside a scope, a holder elsewhere in that database makes the job wait, then `Busy`.
    let held = a.lock("job:y").owner(&Owner::new()).await?;
    let busy = testing::with_default(&a, job("y", Duration::ZERO)).await;
    assert!(matches!(busy, Err(LockError::Busy { .. })), "{busy:?}");
    held.release().await?;
    // A spawned task does not inherit the scope.
    let spawned = testing::with_default(&a, async {
        tokio::spawn(job("z", Duration::ZERO)).await.unwrap()
    })
    .await;
    assert!(matches!(spawned, Err(LockError::NoLocker)), "{spawned:?}");
    Ok(())
}

/// `drain` returns once the releases of the holds it waited for are done, not when their guards
/// let go: a dropped guard's release whose first sends fail is waited for (else a process that
/// exits when `drain` returns would leave the key held until its lease ends).
#[tokio::test(start_paused = true)]
async fn drain_waits_for_a_release_still_on_its_way() -> Result<(), LockError> {
    let locker = testing::locker().await?;
    let guard = locker.lock("job").ttl(30 * SECOND).await?;
    testing::fail_next(&locker, 2)?;
    drop(guard); // released in the background; its first two sends fail
    let started = tokio::time::Instant::now();
    assert_eq!(locker.drain(60 * SECOND).await, 0);
    let took = started.elapsed();
    // The release went out again after a pause (paused time passed), and was done well before
    // the grace ran out.
    assert!(took > Duration::ZERO && took < 30 * SECOND, "{took:?}");
    Ok(())
}
