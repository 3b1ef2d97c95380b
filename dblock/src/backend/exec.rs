//! One statement on one pooled connection, within a deadline.
//!
//! - Waiting for a connection is bounded by the deadline (not only by the pool's own time-out).
//!   When none comes, the error names the real cause: the pool's time-out hides a refused or
//!   hanging connect, so one direct connect attempt finds out why.
//! - A reply that does not come by the deadline ends the statement with an "outcome unknown"
//!   error, and that connection is closed rather than returned to the pool (sqlx would otherwise
//!   ping it on return and hand it out again, with the old statement's reply still pending).
//! - Errors say whether the statement was sent: nothing was, if no connection could be had.
//! - The connection comes from [`Conns`] and goes back to it: kept for the next statement when
//!   the statement answered in full and the pool is the locker's own, else to the pool.
//! - A command that must not be cut half-way (SQLite's transaction sent as one command) runs
//!   to its end instead ([`run_to_end`]): only the wait for its connection has the deadline.

use std::time::Duration;

#[cfg(feature = "sqlite")]
use sqlx::pool::PoolConnection;
use sqlx::{Connection, Database, Pool};
use tokio::time::Instant;

use super::conns::{Conn, Conns};
use crate::retry::Failed;

/// `sqlx::Database::NAME` of SQLite (checked by a test), whose connections survive a statement
/// the caller stopped waiting for.
const SQLITE: &str = "SQLite";

/// SQLSTATE `read_only_sql_transaction`: PostgreSQL's on a standby (or in a read-only
/// transaction), MySQL's 1792 (a read-only transaction).
pub(crate) const READ_ONLY: &str = "25006";

/// A connect that did not finish in its time.
pub(crate) fn connect_timed_out() -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "connecting to the database timed out (server unreachable?)",
    ))
}

/// How long the direct connect attempt that names the cause of a pool time-out may take.
const PROBE: Duration = Duration::from_millis(200);

/// Runs `op` on a connection of `pool`, all within `deadline`.
///
/// The statement's future (sqlx's, with the connection borrow: several KB) lives in a box of
/// its own, so that the futures built around it — the retry policy, the owner's serialisation,
/// the task an attempt or a release runs in — stay small instead of being copied in full each
/// time one of them is moved (into a task, say).
pub(crate) async fn run<DB, T>(
    pool: &Conns<DB>,
    deadline: Instant,
    op: impl AsyncFnOnce(&mut DB::Connection) -> Result<T, sqlx::Error>,
) -> Result<T, Failed>
where
    DB: Database,
{
    Box::pin(async move {
        // A test locker (`dblock::testing`): the paused clock stands still while the statement is
        // out, and an injected fault takes the statement's place.
        #[cfg(feature = "testing")]
        let test = crate::testing::faults::Statement::begin(pool.faults())?;
        let mut conn = connection(pool, deadline).await?;
        #[cfg(feature = "testing")]
        if test.reply_lost() {
            // Sent, and answered, but the answer never reaches the caller.
            let _ = op(&mut conn).await;
            pool.keep(conn);
            return Err(no_reply());
        }
        match tokio::time::timeout_at(deadline, op(&mut conn)).await {
            Ok(Err(sqlx::Error::Database(e))) if e.code().as_deref() == Some(READ_ONLY) => {
                // A server that cannot write any more (a primary demoted to a standby by a
                // failover): this connection stays on it, the next one may reach the new primary
                // (through HAProxy, or a multi-host URL's `target_session_attrs`).
                conn.close_on_drop();
                Err(Failed::from(sqlx::Error::Database(e)))
            }
            Ok(Ok(out)) => {
                pool.keep(conn);
                Ok(out)
            }
            Ok(Err(e)) => Err(Failed::from(e)),
            Err(_) => {
                // The statement may be executing, or done with its reply lost. On a network
                // connection never reuse it (its next reader would get the old reply): closed in
                // the background. SQLite answers each statement on a channel of its own, so the
                // connection stays good, and closing it would destroy an in-memory database.
                if DB::NAME != SQLITE {
                    conn.close_on_drop();
                }
                Err(no_reply())
            }
        }
    })
    .await
}

/// A statement whose reply did not come by its deadline: its outcome is unknown.
fn no_reply() -> Failed {
    Failed {
        error: sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "no reply from the database within the statement's time limit",
        )),
        sent: true,
        class: None,
    }
}

/// Runs `op` on a connection of `pool` to its end, with no time limit once it has the
/// connection: for an op that leaves its connection in a state only its own end undoes
/// (SQLite: a transaction that one command opens and commits; a command dropped half-way stops
/// before its `COMMIT`). `op` puts a failure right itself (a rollback) before it returns.
///
/// Should the op be dropped anyway (its task dropped with the runtime), its connection is
/// closed, not pooled again, and whatever it left open ends with it.
#[cfg(feature = "sqlite")]
pub(crate) async fn run_to_end<DB, T>(
    pool: &Conns<DB>,
    deadline: Instant,
    op: impl AsyncFnOnce(&mut PoolConnection<DB>) -> Result<T, sqlx::Error>,
) -> Result<T, Failed>
where
    DB: Database,
{
    /// Closes its connection unless the op got to its end.
    struct Whole<DB: Database> {
        conn: Option<Conn<DB>>,
    }
    impl<DB: Database> Drop for Whole<DB> {
        fn drop(&mut self) {
            if let Some(conn) = &mut self.conn {
                conn.close_on_drop();
            }
        }
    }
    #[cfg(feature = "testing")]
    let test = crate::testing::faults::Statement::begin(pool.faults())?;
    let mut whole = Whole { conn: None };
    let conn = whole.conn.insert(connection(pool, deadline).await?);
    let out = op(conn.pooled_mut()).await;
    #[cfg(feature = "testing")]
    if test.reply_lost() {
        if let Some(conn) = whole.conn.take() {
            pool.keep(conn);
        }
        return Err(no_reply());
    }
    // At its end: pooled again (kept, when it answered in full), not closed.
    if let (Some(conn), Ok(_)) = (whole.conn.take(), &out) {
        pool.keep(conn);
    }
    out.map_err(Failed::from)
}

/// The first connection of a pool that `Locker::connect` made (lazily): waits for it at most
/// `limit`, and when none comes names the real cause (a refused or unreachable server, bad
/// credentials), never the pool's time-out.
///
/// It connects directly, once, rather than through the pool, whose own attempts go on until
/// its time-out: a server that refuses the connection, or refuses us, is named at once. Only
/// a PostgreSQL server that is starting up (57P03, "the database system is starting up") is
/// waited out, within `limit`. The connection is then kept for the first statement
/// ([`Conns::keep`]).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn first_connection<DB: Database>(
    pool: &Conns<DB>,
    limit: Duration,
) -> sqlx::Result<()> {
    let deadline = Instant::now() + limit;
    let options = pool.connect_options();
    loop {
        let attempt = tokio::time::timeout_at(deadline, sqlx::ConnectOptions::connect(&*options));
        match Box::pin(attempt).await {
            Ok(Ok(conn)) => {
                let _ = conn.close().await;
                break;
            }
            Ok(Err(sqlx::Error::Database(e)))
                if e.code().as_deref() == Some(STARTING_UP)
                    && Instant::now() + STARTING_UP_PAUSE < deadline =>
            {
                tokio::time::sleep(STARTING_UP_PAUSE).await;
            }
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(connect_timed_out()),
        }
    }
    match connection(pool, deadline.max(Instant::now() + PROBE)).await {
        Ok(conn) => {
            pool.keep(conn);
            Ok(())
        }
        Err(failed) => Err(failed.error),
    }
}

/// PostgreSQL's "the database system is starting up" (`cannot_connect_now`).
#[cfg(any(feature = "postgres", feature = "mysql"))]
const STARTING_UP: &str = "57P03";
#[cfg(any(feature = "postgres", feature = "mysql"))]
const STARTING_UP_PAUSE: Duration = Duration::from_millis(100);

async fn connection<DB: Database>(pool: &Conns<DB>, deadline: Instant) -> Result<Conn<DB>, Failed> {
    let not_sent = |error| Failed {
        error,
        sent: false,
        class: None,
    };
    // Leave a little time to find out why, should the pool not hand out a connection.
    let now = Instant::now();
    let reserve = PROBE.min(deadline.saturating_duration_since(now) / 4);
    let waited = tokio::time::timeout_at(deadline - reserve, pool.acquire()).await;
    match waited {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(sqlx::Error::PoolTimedOut)) | Err(_) => {
            // Boxed: a connect future is large, and only this rare path needs one.
            Err(not_sent(Box::pin(why_no_connection(pool, deadline)).await))
        }
        Ok(Err(e)) => Err(not_sent(e)),
    }
}

/// Why no connection came: an exhausted pool (every connection in use), or a server that cannot
/// be reached, which one direct connect attempt (bounded by `deadline`) names. Asked even when
/// the pool is at its size: its slots may be held by connect attempts of its own that a server
/// gone away keeps failing (as while an earlier statement's unknown outcome is being settled).
async fn why_no_connection<DB: Database>(pool: &Pool<DB>, deadline: Instant) -> sqlx::Error {
    let full = pool.size() >= pool.options().get_max_connections() && pool.num_idle() == 0;
    let options = pool.connect_options();
    let limit = deadline.max(Instant::now() + Duration::from_millis(10));
    match tokio::time::timeout_at(limit, sqlx::ConnectOptions::connect(&*options)).await {
        Ok(Ok(conn)) => {
            tokio::spawn(async move {
                let _ = conn.close().await;
            });
            // The server answers now. With every connection of the pool out, it was exhausted;
            // otherwise its own connect attempts were what took too long (a slow or briefly
            // unreachable server), which is not "the pool timed out".
            if full {
                sqlx::Error::PoolTimedOut
            } else {
                sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "connecting to the database took too long (it answers again now)",
                ))
            }
        }
        // The server answers but takes no more connections (PostgreSQL 53300, MySQL 1040) while
        // the pool holds all it may: exhausted, and worth waiting for as such (a server error
        // here would read as final).
        Ok(Err(sqlx::Error::Database(_))) if full => sqlx::Error::PoolTimedOut,
        Ok(Err(e)) => e,
        Err(_) => connect_timed_out(),
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;

    #[test]
    fn sqlite_is_known_by_its_name() {
        assert_eq!(<sqlx::Sqlite as Database>::NAME, SQLITE);
    }

    /// An in-memory database lives only as long as its one connection: a statement whose reply
    /// comes too late must not close it (it would lose every lock, and the table).
    #[tokio::test]
    async fn a_late_reply_keeps_an_in_memory_database() {
        let locker = crate::Locker::connect("sqlite::memory:").await.unwrap();
        locker.migrate().await.unwrap();
        let backend = locker.shared().backend().unwrap();
        // The only variant in a SQLite-only build.
        #[allow(irrefutable_let_patterns)]
        let super::super::Backend::Sqlite(lite) = backend
        else {
            unreachable!("a SQLite URL")
        };
        use super::super::Dialect;
        let late = run(
            lite.pool(),
            Instant::now() + Duration::from_millis(20),
            async |c| {
                sqlx::query("SELECT 1").execute(&mut *c).await?;
                tokio::time::sleep(Duration::from_millis(200)).await;
                Ok(())
            },
        )
        .await;
        assert!(late.is_err(), "the deadline passed");
        let held = locker
            .lock("still-there")
            .await
            .expect("the table survived");
        held.release().await.unwrap();
    }

    /// An op of `run_to_end` dropped half-way (its task dropped with the runtime) takes its
    /// connection with it: a transaction it left open ends, never pooled again, where it would
    /// hold the write lock against every other connection. Fails without the guard.
    #[tokio::test]
    async fn an_op_run_to_end_dropped_half_way_closes_its_connection() {
        use std::str::FromStr;
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("t.db").display());
        let options = sqlx::sqlite::SqliteConnectOptions::from_str(&url)
            .unwrap()
            .busy_timeout(Duration::ZERO);
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await
            .unwrap();
        let other = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .unwrap();
        sqlx::query("CREATE TABLE t (x INTEGER)")
            .execute(&pool)
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let conns = Conns::own(pool.clone());
        let half_way = run_to_end(&conns, deadline, async |c| {
            sqlx::query("BEGIN IMMEDIATE").execute(&mut **c).await?;
            std::future::pending::<()>().await;
            Ok(())
        });
        let dropped = tokio::time::timeout(Duration::from_millis(100), half_way).await;
        assert!(dropped.is_err(), "still in its transaction when dropped");
        let free = tokio::time::timeout(Duration::from_secs(2), async {
            while sqlx::query("INSERT INTO t VALUES (1)")
                .execute(&other)
                .await
                .is_err()
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(free.is_ok(), "the write lock is still held");
        sqlx::query("INSERT INTO t VALUES (2)")
            .execute(&pool)
            .await
            .expect("the pool goes on, on a new connection");
    }
}
