//! `max_hold`, a hard cap on holding, on every backend: renewal keeps a lease past its ttl but
//! never past `acquired_at + max_hold` on the database clock; at the cap the lease ends, `lost()`
//! resolves, a locked body ends with `Err(Lost)` and records `Failed`, and `extend` refuses.

mod common;

use std::time::{Duration, Instant};

use dblock::{distributed_lock, LockError, Locker, Outcome};

const TTL: Duration = Duration::from_millis(1000);
const MAX_HOLD: Duration = Duration::from_millis(2500);
/// Generous: the cap and the lease end are decided by the clocks; this only bounds a hang.
const LIMIT: Duration = Duration::from_secs(30);

/// The lease on the database clock never reaches past `acquired_at + max_hold`.
async fn assert_capped(l: &Locker, key: &str, name: &str) {
    let info = l.inspect(key).await.unwrap().expect("the row");
    let span = info
        .expires_at
        .duration_since(info.acquired_at)
        .unwrap_or_default();
    assert!(
        span <= MAX_HOLD,
        "{name}: lease runs {span:?} past its acquisition, beyond max_hold {MAX_HOLD:?}"
    );
}

#[distributed_lock(key = "capped-body", locker = locker, ttl = TTL, max_hold = MAX_HOLD)]
async fn hangs(locker: &Locker) -> Result<(), LockError> {
    tokio::time::sleep(LIMIT).await; // a hung body
    Ok(())
}

/// `max_hold` shorter than the (default) ttl: the cap ends the hold all the same.
#[distributed_lock(key = "short-capped-body", locker = locker, max_hold = "1200ms")]
async fn short_capped_body(locker: &Locker) -> Result<(), LockError> {
    tokio::time::sleep(LIMIT).await; // a hung body
    Ok(())
}

/// Without renewal the cap still ends the body: `max_hold` is a hard cap either way.
#[distributed_lock(key = "unrenewed-capped-body", locker = locker, ttl = "60s", max_hold = "800ms", renew = false)]
async fn unrenewed_capped_body(locker: &Locker) -> Result<(), LockError> {
    tokio::time::sleep(LIMIT).await; // a hung body
    Ok(())
}

/// Every backend at once (each on a table of its own): the test is mostly waiting for caps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_hold_caps_renewal_on_the_database_clock() {
    let (dbs, _dir) = common::all("max_hold").await;
    futures::future::join_all(dbs.iter().map(capped_on)).await;
}

async fn capped_on(db: &common::Db) {
    let name = db.name;
    let l = common::own_table(db, "max_hold").await;

    // The handle API: renewed past its ttl, then left to end at the cap.
    let started = Instant::now();
    let guard = l
        .lock("capped")
        .ttl(TTL)
        .max_hold(MAX_HOLD)
        .await
        .unwrap()
        .auto_renew();
    tokio::time::sleep(TTL * 8 / 5).await; // past the ttl, before the cap
    let info = l.inspect("capped").await.unwrap().unwrap();
    assert!(
        info.held && info.fencing_token == guard.fencing_token(),
        "{name}: renewal did not keep the lease past its ttl: {info:?}"
    );
    assert_capped(&l, "capped", name).await;
    let lost = tokio::time::timeout(LIMIT, guard.lost())
        .await
        .unwrap_or_else(|_| panic!("{name}: still held {LIMIT:?} after max_hold"));
    assert!(
        started.elapsed() >= MAX_HOLD - Duration::from_millis(100),
        "{name}: lost after {:?}, before max_hold: {lost:?}",
        started.elapsed()
    );
    assert_capped(&l, "capped", name).await;
    // Someone else can have the key now, and extend refuses to go past the cap.
    let other = l.lock("capped").wait(LIMIT).await.unwrap();
    assert!(other.fencing_token() > guard.fencing_token(), "{name}");
    let e = guard.extend(TTL).await.unwrap_err();
    assert!(
        e.is_lost() || matches!(e, LockError::NotHeld { .. }),
        "{name}: {e:?}"
    );
    drop(guard);
    other.release().await.unwrap();

    // The attribute: a hung body ends with Lost at the cap, and records a failure.
    let started = Instant::now();
    let e = hangs(&l).await.unwrap_err();
    assert!(e.is_lost(), "{name}: {e:?}");
    assert!(started.elapsed() < LIMIT, "{name}");
    assert_capped(&l, "capped-body", name).await;
    let info = l.inspect("capped-body").await.unwrap().unwrap();
    assert_eq!(info.last_outcome, Some(Outcome::Failed), "{name}: {info:?}");

    // Reads and permits are capped the same way.
    let read = l
        .read("r")
        .ttl(TTL)
        .max_hold(MAX_HOLD)
        .await
        .unwrap()
        .auto_renew();
    tokio::time::timeout(LIMIT, read.lost())
        .await
        .unwrap_or_else(|_| panic!("{name}: read still held after max_hold"));
    drop(read);
    let permit = l
        .semaphore("s", 2)
        .ttl(TTL)
        .max_hold(MAX_HOLD)
        .await
        .unwrap()
        .auto_renew();
    tokio::time::timeout(LIMIT, permit.lost())
        .await
        .unwrap_or_else(|_| panic!("{name}: permit still held after max_hold"));
    drop(permit);

    // A cap shorter than the ttl is the first lease: the hold ends at the cap. With the
    // default ttl (30 s), as an attribute would write it.
    let short = Duration::from_millis(1200);
    let guard = l.lock("short-cap").max_hold(short).await.unwrap();
    let info = l.inspect("short-cap").await.unwrap().unwrap();
    let span = info
        .expires_at
        .duration_since(info.acquired_at)
        .unwrap_or_default();
    assert!(span <= short, "{name}: first lease {span:?} past the cap");
    tokio::time::timeout(LIMIT, guard.lost())
        .await
        .unwrap_or_else(|_| panic!("{name}: a 30 s lease outlived max_hold {short:?}"));
    let e = short_capped_body(&l).await.unwrap_err();
    assert!(e.is_lost(), "{name}: {e:?}");
    let started = Instant::now();
    let e = unrenewed_capped_body(&l).await.unwrap_err();
    assert!(e.is_lost(), "{name}: {e:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(700) && started.elapsed() < LIMIT,
        "{name}: ended after {:?}",
        started.elapsed()
    );
    // A zero cap, or one shorter than min_hold, is refused up front.
    let e = l.lock("k").max_hold(Duration::ZERO).await.unwrap_err();
    assert!(matches!(e, LockError::Config(_)), "{name}: {e:?}");
    let e = l
        .lock("k")
        .ttl(TTL)
        .min_hold(MAX_HOLD * 2)
        .max_hold(MAX_HOLD)
        .await
        .unwrap_err();
    assert!(matches!(e, LockError::Config(_)), "{name}: {e:?}");
}
