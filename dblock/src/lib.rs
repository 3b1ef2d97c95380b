//! # dblock — distributed locks in the database you already run
//!
//! A lock that is safe across processes and machines, kept in a table of the relational
//! database the service already has: PostgreSQL, MySQL 8 / MariaDB ≥ 10.5, or SQLite (the
//! embedded default). No Redis, no ZooKeeper.
//!
//! ```
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
//!   COMMITTED without an explicit transaction. A busy attempt writes nothing.
//! - **No hold counted twice**: statements the server rolled back are retried; after a broken
//!   connection the same attempt id is sent again and recognised.
//! - **Released on every exit**: [`LockGuard::release`], or on drop in the background at once.
//!
//! ## Backends (cargo features)
//! `sqlite` (default), `postgres`, `mysql`; `macros` (default) re-exports the attribute.

#![cfg_attr(docsrs, feature(doc_cfg))]

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;
mod backend;
mod error;
mod guard;
mod locker;
mod owner;

use std::time::{Duration, SystemTime};

pub use error::{LockError, Result};
pub use guard::LockGuard;
pub use locker::{default_locker, set_default, LockRequest, Locker, DEFAULT_TTL, MAX_KEY_LEN};
pub use owner::{current, HeldLock, Owner};

#[cfg(feature = "macros")]
#[cfg_attr(docsrs, doc(cfg(feature = "macros")))]
pub use dblock_macros::distributed_lock;

/// One row of the lock table as [`Locker::inspect`] and [`Locker::held`] report it.
///
/// When the lock is not held (free, or its lease ran out) `owner` is `None` and `hold_count` 0;
/// `holder` still names the last holder, for operators.
///
/// ```
/// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
/// if let Some(info) = locker.inspect("order:42").await? {
///     println!("held={} token={} holder={:?} left={:?}",
///              info.held, info.fencing_token, info.holder, info.time_left);
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockInfo {
    /// The lock key.
    pub key: String,
    /// The owner id while held, else `None`.
    pub owner: Option<String>,
    /// `host/pid[/label]` of the current (or last) holder.
    pub holder: Option<String>,
    /// The owner's re-entry count while held, else 0.
    pub hold_count: u32,
    /// The key's fencing token (of the current or last tenure).
    pub fencing_token: u64,
    /// Lease end while held; when free, the time it was freed. Database clock.
    pub expires_at: SystemTime,
    /// When the current (or last) owner took the key. Database clock.
    pub acquired_at: SystemTime,
    /// `true` while an owner holds a live lease.
    pub held: bool,
    /// Lease time left, measured by the database (zero when not held).
    pub time_left: Duration,
}

impl LockInfo {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn from_parts(
        key: String,
        owner: Option<String>,
        holder: Option<String>,
        hold_count: i64,
        fencing_token: i64,
        expires_at_us: i64,
        acquired_at_us: i64,
        held: bool,
        remaining_ms: i64,
    ) -> Self {
        LockInfo {
            key,
            owner: if held { owner } else { None },
            holder,
            hold_count: if held { hold_count.max(0) as u32 } else { 0 },
            fencing_token: fencing_token as u64,
            expires_at: backend::time_from_micros(expires_at_us),
            acquired_at: backend::time_from_micros(acquired_at_us),
            held,
            time_left: if held {
                backend::millis(remaining_ms)
            } else {
                Duration::ZERO
            },
        }
    }
}
