//! The lock inside the caller's transaction: [`Locker::lock_in`](crate::Locker::lock_in), its
//! request ([`LockInRequest`]) and what it gives ([`TxLock`]).
//!
//! One statement of the caller's transaction takes the key (`backend/fence.rs` has the
//! statements, `ARCHITECTURE.md` the argument for each): the database's row lock is the lock,
//! held until that transaction commits or rolls back. There is no lease, no renewal and nothing
//! to release: a crash or a dropped connection ends the transaction and frees the key at once.

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use crate::backend::fence::FenceConnection;
use crate::error::LockError;
use crate::owner::{HeldLock, Owner};
use crate::shared::Shared;
use crate::timing::{self, Backoff};
use crate::validate;

/// One `locker.lock_in(&mut *tx, key)` call being configured; `.await` it to take the key inside
/// the transaction.
///
#[cfg_attr(feature = "sqlite", doc = "```")]
#[cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// # let path = std::env::temp_dir().join(format!("dblock-lock-in-{}.db", std::process::id()));
/// # let url = format!("sqlite://{}?mode=rwc", path.display());
/// use std::time::Duration;
/// let db = sqlx::SqlitePool::connect(&url).await?;
/// let locker = dblock::Locker::sqlite(db.clone());
/// locker.migrate().await?;
///
/// let mut tx = db.begin().await?;
/// let lock = locker
///     .lock_in(&mut *tx, "order:7")
///     .wait(Duration::from_secs(2)) // keep trying this long (default: one attempt)
///     .holder("settle")             // shown to operators next to host and pid
///     .await?;
/// println!("order:7 held under token {}", lock.fencing_token());
/// // ... the work, in `tx` ...
/// tx.commit().await?; // the key is free again
/// # Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
/// ```
#[must_use = "a lock request does nothing until it is awaited"]
pub struct LockInRequest<'c, C> {
    shared: Arc<Shared>,
    conn: &'c mut C,
    key: String,
    wait: Duration,
    owner: Option<Owner>,
    label: Option<String>,
}

impl<'c, C: FenceConnection> LockInRequest<'c, C> {
    pub(crate) fn new(shared: Arc<Shared>, conn: &'c mut C, key: String) -> Self {
        LockInRequest {
            shared,
            conn,
            key,
            wait: Duration::ZERO,
            owner: None,
            label: None,
        }
    }

    /// How long to keep trying while the key is held (by a lease, or by another open
    /// transaction): a bound, then [`LockError::Busy`]. Default: one attempt. The caller's
    /// session never waits on a row lock for it (see [`Locker::lock_in`](crate::Locker::lock_in)
    /// for each backend); between attempts it sleeps, 5 ms doubling to 250 ms. On SQLite a key
    /// held by a lease is busy at once: the transaction holds the file's write lock from its
    /// first write, so the holder could not release while it waited.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// A label stored with the hold (`host/pid/label`), as for [`LockRequest::holder`](crate::LockRequest::holder).
    pub fn holder(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }

    /// Takes the key as `owner` (default: the running locked scope's owner, else a fresh one).
    pub fn owner(mut self, owner: &Owner) -> Self {
        self.owner = Some(owner.clone());
        self
    }

    async fn take(self) -> Result<TxLock, LockError> {
        LockError::require_runtime()?;
        self.shared.check_open()?;
        validate::key(&self.key)?;
        let backend = self.shared.backend()?;
        if C::BACKEND != backend.name() {
            return Err(LockError::Config(format!(
                "lock_in on a {} connection with a {} locker: the transaction must be on the \
                 lock table's own database",
                C::BACKEND,
                backend.name()
            )));
        }
        let holder = self.shared.holder_for(self.label.as_deref())?;
        let owner = self.owner.or_else(Owner::current).unwrap_or_default();
        let simple = self.shared.simple_statements();
        let started = Instant::now();
        let until = timing::after(started, self.wait);
        let mut backoff = Backoff::default();
        loop {
            let check = backend
                .prepare_lock_in(&self.key)
                .await
                .map_err(LockError::from)?;
            let taken = if check.free {
                self.conn
                    .lock_in_row(
                        &self.shared.table,
                        &self.key,
                        owner.id(),
                        &holder,
                        simple,
                        check.mariadb_wait,
                    )
                    .await
            } else {
                Ok(None)
            };
            match taken {
                Ok(Some(fencing_token)) => {
                    tracing::debug!(key = %crate::Escaped(&self.key), fencing_token, "locked in the caller's transaction");
                    return Ok(TxLock {
                        key: self.key,
                        fencing_token,
                        owner,
                        holder,
                        table: self.shared.table.as_str().into(),
                        simple,
                    });
                }
                // SQLite: the caller's transaction now holds the file's write lock, so the
                // holder could not release while it waits: busy at once.
                Ok(None) if C::BACKEND == "sqlite" => {
                    return Err(LockError::Busy {
                        key: self.key,
                        waited: started.elapsed(),
                    })
                }
                Ok(None) => {}
                Err(e) if backend.lock_not_had(&e) => {}
                Err(e) => return Err(e.into()),
            }
            if Instant::now() >= until {
                return Err(LockError::Busy {
                    key: self.key,
                    waited: started.elapsed(),
                });
            }
            tokio::time::sleep(backoff.next(until, None)).await;
        }
    }
}

impl<'c, C: FenceConnection> IntoFuture for LockInRequest<'c, C> {
    type Output = Result<TxLock, LockError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 'c>>;

    fn into_future(self) -> Self::IntoFuture {
        let span = tracing::info_span!(
            "dblock.lock_in",
            key = %crate::Escaped(&self.key),
            wait_ms = self.wait.as_millis() as u64,
        );
        Box::pin(self.take().instrument(span))
    }
}

/// A key held inside the caller's transaction ([`Locker::lock_in`](crate::Locker::lock_in)):
/// until that transaction commits or rolls back. Nothing to release and nothing to renew;
/// dropping it changes nothing (the transaction holds the key).
#[derive(Clone, Debug)]
pub struct TxLock {
    key: String,
    fencing_token: u64,
    owner: Owner,
    holder: Arc<str>,
    table: Arc<str>,
    simple: bool,
}

impl TxLock {
    /// The key.
    ///
    #[cfg_attr(feature = "sqlite", doc = "```")]
    #[cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
    /// # async fn demo(locker: dblock::Locker, tx: &mut sqlx::SqliteConnection) -> Result<(), dblock::LockError> {
    /// let lock = locker.lock_in(&mut *tx, "order:7").await?;
    /// assert_eq!(lock.key(), "order:7");
    /// # Ok(()) }
    /// ```
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The fencing token of this tenure: larger than every earlier tenure's of the key, leases
    /// and transactions alike.
    ///
    #[cfg_attr(feature = "sqlite", doc = "```")]
    #[cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
    /// # async fn demo(locker: dblock::Locker, tx: &mut sqlx::SqliteConnection) -> Result<(), dblock::LockError> {
    /// let lock = locker.lock_in(&mut *tx, "order:7").await?;
    /// println!("write with token {}", lock.fencing_token());
    /// # Ok(()) }
    /// ```
    pub fn fencing_token(&self) -> u64 {
        self.fencing_token
    }

    /// The owner it was taken as.
    pub fn owner(&self) -> &Owner {
        &self.owner
    }

    /// The holder label stored with it (`host/pid[/label]`).
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// The lock as [`dblock::current`](crate::current) reports it (`expires_at`: when it was
    /// taken, as seen here; a transaction's lock has no lease).
    pub(crate) fn held_lock(&self) -> HeldLock {
        HeldLock {
            key: self.key.clone(),
            fencing_token: self.fencing_token,
            hold_count: 1,
            expires_at: std::time::SystemTime::now(),
            table: self.table.clone(),
            row_key: self.key.as_str().into(),
            owner: self.owner.shared_id(),
            simple: self.simple,
            exclusive: true,
            in_tx: true,
            releasable: false,
            released_in: Default::default(),
        }
    }
}
