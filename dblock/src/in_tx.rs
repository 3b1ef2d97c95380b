//! What runs inside the caller's transaction: the lock taken there
//! ([`Locker::lock_in`](crate::Locker::lock_in), its request [`LockInRequest`], what it gives:
//! [`TxLock`]), and a guard's statements there (`fence`, `succeed_in`, `release_in`).
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
use crate::guard::LockGuard;
use crate::options::Options;
use crate::owner::{HeldLock, Owner};
use crate::shared::Shared;
use crate::wait::{self, Kind, Seen, Try};

/// This kind's entry point.
impl crate::Locker {
    /// Takes `key` **inside the caller's open transaction** on the lock's own database, with one
    /// statement of that transaction, and holds it until the transaction commits or rolls back.
    /// The database's row lock is the lock: no lease, no renewal, nothing to release; a crash
    /// or a dropped connection ends the transaction and frees the key at once. The key's
    /// fencing token goes up, as for any tenure. It excludes lease holders of the key
    /// ([`lock`](Self::lock), [`read`](Self::read), [`lock_all`](Self::lock_all), a
    /// [`leader`](Self::leader)) and they exclude it; semaphores are keys of their own. Inside
    /// a locked body (`tx = ..` on the attribute) [`dblock::current`](crate::current) reports
    /// it, and committed, the hold records `Succeeded`.
    ///
    /// `.wait(d)` bounds it ([`LockError::Busy`] after); the caller's session never waits on a
    /// row lock for it:
    /// - PostgreSQL: the row is locked with `FOR UPDATE SKIP LOCKED`, only if free; a key held
    ///   by a lease or by another transaction is busy at once, and tried again until `wait`.
    ///   At READ COMMITTED, if a lease took the key in the instant the statement ran, the
    ///   statement's re-check leaves the row locked by your transaction, which would hold up
    ///   that lease's release: then `lock_in` answers `Busy` at once, whatever its `wait`; roll
    ///   back and try again.
    ///   Works through PgBouncer in transaction mode (a simple query then). At REPEATABLE READ
    ///   or SERIALIZABLE take it first in the transaction: a key taken or released after the
    ///   transaction's snapshot makes the statement fail with a serialization error (roll back).
    /// - MariaDB: one `UPDATE` whose wait for the row is bounded by `SET STATEMENT
    ///   innodb_lock_wait_timeout = 0`; a key no one has used gets its row first on the
    ///   locker's own connections (never an insert or gap lock in the caller's transaction).
    ///   MySQL 8 has no per-statement bound: the session's `innodb_lock_wait_timeout` applies.
    ///   At REPEATABLE READ (the default there), an `UPDATE` that finds the key taken (by a
    ///   lease, in the instant after that check) keeps the row locked until the transaction
    ///   ends, which would hold up the holder's release: then `lock_in` answers `Busy` at once,
    ///   whatever its `wait`; roll back and try again. At READ COMMITTED it waits as asked.
    ///   On MariaDB Galera a row lock is the node's own: a `lock_in` or a lease of the key on
    ///   another node is granted beside it (same fencing token), and certification settles it
    ///   at commit — the first to commit wins, the other transaction fails its commit (1213)
    ///   with all its work. Before its commit such a hold excludes nothing outside the database:
    ///   send every `lock_in` of a key to one node, or use a lease.
    /// - SQLite: the statement takes the database's write lock, kept by the transaction: while
    ///   it is open no other connection writes anything in that file, and every lock statement
    ///   of every locker on it waits (up to its busy timeout). Begin with `BEGIN IMMEDIATE` so
    ///   the transaction never has to upgrade a read snapshot (`SQLITE_BUSY`).
    ///
    /// A lease call on a key held this way is `Busy`: PostgreSQL's lock statements wait at most
    /// 250 ms for a row lock (`lock_timeout`) and try again within their `wait`; MySQL's one
    /// second (`innodb_lock_wait_timeout`, whole seconds).
    ///
    #[cfg_attr(feature = "sqlite", doc = "```")]
    #[cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// # let path = std::env::temp_dir().join(format!("dblock-lock-in-doc-{}.db", std::process::id()));
    /// # let url = format!("sqlite://{}?mode=rwc", path.display());
    /// let db = sqlx::SqlitePool::connect(&url).await?;
    /// let locker = dblock::Locker::sqlite(db.clone());
    /// locker.migrate().await?;
    ///
    /// let mut tx = db.begin_with("BEGIN IMMEDIATE").await?;
    /// let lock = locker.lock_in(&mut *tx, "order:7").await?;
    /// // ... the work in `tx`, fenced by the row lock; `lock.fencing_token()` for other stores ...
    /// tx.commit().await?; // the key is free, and its hold recorded as succeeded
    /// # let _ = lock;
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub fn lock_in<'c, C: FenceConnection>(
        &self,
        conn: &'c mut C,
        key: impl Into<String>,
    ) -> LockInRequest<'c, C> {
        LockInRequest::new(self.shared().clone(), conn, key.into())
    }
}

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
    /// Its `wait`, `owner` and `holder` (a hold in a transaction has no lease: the rest of the
    /// options core does not apply).
    options: Options,
}

impl<'c, C: FenceConnection> LockInRequest<'c, C> {
    pub(crate) fn new(shared: Arc<Shared>, conn: &'c mut C, key: String) -> Self {
        LockInRequest {
            shared,
            conn,
            key,
            options: Options::default(),
        }
    }

    /// How long to keep trying while the key is held (by a lease, or by another open
    /// transaction): a bound, then [`LockError::Busy`]. Default: one attempt. The caller's
    /// session never waits on a row lock for it (see [`Locker::lock_in`](crate::Locker::lock_in)
    /// for each backend); between attempts it sleeps, 5 ms doubling to 250 ms. On SQLite a key
    /// held by a lease is busy at once: the transaction holds the file's write lock from its
    /// first write, so the holder could not release while it waited. The whole call ends by
    /// its `wait` (or one attempt's floor if longer: 1 s, 1.5 s on MySQL) and a moment more,
    /// whatever the database does: a server that does not
    /// answer in that time ends it with a [`LockError`] that says so (the transaction is then
    /// best rolled back).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.options.wait = wait;
        self
    }

    /// A label stored with the hold (`host/pid/label`), as for
    /// [`LockRequest::holder`](crate::LockRequest::holder).
    pub fn holder(mut self, label: impl Into<String>) -> Self {
        self.options.label = Some(label.into());
        self
    }

    /// Takes the key as `owner` (default: the running locked scope's owner, else a fresh one).
    pub fn owner(mut self, owner: &Owner) -> Self {
        self.options.owner = Some(owner.clone());
        self
    }

    async fn take(self) -> Result<TxLock, LockError> {
        self.shared.admit(&self.key)?;
        let backend = self.shared.backend()?;
        if C::BACKEND != backend.name() {
            return Err(LockError::Config(format!(
                "lock_in on a {} connection with a {} locker: the transaction must be on the \
                 lock table's own database",
                C::BACKEND,
                backend.name()
            )));
        }
        let holder = self.options.holder(&self.shared)?;
        let owner = self.options.owner();
        let simple = self.shared.simple_statements();
        let started = Instant::now();
        let mut kind = InTx {
            shared: &self.shared,
            conn: self.conn,
            key: &self.key,
            owner: &owner,
            holder: &holder,
            simple,
            started,
        };
        let fencing_token = wait::wait_for(
            &mut kind,
            &self.shared,
            started,
            self.options.wait,
            &mut None,
        )
        .await?;
        tracing::debug!(key = %crate::Escaped(&self.key), fencing_token, "locked in the caller's transaction");
        self.shared.purge_in_background();
        Ok(TxLock {
            key: self.key,
            fencing_token,
            owner,
            holder,
            table: self.shared.table.as_str().into(),
            simple,
        })
    }
}

/// `lock_in` as a kind of the one wait loop: an attempt is the check on the locker's own pool
/// and the statement in the caller's transaction; it never lines up in the process's line nor
/// listens (the caller's session must not wait), and a busy answer the transaction itself would
/// keep busy ends the call at once.
struct InTx<'a, C> {
    shared: &'a Shared,
    conn: &'a mut C,
    key: &'a str,
    owner: &'a Owner,
    holder: &'a str,
    simple: bool,
    started: Instant,
}

impl<C: FenceConnection> InTx<'_, C> {
    fn busy_now(&self) -> Try<u64> {
        Try::Failed(LockError::Busy {
            key: self.key.to_owned(),
            waited: self.started.elapsed(),
        })
    }
}

impl<C: FenceConnection> Kind for InTx<'_, C> {
    /// The tenure's fencing token.
    type Grant = u64;

    fn key(&self) -> &str {
        self.key
    }

    fn lines_up(&self) -> bool {
        false
    }

    fn wake_keys(&self) -> Vec<String> {
        Vec::new()
    }

    async fn attempt(&mut self, _waiting: bool, _call_until: Instant) -> Try<u64> {
        let backend = match self.shared.backend() {
            Ok(b) => b,
            Err(e) => return Try::Failed(e),
        };
        let check = match backend.prepare_lock_in(self.key).await {
            Ok(check) => check,
            Err(e) => return Try::Failed(e.into()),
        };
        // MySQL: the key looked held on the locker's own pool; nothing was sent on the
        // caller's connection, so the call may wait on.
        if !check.free {
            return Try::busy(None);
        }
        let taken = self
            .conn
            .lock_in_row(
                &self.shared.table,
                self.key,
                self.owner.id(),
                self.holder,
                self.simple,
                check.mariadb_wait,
            )
            .await;
        match taken {
            Ok(Some(fencing_token)) => Try::Got(fencing_token),
            // The attempt may have left the caller's transaction holding what the key's holder
            // needs to release (SQLite: the file's write lock; MySQL at REPEATABLE READ: the
            // row it read; PostgreSQL: the row's latest version, locked before its re-check
            // found a lease that committed in the meantime): then the holder could not release
            // while it waited: busy at once (roll back and try again).
            Ok(None)
                if self
                    .conn
                    .holds_row_after_busy(&self.shared.table, self.key, self.simple)
                    .await =>
            {
                self.busy_now()
            }
            Ok(None) => Try::busy(None),
            Err(e) if backend.lock_not_had(&e) => Try::busy(None),
            Err(e) => Try::Failed(e.into()),
        }
    }

    fn gave_up(&self, seen: Seen, waited: Duration) -> LockError {
        match seen {
            Seen::Nothing => LockError::no_answer(
                waited,
                &format!("lock_in of `{}`", crate::Escaped(self.key)),
            ),
            Seen::Busy | Seen::Stale => LockError::Busy {
                key: self.key.to_owned(),
                waited,
            },
        }
    }
}

impl<'c, C: FenceConnection> IntoFuture for LockInRequest<'c, C> {
    type Output = Result<TxLock, LockError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 'c>>;

    fn into_future(self) -> Self::IntoFuture {
        let span = tracing::debug_span!(
            "dblock.lock_in",
            key = %crate::Escaped(&self.key),
            backend = self.shared.backend_name(),
            wait_ms = self.options.wait.as_millis() as u64,
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

    /// The fencing token of this tenure: larger than every earlier committed tenure's of the key,
    /// leases and transactions alike. The tenure exists only if the transaction commits: one that
    /// rolls back (or whose connection breaks) never happened, and the next holder may get the
    /// same number. So the writes this token fences belong in the same transaction (which rolls
    /// back with it); for writes to another store while holding a key, take a lease
    /// ([`Locker::lock`](crate::Locker::lock)), whose token is committed when it is granted.
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

/// A guard's statements inside the caller's transaction.
impl LockGuard {
    /// Fences a write: inside the caller's transaction (or on a connection) of the lock's own
    /// database, checks that this lease is still ours and live, and locks its row until that
    /// transaction ends, so no other owner can take the key over before the caller commits or
    /// rolls back. A stale holder's writes then never commit: the fence fails with
    /// [`LockError::Lost`] and the caller rolls back.
    ///
    #[cfg_attr(feature = "sqlite", doc = "```")]
    #[cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
    /// # async fn demo(locker: dblock::Locker, pool: sqlx::SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
    /// let guard = locker.lock("acct:7").await?;
    /// let mut tx = pool.begin().await?;
    /// sqlx::query("UPDATE accounts SET cents = cents - 100 WHERE id = 7").execute(&mut *tx).await?;
    /// guard.fence(&mut *tx).await?; // still ours; nobody takes the key until the commit
    /// tx.commit().await?;
    /// guard.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// What it costs: one statement in the caller's transaction, and the lease row (SQLite: the
    /// database's write lock) held until the transaction ends — keep fenced transactions well
    /// under the ttl: the lease's own renewal waits for them (the locker's other leases are then
    /// extended without it). Isolation levels:
    /// - PostgreSQL: at READ COMMITTED the fence waits for a concurrent writer of the row and
    ///   re-checks the latest version. At REPEATABLE READ or SERIALIZABLE it checks the
    ///   transaction's snapshot: a lease that had run out by then is `Lost`; a row changed by a
    ///   takeover committed after the snapshot makes the `UPDATE` fail with a serialization error
    ///   (40001, a `LockError::Database`). Either way roll back; nothing commits under a lease
    ///   that is not ours (tested at all three levels).
    /// - MySQL / MariaDB (InnoDB): an `UPDATE` reads the latest committed row whatever the
    ///   isolation level (READ COMMITTED, REPEATABLE READ, SERIALIZABLE alike), and holds its
    ///   exclusive lock to the end of the transaction.
    /// - SQLite: the fence takes the single write lock, for the whole database: while a fenced
    ///   transaction is open no other lock of that file can be taken or released either. A
    ///   `DEFERRED` transaction whose read snapshot predates a takeover gets `SQLITE_BUSY` at its
    ///   first write (a `LockError::Database`; roll back); `BEGIN IMMEDIATE` takes the write
    ///   lock up front, so no takeover can happen inside it.
    ///
    /// For data in another store, pass the fencing token instead ([`Self::fencing_token`]) and
    /// keep it in a `BIGINT` column: accept a write only with a token not smaller than the
    /// stored one.
    pub async fn fence<C: FenceConnection>(&self, conn: &mut C) -> Result<(), LockError> {
        crate::owner::fence_locks(conn, &[self.held_lock()], false).await
    }

    /// Records this hold's success **inside the caller's transaction** on the lock's own
    /// database, so it commits or rolls back with the work: everything [`fence`](Self::fence)
    /// does, and the outcome `Succeeded`. Once committed it stands, whatever happens next: the
    /// process crashing before its release, or [`release_failed`](Self::release_failed) — the
    /// row keeps `Succeeded`, and a [`once`](crate::LockRequest::once) key is done. So `once`
    /// work in the lock's own database runs exactly once. `Err(Lost)` if the lease is no longer
    /// ours and live: roll back.
    ///
    /// Work outside the lock's database cannot commit with the outcome: there `once` stays
    /// at-least-once (a crash between the work and the release runs it again); hand the
    /// [`fencing_token`](Self::fencing_token) to that resource so it can refuse a stale holder.
    ///
    #[cfg_attr(feature = "sqlite", doc = "```")]
    #[cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// # let path = std::env::temp_dir().join(format!("dblock-succeed-{}.db", std::process::id()));
    /// # let url = format!("sqlite://{}?mode=rwc", path.display());
    /// let db = sqlx::SqlitePool::connect(&url).await?;
    /// let locker = dblock::Locker::sqlite(db.clone());
    /// locker.migrate().await?;
    ///
    /// let guard = locker.lock("migration:7").once().await?;
    /// let mut tx = db.begin().await?;
    /// sqlx::query("CREATE TABLE invoices (id INTEGER PRIMARY KEY)").execute(&mut *tx).await?;
    /// guard.succeed_in(&mut *tx).await?; // the work and its success commit together
    /// tx.commit().await?;
    /// drop(guard); // even a release that records a failure keeps the committed success
    /// # tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    /// assert!(matches!(
    ///     locker.lock("migration:7").once().await,
    ///     Err(dblock::LockError::AlreadyDone { .. })
    /// ));
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub async fn succeed_in<C: FenceConnection>(&self, conn: &mut C) -> Result<(), LockError> {
        crate::owner::fence_locks(conn, &[self.held_lock()], true).await
    }

    /// Releases **inside the caller's transaction** on the lock's own database, with the work:
    /// everything [`succeed_in`](Self::succeed_in) does (the lease checked ours and live, its
    /// row locked, the outcome `Succeeded`) and the release, in one statement. The key is free
    /// the moment the transaction commits — no release round trip after it. If the
    /// transaction rolls back, so does the release: the hold is still this owner's, and the
    /// background release (a release statement 500 ms later) gives it back, recording `Dropped`;
    /// it is never leaked, never released twice. `Err(Lost)` if the lease is not ours and live
    /// any more: roll back.
    ///
    /// A hold of a key its owner holds more than once when the statement runs (a nested hold,
    /// `hold_count > 1`, or the outer one of a key re-entered since) or a read hold is not
    /// released by it: it records the success as [`succeed_in`](Self::succeed_in) does, and the
    /// guard is given back as dropped.
    ///
    #[cfg_attr(feature = "sqlite", doc = "```")]
    #[cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// # let path = std::env::temp_dir().join(format!("dblock-release-in-{}.db", std::process::id()));
    /// # let url = format!("sqlite://{}?mode=rwc", path.display());
    /// let db = sqlx::SqlitePool::connect(&url).await?;
    /// let locker = dblock::Locker::sqlite(db.clone());
    /// locker.migrate().await?;
    /// sqlx::query("CREATE TABLE IF NOT EXISTS paid (id INTEGER PRIMARY KEY)").execute(&db).await?;
    ///
    /// let guard = locker.lock("invoice:7").await?;
    /// let mut tx = db.begin().await?;
    /// sqlx::query("INSERT OR IGNORE INTO paid (id) VALUES (7)").execute(&mut *tx).await?;
    /// guard.release_in(&mut *tx).await?; // fenced, succeeded and released ...
    /// tx.commit().await?;                 // ... the moment the work commits
    /// assert!(!locker.inspect("invoice:7").await?.unwrap().held);
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub async fn release_in<C: FenceConnection>(mut self, conn: &mut C) -> Result<(), LockError> {
        let lock = self.held_lock();
        if !lock.releasable {
            crate::owner::fence_locks(conn, &[lock], true).await?;
            self.set_used(true);
            return Ok(());
        }
        drop(self.renewal.take()); // a renewal would only wait for the caller's row lock
        crate::owner::release_lock_in(conn, &lock).await?;
        self.release_later();
        Ok(())
    }

    /// Whether the hold was released in the caller's transaction (`release_in`).
    pub(crate) fn released_in(&self) -> bool {
        self.hold.released_in.get()
    }
}
