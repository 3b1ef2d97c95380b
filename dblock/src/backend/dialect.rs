//! What a backend owes: its connection concerns ([`Dialect`]) and, for each statement value of
//! the contract, how it sends it (its own trait, gathered in `runs.rs` as [`Runs`](super::Runs));
//! and the one path every statement takes to its connection ([`run`]). It names no backend:
//! `backend/mod.rs` gathers theirs.

use std::future::Future;

use tokio::time::Instant;

use super::{exec, Conns, Failed};
use crate::retry::Failure;

/// What every backend provides: one statement per operation, each on a connection the caller
/// hands in (see [`exec`]), each future `Send`.
pub(crate) trait Dialect: Clone + Send + Sync + 'static {
    /// `"postgres"`, `"mysql"`, `"sqlite"`.
    const NAME: &'static str;

    /// The sqlx database of its pool.
    type Db: sqlx::Database;

    /// The pool statements run on.
    fn pool(&self) -> &Conns<Self::Db>;

    /// The database the pool reaches, as far as its connect options tell (host, port and
    /// database; SQLite: the file): with the table, where one owner's holds of a key are
    /// tracked (see `crate::shared::serialise`).
    fn database(&self) -> String;

    /// The pool releases run on (a lazily durable release may need connections of its own).
    fn release_pool(&self) -> &Conns<Self::Db> {
        self.pool()
    }

    /// The pool statement `S` runs on: the release pool for what releases
    /// ([`Statement::ON_RELEASE_POOL`](super::Statement::ON_RELEASE_POOL)), else the pool.
    fn pool_for<S: super::Statement>(&self) -> &Conns<Self::Db> {
        if S::ON_RELEASE_POOL {
            self.release_pool()
        } else {
            self.pool()
        }
    }

    /// Whatever must be known before the first statement (PostgreSQL through the application's
    /// own pool: whether it goes through a transaction pooler). Free once known; by default
    /// nothing.
    fn settle(&self, deadline: Instant) -> impl Future<Output = Result<(), Failed>> + Send {
        let _ = deadline;
        std::future::ready(Ok(()))
    }

    /// A mutex every statement of this database takes in the process before its connection, or
    /// `None` (the default): SQLite's one writer. Its connections would otherwise meet at the
    /// file's write lock, where the loser sleeps in SQLite's busy handler for 1, 2, 5, 10 …
    /// ms, however soon the winner is done; in the process they queue in order and each goes
    /// the moment the one before it ends.
    fn one_at_a_time(&self) -> Option<&tokio::sync::Mutex<()>> {
        None
    }

    /// The same database and pool, another table (already validated).
    fn with_table(&self, table: &str) -> Self;

    /// How a server error (by this backend's own codes) may be retried.
    fn classify(error: &dyn sqlx::error::DatabaseError) -> Failure;
}

/// The connection type of a dialect's pool.
pub(crate) type Conn<D> = <<D as Dialect>::Db as sqlx::Database>::Connection;

/// Runs `op` on a connection of `pool` (one of `b`'s) within `deadline` ([`exec::run`]), once
/// `b` is ready for its first statement ([`Dialect::settle`]).
pub(crate) async fn run<D: Dialect, T>(
    b: &D,
    pool: &Conns<D::Db>,
    deadline: Instant,
    op: impl AsyncFnOnce(&mut Conn<D>) -> Result<T, sqlx::Error>,
) -> Result<T, Failed> {
    let _turn = enter(b, deadline).await?;
    exec::run(pool, deadline, op).await
}

/// As [`run`], for an op that must not be cut half-way ([`exec::run_to_end`]): it goes on to
/// its end, but holds `b`'s turn no longer than a statement cut at `deadline` would, so that
/// what waits behind it goes on as it would then.
#[cfg(feature = "sqlite")]
pub(crate) async fn run_to_end<D: Dialect, T>(
    b: &D,
    pool: &Conns<D::Db>,
    deadline: Instant,
    op: impl AsyncFnOnce(&mut sqlx::pool::PoolConnection<D::Db>) -> Result<T, sqlx::Error>,
) -> Result<T, Failed> {
    let mut turn = enter(b, deadline).await?;
    let mut whole = Box::pin(exec::run_to_end(pool, deadline, op));
    tokio::select! {
        done = &mut whole => done,
        () = tokio::time::sleep_until(deadline) => {
            turn.take();
            whole.await
        }
    }
}

/// What every statement of `b` waits for before its connection: `b` ready for its first
/// statement ([`Dialect::settle`]), then the database's turn in this process
/// ([`Dialect::one_at_a_time`]), held while the guard lives.
async fn enter<D: Dialect>(
    b: &D,
    deadline: Instant,
) -> Result<Option<tokio::sync::MutexGuard<'_, ()>>, Failed> {
    b.settle(deadline).await?;
    match b.one_at_a_time() {
        Some(turn) => match tokio::time::timeout_at(deadline, turn.lock()).await {
            Ok(turn) => Ok(Some(turn)),
            // Nothing was sent: as a pool that had no connection to give in time.
            Err(_) => Err(Failed {
                error: sqlx::Error::PoolTimedOut,
                sent: false,
                class: None,
            }),
        },
        None => Ok(None),
    }
}

/// Declares a backend's trait for sending statements (`$trait`, its method `$method`).
macro_rules! backend_trait {
    ($trait:ident, $method:ident, $ty:ty, $conn:ty) => {
        /// A statement as this backend sends it and reads its answer: implemented for each
        /// statement value of the contract (`backend/contract.rs`) in this backend's file for
        /// its kind.
        pub(crate) trait $trait: $crate::backend::Statement {
            fn $method(
                &self,
                backend: &$ty,
                conn: &mut $conn,
            ) -> impl std::future::Future<Output = Result<Self::Output, sqlx::Error>> + Send;
        }

        /// Each of `statements` in turn, in one transaction (begun with `begin`, else the
        /// driver's `BEGIN`): one commit for all, their answers in order.
        #[allow(dead_code)]
        pub(crate) async fn in_one_transaction<S: $trait>(
            backend: &$ty,
            conn: &mut $conn,
            begin: Option<&'static str>,
            statements: &[S],
        ) -> sqlx::Result<Vec<S::Output>> {
            let mut tx = match begin {
                Some(begin) => sqlx::Connection::begin_with(conn, begin).await?,
                None => sqlx::Connection::begin(conn).await?,
            };
            let mut out = Vec::with_capacity(statements.len());
            for s in statements {
                out.push(s.$method(backend, &mut tx).await?);
            }
            tx.commit().await?;
            Ok(out)
        }
    };
}
pub(crate) use backend_trait;

/// Implements a backend's trait (`$trait`, its method `$method`, for backend `$ty` on
/// connection `$conn`) for statement values by functions of the backend: `Stmt<'_> => f`, with
/// `f(&$ty, &mut $conn, &Stmt) -> Result<Output, sqlx::Error>`.
macro_rules! runs {
    ($trait:path, $method:ident, $ty:ty, $conn:ty; $($stmt:ty => $f:path),+ $(,)?) => {
        $(
            impl $trait for $stmt {
                async fn $method(
                    &self,
                    backend: &$ty,
                    conn: &mut $conn,
                ) -> sqlx::Result<<$stmt as $crate::backend::Statement>::Output> {
                    $f(backend, conn, self).await
                }
            }
        )+
    };
}
pub(crate) use runs;

/// [`Dialect::database`] of a server reached over the network: `host:port/database`, the host
/// being the Unix socket's path where the pool connects through one.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn server_database(
    socket: Option<&std::path::PathBuf>,
    host: &str,
    port: u16,
    database: &str,
) -> String {
    let host = match socket {
        Some(socket) => socket.display().to_string(),
        None => host.to_owned(),
    };
    format!("{host}:{port}/{database}")
}
