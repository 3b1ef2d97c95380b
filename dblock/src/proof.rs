//! Proof of holding: [`Held`], a value only a locked scope can make and that cannot outlive it,
//! so a function that must run under a lock asks for one as a parameter and the compiler checks
//! every caller.

use std::fmt;
use std::marker::PhantomData;

use crate::backend::fence::FenceConnection;
use crate::error::LockError;
use crate::owner::{fence_locks, HeldLock};

/// A marker type naming a particular lock, for typed proofs: [`Held<'_, K>`](Held). Declare one
/// with [`lock_kind!`](crate::lock_kind); [`AnyLock`] is the untyped proof's.
///
/// ```
/// dblock::lock_kind!(pub AccountLock);
/// fn needs_marker<K: dblock::LockMarker>() {}
/// needs_marker::<AccountLock>();
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a lock marker",
    label = "not declared with `dblock::lock_kind!`",
    note = "declare the marker of a typed proof with `dblock::lock_kind!(pub {Self});`"
)]
pub trait LockMarker: 'static {}

/// The marker of the untyped proof, [`Held<'_>`](Held): any lock. Every typed proof converts to
/// it with [`Held::untyped`].
///
/// ```
/// fn post(_held: dblock::Held<'_, dblock::AnyLock>) {} // the same as `Held<'_>`
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AnyLock {}

impl LockMarker for AnyLock {}

/// Declares a marker type for typed proofs of holding: `dblock::lock_kind!(pub AccountLock);`
/// makes an (uninhabited) type `AccountLock` that implements [`LockMarker`]. A function that asks
/// for [`Held<'_, AccountLock>`](Held) then refuses, at compile time, a proof of any other lock.
///
#[cfg_attr(all(feature = "macros", feature = "sqlite"), doc = "```")]
#[cfg_attr(not(all(feature = "macros", feature = "sqlite")), doc = "```ignore")]
/// dblock::lock_kind!(
///     /// The lock of one account's ledger.
///     pub AccountLock
/// );
///
/// async fn post(held: dblock::Held<'_, AccountLock>, cents: i64) -> u64 {
///     held.fencing_token() // ... write `cents` under it ...
/// }
///
/// #[dblock::distributed_lock(key = "acct:{id}", proof = held: AccountLock)]
/// async fn deposit(id: u64, cents: i64) -> Result<u64, dblock::LockError> {
///     Ok(post(held, cents).await)
/// }
/// ```
#[macro_export]
macro_rules! lock_kind {
    ($(#[$attr:meta])* $vis:vis $name:ident $(;)?) => {
        $(#[$attr])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        $vis enum $name {}

        impl $crate::LockMarker for $name {}
    };
}

/// What kind of hold a proof stands for: [`Exclusive`](mode::Exclusive) (the default),
/// [`Shared`](mode::Shared) or [`Permit`](mode::Permit).
pub mod mode {
    mod sealed {
        pub trait Sealed {}
    }

    /// The kinds of hold a [`Held`](crate::Held) can stand for. Sealed: these three are all.
    pub trait Mode: sealed::Sealed + 'static {
        /// How messages name the kind.
        const NAME: &'static str;
    }

    /// An exclusive hold: a lock (`lock`, every key of `lock_all`) or a leadership. The only
    /// kind whose proof can [`fence`](crate::Held::fence) a write: no one else holds the key.
    ///
    /// ```
    /// fn write(_held: dblock::Held<'_, dblock::AnyLock, dblock::mode::Exclusive>) {}
    /// ```
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum Exclusive {}

    /// A shared (read) hold: other readers hold the key at the same time, no writer does. Its
    /// proof gives the key and token but cannot fence a write (that needs exclusion).
    ///
    /// ```
    /// fn read(_held: dblock::Held<'_, dblock::AnyLock, dblock::mode::Shared>) {}
    /// ```
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum Shared {}

    /// One permit of a counting semaphore: up to its number of permits hold the key at once. Its
    /// proof gives the key and the permit's token but cannot fence a write.
    ///
    /// ```
    /// fn slot(_held: dblock::Held<'_, dblock::AnyLock, dblock::mode::Permit>) {}
    /// ```
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum Permit {}

    impl sealed::Sealed for Exclusive {}
    impl sealed::Sealed for Shared {}
    impl sealed::Sealed for Permit {}

    impl Mode for Exclusive {
        const NAME: &'static str = "exclusive lock";
    }
    impl Mode for Shared {
        const NAME: &'static str = "shared (read) hold";
    }
    impl Mode for Permit {
        const NAME: &'static str = "semaphore permit";
    }
}

use mode::{Exclusive, Mode, Shared};

/// A proof that the current scope holds its lock(s): made only by the library — by
/// `#[distributed_lock(.., proof = held)]` inside the locked body, or by
/// [`LockGuard::held`](crate::LockGuard::held) borrowing a guard — never by user code. Its
/// lifetime ties it to that body or guard: it cannot be returned out of the body, stored in a
/// `static`, or moved into `tokio::spawn` (each a compile error). A function that takes a
/// `Held<'_>` can therefore only be called while a lock is held; one that takes
/// `Held<'_, AccountLock>` only under the lock its marker names ([`lock_kind!`](crate::lock_kind)).
///
/// It is `Copy` and as cheap to pass as a reference, and gives what work under a lock needs:
/// the key(s) and fencing token(s), [`fence`](Self::fence) and [`succeed_in`](Self::succeed_in)
/// for every lock it stands for. A multi-key lock (`key = [..]`, `lock_all`) gives one proof for
/// all its keys, in canonical order.
///
/// The third parameter says what kind of hold it is ([`mode`]): `Held<'_, K>` is an exclusive
/// hold; a read's proof is `Held<'_, K, mode::Shared>` and a semaphore permit's
/// `Held<'_, K, mode::Permit>`, and neither can be passed where an exclusive one is asked, nor
/// fence a write. An exclusive proof gives a shared one ([`shared`](Self::shared)).
///
#[cfg_attr(all(feature = "macros", feature = "sqlite"), doc = "```")]
#[cfg_attr(not(all(feature = "macros", feature = "sqlite")), doc = "```ignore")]
/// # #[derive(Debug)] struct AppError;
/// # impl From<dblock::LockError> for AppError { fn from(_: dblock::LockError) -> Self { AppError } }
/// # impl From<sqlx::Error> for AppError { fn from(_: sqlx::Error) -> Self { AppError } }
/// // Callable only while a lock is held: the compiler asks every caller for the proof.
/// async fn post(held: dblock::Held<'_>, db: &sqlx::SqlitePool, cents: i64) -> Result<(), AppError> {
///     let mut tx = db.begin().await?;
///     sqlx::query("UPDATE ledger SET cents = cents + ?").bind(cents).execute(&mut *tx).await?;
///     held.fence(&mut *tx).await?; // the lease is still ours, and stays so until the commit
///     tx.commit().await?;
///     Ok(())
/// }
///
/// #[dblock::distributed_lock(key = "ledger:{id}", proof = held)]
/// async fn deposit(db: &sqlx::SqlitePool, id: u64, cents: i64) -> Result<(), AppError> {
///     post(held, db, cents).await
/// }
/// ```
pub struct Held<'a, K: LockMarker = AnyLock, M: Mode = Exclusive> {
    locks: &'a [HeldLock],
    kind: PhantomData<fn() -> (K, M)>,
}

impl<K: LockMarker, M: Mode> Clone for Held<'_, K, M> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K: LockMarker, M: Mode> Copy for Held<'_, K, M> {}

impl<K: LockMarker, M: Mode> fmt::Debug for Held<'_, K, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Held")
            .field("kind", &M::NAME)
            .field("marker", &std::any::type_name::<K>())
            .field("locks", &self.locks)
            .finish()
    }
}

impl<'a, K: LockMarker, M: Mode> Held<'a, K, M> {
    /// The proof of `locks` (library only: the attribute's scope and guards).
    pub(crate) fn new(locks: &'a [HeldLock]) -> Self {
        Held {
            locks,
            kind: PhantomData,
        }
    }

    /// Every lock the proof stands for (one, or every key of a multi-key lock in canonical
    /// order), each with its key and fencing token.
    pub fn locks(&self) -> &'a [HeldLock] {
        self.locks
    }

    /// The key of the lock (of a multi-key lock: the first in canonical order; see
    /// [`locks`](Self::locks)).
    pub fn key(&self) -> &'a str {
        self.locks.first().map_or("", |l| l.key.as_str())
    }

    /// The fencing token of the lock (of a multi-key lock: the first key's; see
    /// [`locks`](Self::locks)). Pass it to the resource the lock protects.
    pub fn fencing_token(&self) -> u64 {
        self.locks.first().map_or(0, |l| l.fencing_token)
    }

    /// The same proof without its marker: where any lock will do (`Held<'_>`).
    pub fn untyped(self) -> Held<'a, AnyLock, M> {
        Held::new(self.locks)
    }
}

impl<'a, K: LockMarker> Held<'a, K, Exclusive> {
    /// The same proof as a shared one: an exclusive hold also allows what a read hold does.
    pub fn shared(self) -> Held<'a, K, Shared> {
        Held::new(self.locks)
    }

    /// [`LockGuard::fence`](crate::LockGuard::fence) for every lock of the proof: inside the
    /// caller's transaction on the lock's own database, checks each lease is still ours and
    /// live and locks its row until the transaction ends. `Err(Lost)` if one is not held: roll
    /// back.
    ///
    /// A proof made from a guard of a read or a permit ([`LockGuard::held`] cannot tell them
    /// apart at compile time) refuses with [`LockError::Config`]: those holds do not exclude.
    ///
    /// [`LockGuard::held`]: crate::LockGuard::held
    pub async fn fence<C: FenceConnection>(&self, conn: &mut C) -> Result<(), LockError> {
        self.exclusive("fence")?;
        fence_locks(conn, self.locks, false).await
    }

    /// [`LockGuard::succeed_in`](crate::LockGuard::succeed_in) for every lock of the proof:
    /// everything [`fence`](Self::fence) does, and each hold's outcome `Succeeded`, written in
    /// the caller's transaction so it commits or rolls back with the work.
    pub async fn succeed_in<C: FenceConnection>(&self, conn: &mut C) -> Result<(), LockError> {
        self.exclusive("succeed_in")?;
        fence_locks(conn, self.locks, true).await
    }

    fn exclusive(&self, what: &str) -> Result<(), LockError> {
        match self.locks.iter().find(|l| !l.exclusive) {
            None if !self.locks.is_empty() => Ok(()),
            None => Err(LockError::Config(format!(
                "Held::{what}: the proof stands for no lock any more (its leadership was resigned)"
            ))),
            Some(l) => Err(LockError::Config(format!(
                "Held::{what} on the proof of a read or a semaphore permit of {:?}: those holds \
                 do not exclude other holders, so they cannot fence a write",
                crate::Escaped(&l.key)
            ))),
        }
    }
}

/// The proofs a guard lends.
impl crate::LockGuard {
    /// A proof that this guard's lock is held, borrowing the guard: pass it to functions that
    /// must only run under the lock ([`Held`]). It cannot outlive the guard, so it is never a
    /// proof of a released lock's tenure.
    ///
    /// The guard of a read or a semaphore permit gives a proof too (a guard's kind is not known
    /// at compile time), but its [`fence`](Held::fence) and [`succeed_in`](Held::succeed_in)
    /// refuse with [`LockError::Config`]: those holds do not exclude. With the attribute,
    /// `shared = true` and `permits` give proofs of their own kind ([`crate::mode`]).
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// fn audit(held: dblock::Held<'_>) -> String {
    ///     format!("{} under token {}", held.key(), held.fencing_token())
    /// }
    /// let guard = locker.lock("report:7").await?;
    /// assert_eq!(audit(guard.held()), format!("report:7 under token {}", guard.fencing_token()));
    /// guard.release().await
    /// # }
    /// ```
    pub fn held(&self) -> Held<'_> {
        self.held_as()
    }

    /// [`held`](Self::held) as a typed proof, `Held<'_, K>`, for functions that ask for the lock
    /// its marker names ([`lock_kind!`](crate::lock_kind)). Naming the marker is this call's
    /// claim: the code that took the lock says which lock it is.
    ///
    /// ```
    /// dblock::lock_kind!(pub AccountLock);
    /// fn post(held: dblock::Held<'_, AccountLock>) -> u64 { held.fencing_token() }
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guard = locker.lock("acct:7").await?;
    /// post(guard.held_as::<AccountLock>());
    /// guard.release().await
    /// # }
    /// ```
    pub fn held_as<K: LockMarker>(&self) -> Held<'_, K> {
        let lock: &HeldLock = self.proof.get_or_init(|| Box::new(self.held_lock()));
        Held::new(std::slice::from_ref(lock))
    }
}
