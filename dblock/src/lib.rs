//! # dblock — distributed locks in the database you already run
//!
//! A lock that is safe across processes and machines, kept in a table of the relational
//! database the service already has: PostgreSQL, MySQL 8 / MariaDB ≥ 10.5, or SQLite (the
//! embedded default). No Redis, no ZooKeeper.
//!
#![cfg_attr(feature = "sqlite", doc = "```")]
#![cfg_attr(not(feature = "sqlite"), doc = "```no_run")]
//! # async fn demo() -> Result<(), dblock::LockError> {
//! use std::time::Duration;
//!
//! let locker = dblock::Locker::connect("sqlite::memory:").await?; // or postgres://…, mysql://…
//! locker.migrate().await?;
//!
//! let guard = locker.lock("order:42").ttl(Duration::from_secs(30)).wait(Duration::from_secs(5)).await?;
//! println!("settling order 42 with fencing token {}", guard.fencing_token());
//! guard.release().await?;
//! # Ok(()) }
//! # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
//! ```
//!
//! ## Guarantees
//! - **Mutual exclusion per key** across everything sharing the table. Keys are exact byte
//!   strings of 1–255 bytes (`"a"`, `"A"`, `"a "` are three locks on every backend).
//! - **Expiry on the database clock**, never the client's. An expired lease is free for anyone;
//!   its old owner's `release` / `extend` then fail with [`LockError::NotHeld`].
//! - **Ownership**: every owner is a random UUID v4; only it can extend or release.
//! - **Reentrancy counted in the database**: an owner taking a key it holds gets `hold_count`
//!   one higher; the key is free when the count returns to zero. See [`Owner`].
//! - **Fencing tokens** strictly increase each time a key changes owner, also after the row was
//!   purged (new rows are seeded from the database clock in microseconds).
//! - **One statement, one round trip** for acquire, re-entry, release and extend, atomic at READ
//!   COMMITTED without an explicit transaction. A busy attempt writes nothing (on PostgreSQL a
//!   waiter flags the row once per contention episode, so the release can NOTIFY it).
//! - **No hold counted twice**: statements the server rolled back are retried; after a broken
//!   connection the same attempt id is sent again and recognised.
//! - **Released on every exit**: [`LockGuard::release`], or on drop in the background at once.
//! - **Faults end honestly**: a grant is returned only while its lease is live; `wait` bounds
//!   the whole call; a statement whose answer never came is resolved in the background (a hold
//!   it took is given back, a release goes on being sent) and the error says the outcome is
//!   unknown ([`LockError::is_outcome_unknown`]); re-entry counts only the holds this process
//!   tracks. SQLite: processes sharing one file must share one clock.
//!
//! ## Cargo features
//! Backends: `sqlite` (default), `postgres`, `mysql`. `macros` (default) re-exports the
//! attribute. `metrics` reports acquire latency, wait and hold time, busy and lost counts,
//! renewal failures and held locks through the [`metrics`](https://docs.rs/metrics) facade,
//! labelled by key template (see [`LockRequest::metrics_key`]): `dblock_acquire_seconds`,
//! `dblock_wait_seconds`, `dblock_hold_seconds`, `dblock_busy_total`, `dblock_lost_total`,
//! `dblock_max_hold_reached_total`, `dblock_renewal_failures_total`, `dblock_held`.

#![cfg_attr(docsrs, feature(doc_cfg))]

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;
mod backend;
mod connect;
mod default_locker;
mod detach;
mod error;
mod escape;
mod exclusive;
mod fair;
mod guard;
mod hold;
mod in_tx;
mod info;
mod leader;
mod line;
mod locker;
mod meter;
mod multi;
mod open;
mod operator;
mod options;
mod owner;
mod proof;
mod read;
mod redact;
mod registry;
mod renew;
mod request;
mod retry;
mod semaphore;
mod shared;
mod sync;
#[cfg(feature = "_test-util")]
pub mod test_util;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
mod timing;
mod validate;
mod wait;
mod watch;

/// The Rust snippets of the README and of `docs/`, compiled (and, unless marked `no_run`, run)
/// as doctests by `cargo test --all-features`, so that none of them can drift from the API.
/// `tests/docs.rs` checks that every chapter with a Rust snippet is listed here.
#[cfg(all(
    doctest,
    feature = "postgres",
    feature = "mysql",
    feature = "sqlite",
    feature = "macros"
))]
mod doc_snippets {
    #[doc = include_str!("../../README.md")]
    struct Readme;
    #[doc = include_str!("../../docs/attribute.md")]
    struct Attribute;
    #[doc = include_str!("../../docs/handle.md")]
    struct Handle;
    #[doc = include_str!("../../docs/once.md")]
    struct Once;
    #[doc = include_str!("../../docs/transactions.md")]
    struct Transactions;
    #[doc = include_str!("../../docs/proofs.md")]
    struct Proofs;
    #[doc = include_str!("../../docs/semaphores.md")]
    struct Semaphores;
    #[doc = include_str!("../../docs/shared-locks.md")]
    struct SharedLocks;
    #[doc = include_str!("../../docs/leader.md")]
    struct Leader;
    #[doc = include_str!("../../docs/guarantees.md")]
    struct Guarantees;
    #[doc = include_str!("../../docs/production.md")]
    struct Production;
    #[doc = include_str!("../../docs/coalescing.md")]
    struct Coalescing;
    #[doc = include_str!("../../docs/benchmarks.md")]
    struct Benchmarks;
    #[doc = include_str!("../../docs/reference.md")]
    struct Reference;
    #[cfg(feature = "testing")]
    #[doc = include_str!("../../docs/testing.md")]
    struct Testing;
}

pub use backend::fence::FenceConnection;
pub use connect::{ConnectOptions, MAX_TIMEOUT};
pub use default_locker::{default_locker, set_default};
pub use error::{LockError, Result};
pub use escape::Escaped;
pub use guard::LockGuard;
pub use in_tx::{LockInRequest, TxLock};
pub use info::{LockInfo, LockKind, Outcome};
pub use leader::{LeaderRequest, Leadership, Observe};
pub use locker::Locker;
pub use multi::{LockAllRequest, MAX_LOCK_ALL_KEYS};
pub use operator::{MigrationStatus, Waiter};
pub use options::DEFAULT_TTL;
pub use owner::{current, current_all, fence, release_in, succeed_in, HeldLock, Owner};
pub use proof::{mode, AnyLock, Held, LockMarker};
pub use read::ReadRequest;
pub use request::LockRequest;
pub use semaphore::{SemaphoreRequest, MAX_PERMITS, MAX_SEMAPHORE_KEY_LEN};
pub use validate::MAX_KEY_LEN;
pub use watch::{KeyEvent, LockEvent, Watch};

/// The [sqlx](https://docs.rs/sqlx) this crate is built on, with the features the enabled
/// backends need: its pools ([`Locker::postgres`], [`Locker::mysql`], [`Locker::sqlite`]), its
/// transactions ([`LockGuard::fence`]) and its errors ([`LockError::Database`]) are part of
/// dblock's API, so use this one and the versions always match.
///
#[cfg_attr(feature = "sqlite", doc = "```")]
#[cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
/// # async fn demo() -> Result<(), dblock::LockError> {
/// use dblock::sqlx;
///
/// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
/// let locker = dblock::Locker::sqlite(pool);
/// locker.migrate().await?;
/// # Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
/// ```
pub use sqlx;

/// Runs an `async fn` while holding a distributed lock.
///
#[cfg_attr(feature = "sqlite", doc = "```")]
#[cfg_attr(not(feature = "sqlite"), doc = "```no_run")]
/// # #[derive(Debug)] struct AppError;
/// # impl From<dblock::LockError> for AppError { fn from(_: dblock::LockError) -> Self { AppError } }
/// # struct Receipt;
/// #[dblock::distributed_lock(key = "order:{order_id}", ttl = "30s", wait = "5s")]
/// async fn settle(order_id: u64) -> Result<Receipt, AppError> {
///     // only one process at a time gets here for a given order
///     Ok(Receipt)
/// }
/// # async fn demo() -> Result<(), AppError> {
/// # dblock::set_default(dblock::Locker::connect("sqlite::memory:").await?);
/// # dblock::default_locker()?.migrate().await?;
/// settle(42).await?;
/// # Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
/// ```
///
/// The key is built on entry, the lock taken, the body run, and the lock released on every
/// exit: return, `return`, `?`, a panic (which then continues) and the future being dropped
/// half-way (`tokio::time::timeout`, `select!`), the last two in the background at once. A lock
/// that stays busy for the whole `wait` makes the call return
/// `Err(E::from(LockError::Busy { .. }))` without running the body.
///
/// # Arguments
///
/// | argument | meaning | default |
/// |---|---|---|
/// | `key` | string literal template, or any expression whose value is `impl Display`; or a list of them, `[..]`, for several keys at once | required |
/// | `ttl` | lease: `"30s"`, `"500ms"`, `"1m30s"`, `"2h"` (checked at compile time) or a `Duration` expression | `"30s"` |
/// | `wait` | how long to keep trying; `"0s"` = one attempt | `"0s"` |
/// | `locker` | expression giving `Locker` or `&Locker` (also `Arc<Locker>`), evaluated on entry | [`set_default`] |
/// | `renew` | keep extending the lease while the body runs; `false`: the lease ends at `ttl` and the body goes on (a `max_hold` cap or a shutdown still ends it) | `true` |
/// | `max_hold` | a hard cap: the lease never runs past `acquired_at + max_hold` (database clock); at the cap the body is cancelled and the call returns `Err(Lost)` ([`LockRequest::max_hold`]) | none |
/// | `lock_delay` | after a lease that ends without a release, the key stays unavailable this long more ([`LockRequest::lock_delay`]) | the locker's (zero) |
/// | `min_hold` | the key stays unavailable to others until this long after it was taken, however quick the body ([`LockRequest::min_hold`]) | none |
/// | `once` | run until the work succeeds once: after an `Ok`, the call returns `Err(LockError::AlreadyDone)` without running the body ([`LockRequest::once`]) | `false` |
/// | `fair` | wait in arrival order across processes, by a ticket in the database ([`LockRequest::fair`]) | `false` |
/// | `reentrant` | `false`: a call of an owner that holds the key waits for that hold like any other owner's (sibling futures of one task exclude each other); inside a body that holds the key, `Err(WouldWaitForItself)` at once ([`LockRequest::reentrant`]); with `permits`, each call takes a permit of its own ([`SemaphoreRequest::reentrant`]) | `true` |
/// | `permits` | a `u32` expression: the body runs under one permit of the key's counting semaphore, at most that many at once ([`Locker::semaphore`]); one key, none of `min_hold`, `once`, `fair` | none (the lock) |
/// | `shared` | `true`: the body runs under a shared (read) hold of the key; the lock of the same key (`shared = false`, the default) is its writer ([`Locker::read`]); one key, none of `min_hold`, `once`, `fair`, `reentrant`, `permits` | `false` |
/// | `tx` | `tx = tx`: the key is taken with one statement inside the transaction the named parameter holds (`&mut sqlx::Transaction<'_, DB>` or a connection) and held until it commits or rolls back ([`Locker::lock_in`]); no lease options, no `reentrant` | none |
/// | `proof` | `proof = held`: a variable `held: dblock::Held<'_>` in the body, the proof that the lock is held ([`Held`]); `proof = held: K` for a marker `K` of [`lock_kind!`] | none |
/// | `crate` | path to this crate when re-exported under another name | `::dblock` |
///
/// **`key`**: `{param}` is a parameter, `{param.field.sub}` a field path (`{pair.0}` for tuples),
/// `{self.field}` a receiver field; values are formatted with `Display`; `{{` and `}}` are
/// literal braces. Unknown names, positional `{}`, unclosed braces and `self` outside a method are
/// compile errors at the key string. Any other expression is formatted with `Display`:
///
/// ```
/// # use dblock::{distributed_lock, LockError};
/// struct Job { tenant: String, id: u32 }
///
/// #[distributed_lock(key = "job:{job.tenant}/{job.id}")]
/// async fn run(job: &Job) -> Result<(), LockError> { Ok(()) }
///
/// #[distributed_lock(key = format!("report-{}", day.to_uppercase()))]
/// async fn report(day: &str) -> Result<(), LockError> { Ok(()) }
/// ```
///
/// **`ttl`** and **`wait`**: literals in `h`, `m`, `s`, `ms`, `us`, combined (`"1m30s"`), or any
/// expression of type [`Duration`](std::time::Duration):
///
/// ```
/// # use dblock::{distributed_lock, LockError};
/// # use std::time::Duration;
/// # const LEASE: Duration = Duration::from_secs(10);
/// #[distributed_lock(key = "nightly", ttl = "2h", wait = "1m30s")]
/// async fn nightly() -> Result<(), LockError> { Ok(()) }
///
/// #[distributed_lock(key = "sync", ttl = LEASE, wait = Duration::from_millis(250))]
/// async fn sync() -> Result<(), LockError> { Ok(()) }
/// ```
///
/// **`locker`**: which [`Locker`] to use; without it, the process default from [`set_default`]
/// (or `Err(LockError::NoLocker)`).
///
/// ```
/// # use dblock::{distributed_lock, LockError, Locker};
/// struct Billing { locks: Locker }
///
/// impl Billing {
///     #[distributed_lock(key = "invoice:{id}", locker = self.locks)]
///     async fn invoice(&self, id: u64) -> Result<(), LockError> { Ok(()) }
/// }
/// ```
///
/// **`renew`**: with `true` (the default) the lease is extended about every ttl/3 while the body
/// runs, so a short ttl only matters when the process dies; if an extension finds the lock gone,
/// the body is dropped at its next `.await` and the call returns `Err(LockError::Lost)`. With
/// `false` the lease simply ends at `ttl`.
///
/// ```
/// # use dblock::{distributed_lock, LockError};
/// #[distributed_lock(key = "quick", ttl = "5s", renew = false)]
/// async fn quick() -> Result<(), LockError> { Ok(()) }
/// ```
///
/// **`min_hold`** and **`once`**: a job started on every instance each period runs once a
/// period (`min_hold` just under the period), and a payout runs until it succeeds once. Every
/// release records how the body ended — `Ok` as [`Outcome::Succeeded`], `Err`, a panic or a
/// cancellation as [`Outcome::Failed`] — and `once` builds on that. A success recorded by the
/// release comes after the body's own transaction committed, so for work in the lock's own
/// database record it inside that transaction with [`succeed_in`]: then `once` is exactly-once,
/// even if the process dies before its release. For work elsewhere `once` is at-least-once (a
/// crash between the work and the release runs it again): pass the fencing token on.
///
/// ```
/// # use dblock::{distributed_lock, LockError};
/// #[distributed_lock(key = "report", wait = "0s", min_hold = "55s")]
/// async fn minutely_report() -> Result<(), LockError> { Ok(()) }
///
/// #[distributed_lock(key = "payout:{id}", once = true)]
/// async fn payout(id: u64) -> Result<(), LockError> { Ok(()) }
/// ```
///
/// **Several keys**: `key = ["acct:{from}", "acct:{to}"]` takes every key or none, always in
/// one canonical order (sorted by bytes, duplicates merged), so two calls naming the same keys
/// in opposite orders cannot deadlock; `wait` bounds the whole; a key that stays busy gives back
/// those already taken. [`current_all()`] lists them in the body, with their tokens.
///
/// ```
/// # use dblock::{distributed_lock, LockError};
/// #[distributed_lock(key = ["acct:{from}", "acct:{to}"], wait = "5s")]
/// async fn transfer(from: u64, to: u64) -> Result<(), LockError> {
///     assert_eq!(dblock::current_all().len(), if from == to { 1 } else { 2 });
///     Ok(())
/// }
/// ```
///
/// **Transactions — the trap**: the lock is released when the function returns. Called inside
/// a caller's *open* transaction, that is before the transaction commits: another instance then
/// takes the key, reads the old data, and one of the two updates is lost, while both calls
/// returned `Ok`. Open and commit the transaction *inside* the locked function, and fence it:
/// [`fence`] (or [`LockGuard::fence`]) in that transaction, on the lock's own database, checks
/// that every lease of the body is still ours and keeps it so until the commit — a holder that
/// stalled past its lease gets `Err(LockError::Lost)` and its writes roll back. For data in
/// another store, write the fencing token along and let the store refuse older tokens (see
/// `docs/transactions.md`).
///
#[cfg_attr(feature = "sqlite", doc = "```")]
#[cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
/// # use dblock::{distributed_lock, LockError};
/// # #[derive(Debug)] struct AppError;
/// # impl From<LockError> for AppError { fn from(_: LockError) -> Self { AppError } }
/// # impl From<sqlx::Error> for AppError { fn from(_: sqlx::Error) -> Self { AppError } }
/// #[distributed_lock(key = "acct:{id}")]
/// async fn deposit(db: &sqlx::SqlitePool, id: i64, cents: i64) -> Result<(), AppError> {
///     let mut tx = db.begin().await?; // inside the lock, not around it
///     sqlx::query("UPDATE accounts SET cents = cents + ? WHERE id = ?")
///         .bind(cents).bind(id).execute(&mut *tx).await?;
///     dblock::fence(&mut *tx).await?; // still ours until the commit, or roll back
///     tx.commit().await?;
///     Ok(())
/// }
/// ```
///
/// **`crate`**: for code that re-exports dblock under another path.
///
/// ```
/// mod infra { pub(crate) use ::dblock as locks; }
///
/// #[dblock::distributed_lock(key = "k", crate = infra::locks)]
/// async fn f() -> Result<(), infra::locks::LockError> { Ok(()) }
/// ```
///
/// # Owners, reentrancy, fencing
/// The body runs as the lock's owner: a nested locked call in the same task (also on the same
/// key) is reentrant (`hold_count` 2 in the row meanwhile), and [`current()`] gives the body the
/// innermost lock's key and fencing token. A spawned task is a new owner unless it runs in
/// [`Owner::scope`].
///
/// ```
/// # use dblock::{distributed_lock, LockError};
/// #[distributed_lock(key = "account:{id}")]
/// async fn transfer(id: u64) -> Result<u64, LockError> {
///     let token = dblock::current().expect("inside a locked body").fencing_token;
///     audit(id).await?; // same key, same task: reentrant
///     Ok(token)
/// }
///
/// #[distributed_lock(key = "account:{id}")]
/// async fn audit(id: u64) -> Result<(), LockError> { Ok(()) }
/// ```
///
/// # Rules checked at compile time
/// The function must be `async` (not `const`, not `extern`) and return `Result<T, E>` with
/// `E: From<LockError>` (aliases such as `anyhow::Result<T>` work). Every mistake is reported in
/// one build, spanned at the offending token, and the function is still emitted so the IDE keeps
/// working. The generated future is `Send` exactly when the body's is and the return value is
/// `Send` (it is kept while the release runs: `Box<dyn Error>` is not, `Box<dyn Error + Send +
/// Sync>` and `anyhow::Error` are), and allocates nothing beyond the key string.
#[cfg(feature = "macros")]
#[cfg_attr(docsrs, doc(cfg(feature = "macros")))]
pub use dblock_macros::distributed_lock;
