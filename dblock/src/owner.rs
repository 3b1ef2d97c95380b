//! Who holds a lock: [`Owner`], the task-scoped owner context, and [`current`].

use std::fmt;

use crate::backend::fence::{FenceConnection, Owned};
use std::future::{Future, IntoFuture};
use std::sync::Arc;
use std::time::SystemTime;

tokio::task_local! {
    static CONTEXT: Context;
}

/// What a task running "as an owner" carries: the owner, and the locks its locked bodies hold
/// holds (for [`current`]).
#[derive(Clone)]
pub(crate) struct Context {
    pub(crate) owner: Owner,
    /// Every lock of the enclosing locked bodies, outermost first.
    pub(crate) held: Arc<[HeldLock]>,
}

impl Context {
    /// The context of the running task, if it runs in an owner scope or a locked body.
    pub(crate) fn get() -> Option<Context> {
        CONTEXT.try_with(Context::clone).ok()
    }

    /// Runs `fut` with this context as the task's owner context.
    pub(crate) fn scope<F: Future>(self, fut: F) -> impl Future<Output = F::Output> {
        CONTEXT.scope(self, fut)
    }
}

/// Whether a row's owner is a kind's marker (`(readers)`), not an owner's id: the holders of
/// such a row are many, and none of them is named by it. Owner ids are UUIDs
/// ([`Owner::new`]), never in parentheses.
pub(crate) fn is_marker(owner: &str) -> bool {
    owner.starts_with('(') && owner.ends_with(')')
}

/// The identity that holds locks: a random 128-bit id (UUID v4).
///
/// Only the owner of a lock can extend or release it, and an owner that asks again for a key it
/// holds gets it at once with `hold_count` one higher (reentrancy, counted in the database).
///
/// - [`Owner::current`] is the owner of the running locked scope (a `#[distributed_lock]` body or
///   an [`Owner::scope`]);
/// - [`Locker::lock`](crate::Locker::lock) inside such a scope acquires as that owner, and
///   outside any scope as a fresh owner, so two such calls exclude each other even in one task;
/// - a spawned task is a new owner unless it runs in `owner.scope(..)`.
///
#[cfg_attr(feature = "sqlite", doc = "```")]
#[cfg_attr(not(feature = "sqlite"), doc = "```no_run")]
/// # async fn demo() -> Result<(), dblock::LockError> {
/// let locker = dblock::Locker::connect("sqlite::memory:").await?;
/// locker.migrate().await?;
///
/// let owner = dblock::Owner::new();
/// let inner = locker.clone();
/// owner
///     .scope(async move {
///         let outer = inner.lock("report").await?;
///         let again = inner.lock("report").await?; // same owner: re-entry
///         assert_eq!(again.hold_count(), 2);
///         assert_eq!(again.fencing_token(), outer.fencing_token());
///         again.release().await?;
///         outer.release().await
///     })
///     .await
/// # }
/// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Owner {
    id: Arc<str>,
}

impl Owner {
    /// A row owner that is no owner's id but a kind's marker (a shared lock's readers hold its
    /// row under one), written `(name)`: see [`is_marker`].
    pub(crate) fn marker(marker: &'static str) -> Self {
        debug_assert!(is_marker(marker));
        Owner {
            id: Arc::from(marker),
        }
    }

    /// A fresh owner with a new random id.
    ///
    /// ```
    /// assert_ne!(dblock::Owner::new(), dblock::Owner::new());
    /// ```
    pub fn new() -> Self {
        Owner {
            id: Arc::from(
                &*uuid::Uuid::new_v4()
                    .hyphenated()
                    .encode_lower(&mut uuid::Uuid::encode_buffer()),
            ),
        }
    }

    /// The owner of the running locked scope, or `None` outside any.
    ///
    /// ```
    /// assert!(dblock::Owner::current().is_none());
    /// ```
    pub fn current() -> Option<Owner> {
        CONTEXT.try_with(|c| c.owner.clone()).ok()
    }

    /// The id stored in the `owner` column.
    ///
    /// ```
    /// assert_eq!(dblock::Owner::new().id().len(), 36);
    /// ```
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The id, shared rather than copied.
    pub(crate) fn shared_id(&self) -> Arc<str> {
        self.id.clone()
    }

    /// Runs `fut` (a future, or a [`LockRequest`](crate::LockRequest)) as this owner: locks taken
    /// inside it (also by `#[distributed_lock]` functions) belong to this owner, so taking a key
    /// this owner already holds is reentrant.
    ///
    /// Use it to hand an owner to a spawned task:
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let owner = dblock::Owner::new();
    /// let guard = owner.scope(locker.lock("job:9")).await?;
    /// let child = tokio::spawn(owner.clone().scope(async move {
    ///     locker.lock("job:9").await.map(|g| g.hold_count()) // reentrant: same owner
    /// }));
    /// assert_eq!(child.await.unwrap()?, 2);
    /// # drop(guard); Ok(())
    /// # }
    /// ```
    pub fn scope<F: IntoFuture>(&self, fut: F) -> impl Future<Output = F::Output> {
        Context {
            owner: self.clone(),
            held: Arc::from([]),
        }
        .scope(fut.into_future())
    }
}

impl Default for Owner {
    fn default() -> Self {
        Owner::new()
    }
}

impl fmt::Debug for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Owner").field(&&*self.id).finish()
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id)
    }
}

/// A lock held by the running locked body, as [`current`] and [`current_all`] report it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HeldLock {
    /// The lock key.
    pub key: String,
    /// The fencing token of this tenure: pass it to the resource the lock protects.
    pub fencing_token: u64,
    /// The owner's hold count for this key when the body started.
    pub hold_count: u32,
    /// Lease end on the database clock, as of acquisition.
    pub expires_at: SystemTime,
    /// The lock table (for `dblock::fence`).
    pub(crate) table: Arc<str>,
    /// The key of the row in it (a semaphore's permit has a row of its own).
    pub(crate) row_key: Arc<str>,
    /// The owner id (for `dblock::fence`).
    pub(crate) owner: Arc<str>,
    /// The fence goes as a simple query with inlined values (PostgreSQL behind a pooler).
    pub(crate) simple: bool,
    /// An exclusive lock (a lock, one key of `lock_all`, a leadership), not a read or a permit.
    pub(crate) exclusive: bool,
    /// Taken inside a transaction (`lock_in`): no lease, its row lock is the lock.
    pub(crate) in_tx: bool,
    /// `release_in` releases it (a lease of hold count 1, not a read; not `in_tx`).
    pub(crate) releasable: bool,
    /// Set once `dblock::release_in` has released it in the caller's transaction.
    pub(crate) released_in: ReleasedIn,
}

impl HeldLock {
    /// The values its fence or `release_in` binds: its row's key, owner and tenure.
    fn owned(&self) -> Owned<'_> {
        Owned::new(&self.row_key, &self.owner, self.fencing_token, self.simple)
    }
}

/// Whether a hold was released in the caller's transaction (`release_in`): shared between the
/// hold and the [`HeldLock`]s that describe it. Not part of a `HeldLock`'s value (equality).
#[derive(Clone, Debug, Default)]
pub(crate) struct ReleasedIn(pub(crate) Arc<std::sync::atomic::AtomicBool>);

impl ReleasedIn {
    pub(crate) fn set(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Release);
    }

    pub(crate) fn get(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl PartialEq for ReleasedIn {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for ReleasedIn {}

/// The innermost lock held by this task's locked body (`#[distributed_lock]`), or `None`.
///
/// This is how a body hands its fencing token to the resource it protects.
///
/// ```
/// assert!(dblock::current().is_none()); // not inside a locked body
/// ```
pub fn current() -> Option<HeldLock> {
    CONTEXT.try_with(|c| c.held.last().cloned()).ok().flatten()
}

/// Every lock held by this task's locked bodies (`#[distributed_lock]`, also with a list of
/// keys, and the bodies it is nested in), outermost first, each with its fencing token. Empty
/// outside any locked body.
///
#[cfg_attr(feature = "macros", doc = "```")]
#[cfg_attr(not(feature = "macros"), doc = "```ignore")]
/// # use dblock::{distributed_lock, LockError};
/// #[distributed_lock(key = ["acct:{from}", "acct:{to}"])]
/// async fn transfer(from: u64, to: u64) -> Result<(), LockError> {
///     for lock in dblock::current_all() {
///         println!("{} under token {}", lock.key, lock.fencing_token);
///     }
///     Ok(())
/// }
/// assert!(dblock::current_all().is_empty());
/// ```
pub fn current_all() -> Vec<HeldLock> {
    CONTEXT.try_with(|c| c.held.to_vec()).unwrap_or_default()
}

/// Fences a write with every lock of the running locked body (and of the bodies it is nested
/// in): inside the caller's transaction on the locks' own database, checks that each lease is
/// still ours and live and locks its row until that transaction ends, so no other owner can
/// take a key over before the caller commits or rolls back. `Err(Lost)` if any is not held:
/// roll back. Outside a locked body there is no lock to fence: that is an error
/// ([`LockError::Config`](crate::LockError::Config)), never a silent pass — for a lock taken
/// with [`Locker::lock`](crate::Locker::lock) use [`LockGuard::fence`](crate::LockGuard::fence).
/// See
/// [`LockGuard::fence`](crate::LockGuard::fence) for what it costs and how it meets isolation
/// levels.
///
#[cfg_attr(all(feature = "macros", feature = "sqlite"), doc = "```")]
#[cfg_attr(not(all(feature = "macros", feature = "sqlite")), doc = "```ignore")]
/// # #[derive(Debug)] struct AppError;
/// # impl From<dblock::LockError> for AppError { fn from(_: dblock::LockError) -> Self { AppError } }
/// # impl From<sqlx::Error> for AppError { fn from(_: sqlx::Error) -> Self { AppError } }
/// #[dblock::distributed_lock(key = ["acct:{from}", "acct:{to}"])]
/// async fn transfer(db: &sqlx::SqlitePool, from: i64, to: i64, cents: i64) -> Result<(), AppError> {
///     let mut tx = db.begin().await?;
///     sqlx::query("UPDATE accounts SET cents = cents - ? WHERE id = ?")
///         .bind(cents).bind(from).execute(&mut *tx).await?;
///     sqlx::query("UPDATE accounts SET cents = cents + ? WHERE id = ?")
///         .bind(cents).bind(to).execute(&mut *tx).await?;
///     dblock::fence(&mut *tx).await?; // both leases still ours, and stay so until the commit
///     tx.commit().await?;
///     Ok(())
/// }
/// ```
pub async fn fence<C: FenceConnection>(conn: &mut C) -> Result<(), crate::LockError> {
    fence_all(conn, false).await
}

/// Records the success of every lock of the running locked body (and of the bodies it is nested
/// in) **inside the caller's transaction**, so that it commits or rolls back with the work: all
/// that [`fence`] does, and each hold's outcome `Succeeded`. A committed success stands whatever
/// happens after it — the process crashing before its release, the body returning `Err` later —
/// so with `once` the work is done exactly once when it lives in the lock's own database.
/// `Err(Lost)` if any lease is not ours and live any more: roll back. Outside a locked body it
/// is an error ([`LockError::Config`](crate::LockError::Config)); for a lock taken with
/// [`Locker::lock`](crate::Locker::lock) use
/// [`LockGuard::succeed_in`](crate::LockGuard::succeed_in).
///
/// Work outside the lock's database (an HTTP call, another database) cannot commit with the
/// outcome: there `once` is at-least-once (a crash after the work and before the release runs
/// it again); hand the fencing token to that resource so it can refuse a stale holder.
///
#[cfg_attr(all(feature = "macros", feature = "sqlite"), doc = "```")]
#[cfg_attr(not(all(feature = "macros", feature = "sqlite")), doc = "```ignore")]
/// # #[derive(Debug)] struct AppError;
/// # impl From<dblock::LockError> for AppError { fn from(_: dblock::LockError) -> Self { AppError } }
/// # impl From<sqlx::Error> for AppError { fn from(_: sqlx::Error) -> Self { AppError } }
/// #[dblock::distributed_lock(key = "migration:{version}", once = true)]
/// async fn migrate(db: &sqlx::SqlitePool, version: u32) -> Result<(), AppError> {
///     let mut tx = db.begin().await?;
///     sqlx::query("CREATE TABLE IF NOT EXISTS invoices (id INTEGER PRIMARY KEY)")
///         .execute(&mut *tx).await?;
///     dblock::succeed_in(&mut *tx).await?; // done, and recorded as done, in one commit
///     tx.commit().await?;
///     Ok(())
/// }
/// ```
pub async fn succeed_in<C: FenceConnection>(conn: &mut C) -> Result<(), crate::LockError> {
    fence_all(conn, true).await
}

/// Releases every lock of the running locked body (and of the bodies it is nested in) **inside
/// the caller's transaction**, with the work: for each, all that [`succeed_in`] does and the
/// release, in one statement per lock. The keys are free the moment the transaction commits;
/// the body's own release at its end then finds them released and says nothing. If the
/// transaction rolls back, so do the releases: the holds stay the body's and are given back
/// when it ends (recording `Dropped`). Make it the body's last act with its keys: from it on
/// they are not renewed and their loss no longer ends the body, so a body that goes on after
/// such a rollback is covered only until its leases' ttl runs out — return the error instead. A
/// lock taken in the transaction itself (`tx = ...`, [`Locker::lock_in`](crate::Locker::lock_in))
/// is freed by the commit anyway: for it this records the success only. `Err(Lost)` if a lease is
/// not ours and live any more: roll back. Outside a locked body it is an error
/// ([`LockError::Config`](crate::LockError::Config)); for a guard use
/// [`LockGuard::release_in`](crate::LockGuard::release_in).
///
#[cfg_attr(all(feature = "macros", feature = "sqlite"), doc = "```")]
#[cfg_attr(not(all(feature = "macros", feature = "sqlite")), doc = "```ignore")]
/// # #[derive(Debug)] struct AppError;
/// # impl From<dblock::LockError> for AppError { fn from(_: dblock::LockError) -> Self { AppError } }
/// # impl From<sqlx::Error> for AppError { fn from(_: sqlx::Error) -> Self { AppError } }
/// #[dblock::distributed_lock(key = "invoice:{id}")]
/// async fn pay(db: &sqlx::SqlitePool, id: i64) -> Result<(), AppError> {
///     let mut tx = db.begin().await?;
///     sqlx::query("UPDATE invoices SET paid = 1 WHERE id = ?").bind(id).execute(&mut *tx).await?;
///     dblock::release_in(&mut *tx).await?; // fenced, succeeded, released: all in this commit
///     tx.commit().await?;
///     Ok(())
/// }
/// ```
pub async fn release_in<C: FenceConnection>(conn: &mut C) -> Result<(), crate::LockError> {
    let held = CONTEXT.try_with(|c| c.held.to_vec()).unwrap_or_default();
    if held.is_empty() {
        return Err(crate::LockError::Config(
            "dblock::release_in outside a locked body: there is no lock to release \
             (for a lock taken with Locker::lock, use LockGuard::release_in)"
                .to_owned(),
        ));
    }
    for lock in &held {
        if !lock.releasable || lock.released_in.get() {
            fence_locks(conn, std::slice::from_ref(lock), true).await?;
            continue;
        }
        release_lock_in(conn, lock).await?;
    }
    Ok(())
}

/// Records the success of `lock` (releasable: one hold, not a member of a shared row) and
/// releases it in the caller's transaction: `Err(Lost)` if its lease is not ours and live.
/// Marks it released in the transaction (a background release then only checks). A key its
/// owner has re-entered since (the row counts more than one hold) is not freed under the inner
/// hold: the success is recorded, as `succeed_in` does, and the hold's own release gives it
/// back.
pub(crate) async fn release_lock_in<C: FenceConnection>(
    conn: &mut C,
    lock: &HeldLock,
) -> Result<(), crate::LockError> {
    let matched = conn.release_in_row(&lock.table, lock.owned()).await?;
    if matched == 0 {
        // Not ours and live (`Lost`), or held more than once: the fence says which.
        return fence_locks(conn, std::slice::from_ref(lock), true).await;
    }
    lock.released_in.set();
    Ok(())
}

/// [`fence`] (and with `succeed`, [`succeed_in`]) for every lock of the running locked body.
async fn fence_all<C: FenceConnection>(
    conn: &mut C,
    succeed: bool,
) -> Result<(), crate::LockError> {
    let held = CONTEXT.try_with(|c| c.held.to_vec()).unwrap_or_default();
    if held.is_empty() {
        let (what, instead) = if succeed {
            ("dblock::succeed_in", "LockGuard::succeed_in")
        } else {
            ("dblock::fence", "LockGuard::fence")
        };
        return Err(crate::LockError::Config(format!(
            "{what} outside a locked body: there is no lock to record \
             (for a lock taken with Locker::lock, use {instead})"
        )));
    }
    fence_locks(conn, &held, succeed).await
}

/// Fences (with `succeed`, records the success of) each of `locks` in the caller's transaction:
/// `Err(Lost)` at the first whose lease is not ours and live.
pub(crate) async fn fence_locks<C: FenceConnection>(
    conn: &mut C,
    locks: &[HeldLock],
    succeed: bool,
) -> Result<(), crate::LockError> {
    for lock in locks {
        let matched = conn
            .fence_row(&lock.table, lock.owned(), succeed, lock.in_tx)
            .await?;
        if matched == 0 {
            return Err(crate::LockError::Lost {
                key: lock.key.clone(),
            });
        }
    }
    Ok(())
}
