//! Testing code that uses dblock: a test [`Locker`] with no server, on tokio's paused clock,
//! with fault hooks and assertions (feature `testing`; the chapter "Testing code that uses
//! dblock" in `docs/testing.md` has a whole test).
//!
//! [`locker()`] is a migrated `Locker` on an in-memory SQLite database of its own. Its clock is
//! tokio's: under `#[tokio::test(start_paused = true)]` leases, renewal and waiting follow the
//! paused clock, so `tokio::time::advance(ttl)` makes a lease run out, and a test that waits five
//! seconds for a busy key takes no five seconds. How:
//!
//! - the database's clock (`julianday('now')`, the only clock dblock's SQLite statements read)
//!   is replaced, on the test database's connection, by one that reads the runtime's clock;
//! - while a statement is out to SQLite (on sqlx's worker thread, which tokio cannot see), the
//!   paused clock does not jump ahead: otherwise an idle runtime would fire the next timer — a
//!   statement's deadline, the pool's time-out — while the statement runs.
//!
//! The fault hooks act on the test locker alone (another `Locker` has none):
//!
//! | hook | what the code under test sees |
//! |---|---|
//! | [`expire`] | the key's lease ran out now, without a release: the holder's next renewal, `extend` or `fence` says `Lost`, and others may take the key |
//! | [`steal`] ([`Locker::steal`] as another owner) | another owner took the key, with a new fencing token |
//! | [`stop_renewal`] | the renewer hung: the lease runs out at its ttl unless the holder extends it |
//! | [`fail_next`] | the next statements fail before they are sent, as on a dropped connection |
//! | [`lose_next_replies`] | the next statements are sent and take effect, but their replies never come: "outcome unknown" |
//!
//! [`assert_held`] and [`assert_free`] panic with the owner and holder they found.
//!
//! ```
//! # async fn demo() -> Result<(), dblock::LockError> {
//! let locker = dblock::testing::locker().await?;
//! let guard = locker.lock("job").ttl(std::time::Duration::from_secs(30)).await?;
//! dblock::testing::assert_held(&locker, "job").await;
//! dblock::testing::expire(&locker, "job").await?;
//! dblock::testing::assert_free(&locker, "job").await;
//! # drop(guard); Ok(()) }
//! # tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap().block_on(demo()).unwrap();
//! ```

mod clock;
pub(crate) mod faults;

use std::str::FromStr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

use crate::backend::conns::Conns;
use crate::backend::sqlite::Lite;
use crate::backend::Backend;
use crate::error::LockError;
use crate::info::LockInfo;
use crate::locker::Locker;
use faults::{Faults, Still};

/// A migrated test `Locker` on a new in-memory SQLite database, whose clock is the tokio
/// runtime's: under a paused clock (`#[tokio::test(start_paused = true)]`) every lease, renewal
/// and wait follows it. Each call is a database of its own, so tests running side by side do
/// not meet.
///
/// ```
/// # async fn demo() -> Result<(), dblock::LockError> {
/// use std::time::Duration;
/// let locker = dblock::testing::locker().await?;
/// let held = locker.lock("k").ttl(Duration::from_secs(10)).await?; // not renewed
/// tokio::time::advance(Duration::from_secs(11)).await; // the lease ran out
/// let other = locker.lock("k").owner(&dblock::Owner::new()).await?; // so another owner takes it
/// assert!(other.fencing_token() > held.fencing_token());
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap().block_on(demo()).unwrap();
/// ```
pub async fn locker() -> Result<Locker, LockError> {
    LockError::require_runtime()?;
    // No jump of the paused clock while the database opens.
    let _still = Still::new();
    let clock = clock::Clock::here();
    let options = SqliteConnectOptions::from_str("sqlite::memory:").map_err(LockError::Database)?;
    // The database lives as long as its one connection: kept open, never replaced.
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .min_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .test_before_acquire(false)
        .after_connect(move |conn, _| {
            let clock = clock.clone();
            Box::pin(async move { clock.install(conn).await })
        })
        .connect_with(options)
        .await
        .map_err(LockError::Database)?;
    let conns = Conns::own(pool).with_faults(Arc::new(Faults::default()));
    let locker = Locker::from_backend(Lite::new(conns, crate::locker::DEFAULT_TABLE).into());
    locker.migrate().await?;
    Ok(locker)
}

/// Runs `fut` with `locker` as the default locker of its task: a `#[distributed_lock]` function
/// without `locker = ...` called inside it uses `locker`, whatever [`crate::set_default`] holds
/// (and [`crate::default_locker`] returns it). For code under test that relies on the process
/// default: each test gives it a test locker of its own, and tests running side by side in one
/// process do not meet. As an owner scope, it is the task's: a task spawned inside it does not
/// inherit it (give the spawned future its own `with_default`).
///
#[cfg_attr(feature = "macros", doc = "```")]
#[cfg_attr(not(feature = "macros"), doc = "```ignore")]
/// # async fn demo() -> Result<(), dblock::LockError> {
/// /// The code under test: it uses the process default in production.
/// #[dblock::distributed_lock(key = "report:{day}")]
/// async fn report(day: &str) -> Result<u64, dblock::LockError> {
///     Ok(dblock::current().unwrap().fencing_token)
/// }
///
/// let locker = dblock::testing::locker().await?;
/// dblock::testing::with_default(&locker, async {
///     let token = report("mon").await?;
///     // Taken in the test locker's database, and released.
///     let row = locker.inspect("report:mon").await?.expect("a row");
///     assert_eq!((row.fencing_token, row.held), (token, false));
///     Ok::<_, dblock::LockError>(())
/// })
/// .await?;
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap().block_on(demo()).unwrap();
/// ```
pub fn with_default<F: std::future::Future>(
    locker: &Locker,
    fut: F,
) -> impl std::future::Future<Output = F::Output> {
    crate::default_locker::scoped(locker.clone(), fut)
}

/// Ends the lease of every hold of `key` now, as if its holder had vanished (not a release):
/// the holder's next renewal, `extend` or `fence` fails with `Lost`, and any owner may take the
/// key. Semaphore permits of `key` too. Returns how many holds it ended.
///
/// ```
/// # async fn demo() -> Result<(), dblock::LockError> {
/// let locker = dblock::testing::locker().await?;
/// let guard = locker.lock("k").await?;
/// assert_eq!(dblock::testing::expire(&locker, "k").await?, 1);
/// let more = guard.extend(std::time::Duration::from_secs(30)).await;
/// assert!(matches!(more, Err(dblock::LockError::Lost { .. })));
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap().block_on(demo()).unwrap();
/// ```
pub async fn expire(locker: &Locker, key: &str) -> Result<u64, LockError> {
    crate::validate::key(key)?;
    let lite = test_backend(locker)?;
    let shared = locker.shared();
    let permits = shared.permits();
    let mut ended = lite.expire(&shared.table, key, false).await?;
    ended += lite.expire(&permits.table, key, true).await?;
    Ok(ended)
}

/// Another owner (a fresh one, whatever scope the caller runs in) takes the exclusive lock on
/// `key` now, from whoever holds it, with a new fencing token: [`Locker::steal`]. The holder's
/// next renewal, `extend`, `fence` or `succeed_in` says `Lost`, and its `lost()` resolves. The
/// thief's guard is returned: drop or release it to free the key. Works on any `Locker`.
///
/// ```
/// # async fn demo() -> Result<(), dblock::LockError> {
/// let locker = dblock::testing::locker().await?;
/// let guard = locker.lock("k").await?;
/// let thief = dblock::testing::steal(&locker, "k").await?;
/// assert!(thief.fencing_token() > guard.fencing_token());
/// assert!(guard.extend(std::time::Duration::from_secs(30)).await.unwrap_err().is_lost());
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap().block_on(demo()).unwrap();
/// ```
pub async fn steal(locker: &Locker, key: &str) -> Result<crate::LockGuard, LockError> {
    locker.steal(key).owner(&crate::Owner::new()).await
}

/// Stops renewing the holds of `key` that this locker renews (the renewer of a process that
/// hangs): their leases run out at their ttl unless the holder extends them, and the holder
/// learns it at its next `extend` or release (`NotHeld`) or `fence` (refused). Returns how many
/// holds it stopped.
///
/// ```
/// # async fn demo() -> Result<(), dblock::LockError> {
/// use std::time::Duration;
/// let locker = dblock::testing::locker().await?;
/// let guard = locker.lock("k").ttl(Duration::from_secs(10)).await?.auto_renew();
/// assert_eq!(dblock::testing::stop_renewal(&locker, "k"), 1);
/// tokio::time::sleep(Duration::from_secs(11)).await;
/// dblock::testing::assert_free(&locker, "k").await;
/// # drop(guard); Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap().block_on(demo()).unwrap();
/// ```
pub fn stop_renewal(locker: &Locker, key: &str) -> usize {
    let shared = locker.shared();
    shared.renewer.forget(key) + shared.permits().renewer.forget(key)
}

/// Makes the next `n` statements of the test locker fail before they are sent, as they do when
/// the connection is gone: nothing they would have done happens. dblock retries such a failure
/// within the call's `wait` (and renewal within the lease), as it would a real one, so `n`
/// larger than the retries a call makes is what turns into its error.
///
/// ```
/// # async fn demo() -> Result<(), dblock::LockError> {
/// let locker = dblock::testing::locker().await?;
/// dblock::testing::fail_next(&locker, 1000)?;
/// assert!(locker.lock("k").await.is_err());
/// dblock::testing::fail_next(&locker, 0)?; // healed
/// locker.lock("k").await?;
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap().block_on(demo()).unwrap();
/// ```
pub fn fail_next(locker: &Locker, n: u32) -> Result<(), LockError> {
    faults(locker)?.fail.store(n, Ordering::SeqCst);
    Ok(())
}

/// Makes the next `n` statements of the test locker take effect with their replies lost: the
/// caller sees "outcome unknown", as when a connection drops after the server committed. An
/// acquire whose reply is lost is settled as dblock settles it after a real loss (the key is
/// given back, never leaked); a release whose reply is lost is retried by the background
/// release path.
///
/// ```
/// # async fn demo() -> Result<(), dblock::LockError> {
/// let locker = dblock::testing::locker().await?;
/// let guard = locker.lock("k").await?;
/// dblock::testing::lose_next_replies(&locker, 1)?;
/// let _ = guard.release().await; // the release committed; its reply is what was lost
/// dblock::testing::assert_free(&locker, "k").await;
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap().block_on(demo()).unwrap();
/// ```
pub fn lose_next_replies(locker: &Locker, n: u32) -> Result<(), LockError> {
    faults(locker)?.lost.store(n, Ordering::SeqCst);
    Ok(())
}

/// Panics unless `key` is held (a live lease, or a `lock_in` hold) in `locker`'s table;
/// returns what it found, with the owner and holder.
///
/// ```
/// # async fn demo() -> Result<(), dblock::LockError> {
/// let locker = dblock::testing::locker().await?;
/// let _guard = locker.lock("k").holder("worker-1").await?;
/// let info = dblock::testing::assert_held(&locker, "k").await;
/// assert!(info.holder.unwrap().ends_with("worker-1"));
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap().block_on(demo()).unwrap();
/// ```
#[track_caller]
pub fn assert_held<'a>(
    locker: &'a Locker,
    key: &'a str,
) -> impl std::future::Future<Output = LockInfo> + 'a {
    let caller = std::panic::Location::caller();
    async move {
        match locker.inspect(key).await {
            Ok(Some(info)) if info.held => info,
            Ok(Some(info)) => panic!(
                "{caller}: expected {key:?} to be held; it is free (last holder {}, owner {}, {:?})",
                shown(info.holder.as_deref()),
                shown(info.owner.as_deref()),
                info.last_outcome,
            ),
            Ok(None) => panic!("{caller}: expected {key:?} to be held; it was never taken"),
            Err(e) => panic!("{caller}: could not look {key:?} up: {e}"),
        }
    }
}

/// Panics if `key` is held in `locker`'s table, naming its owner, holder and fencing token.
///
/// ```
/// # async fn demo() -> Result<(), dblock::LockError> {
/// let locker = dblock::testing::locker().await?;
/// dblock::testing::assert_free(&locker, "k").await;
/// locker.lock("k").await?.release().await?;
/// dblock::testing::assert_free(&locker, "k").await;
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap().block_on(demo()).unwrap();
/// ```
#[track_caller]
pub fn assert_free<'a>(
    locker: &'a Locker,
    key: &'a str,
) -> impl std::future::Future<Output = ()> + 'a {
    let caller = std::panic::Location::caller();
    async move {
        match locker.inspect(key).await {
            Ok(Some(info)) if info.held => panic!(
                "{caller}: expected {key:?} to be free; it is held by {} (owner {}, fencing token {}, {:?} left)",
                shown(info.holder.as_deref()),
                shown(info.owner.as_deref()),
                info.fencing_token,
                info.time_left,
            ),
            Ok(_) => {}
            Err(e) => panic!("{caller}: could not look {key:?} up: {e}"),
        }
    }
}

fn shown(s: Option<&str>) -> &str {
    s.unwrap_or("(none)")
}

/// The test locker's SQLite dialect, or an error saying this is not a test locker.
fn test_backend(locker: &Locker) -> Result<&Lite, LockError> {
    #[allow(unreachable_patterns)] // a build with SQLite alone has no other backend
    match locker.shared().backend()? {
        Backend::Sqlite(lite) if lite.faults().is_some() => Ok(lite),
        _ => Err(not_a_test_locker()),
    }
}

fn faults(locker: &Locker) -> Result<&Arc<Faults>, LockError> {
    test_backend(locker)?.faults().ok_or_else(not_a_test_locker)
}

fn not_a_test_locker() -> LockError {
    LockError::Config(
        "the fault hooks of dblock::testing work on dblock::testing::locker() alone".into(),
    )
}
