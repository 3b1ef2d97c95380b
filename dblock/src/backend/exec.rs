//! One statement on one pooled connection, within a deadline.
//!
//! - Waiting for a connection is bounded by the deadline (not only by the pool's own time-out).
//!   When none comes, the error names the real cause: the pool's time-out hides a refused or
//!   hanging connect, so one direct connect attempt finds out why.
//! - A reply that does not come by the deadline ends the statement with an "outcome unknown"
//!   error, and that connection is closed rather than returned to the pool (sqlx would otherwise
//!   ping it on return and hand it out again, with the old statement's reply still pending).
//! - Errors say whether the statement was sent: nothing was, if no connection could be had.

use std::time::Duration;

use sqlx::{Connection, Database, Pool};
use tokio::time::Instant;

/// A failed statement, and whether it was sent at all (if not, it certainly did not commit).
#[derive(Debug)]
pub(crate) struct Failed {
    pub(crate) error: sqlx::Error,
    pub(crate) sent: bool,
}

impl From<sqlx::Error> for Failed {
    /// A failure of a statement that was sent (decoding a reply, a server error, ...).
    fn from(error: sqlx::Error) -> Self {
        Failed { error, sent: true }
    }
}

/// How long the direct connect attempt that names the cause of a pool time-out may take.
const PROBE: Duration = Duration::from_millis(200);

/// Runs `op` on a connection of `pool`, all within `deadline`.
pub(crate) async fn run<DB, T>(
    pool: &Pool<DB>,
    deadline: Instant,
    op: impl AsyncFnOnce(&mut DB::Connection) -> Result<T, sqlx::Error>,
) -> Result<T, Failed>
where
    DB: Database,
{
    let mut conn = connection(pool, deadline).await?;
    match tokio::time::timeout_at(deadline, op(&mut conn)).await {
        Ok(outcome) => outcome.map_err(Failed::from),
        Err(_) => {
            // The statement may be executing, or done with its reply lost: never reuse this
            // connection (its next reader would get the old reply). Closed in the background.
            conn.close_on_drop();
            Err(Failed {
                error: sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no reply from the database within the statement's time limit",
                )),
                sent: true,
            })
        }
    }
}

async fn connection<DB: Database>(
    pool: &Pool<DB>,
    deadline: Instant,
) -> Result<sqlx::pool::PoolConnection<DB>, Failed> {
    let not_sent = |error| Failed { error, sent: false };
    // Leave a little time to find out why, should the pool not hand out a connection.
    let now = Instant::now();
    let reserve = PROBE.min(deadline.saturating_duration_since(now) / 4);
    let waited = tokio::time::timeout_at(deadline - reserve, pool.acquire()).await;
    match waited {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(sqlx::Error::PoolTimedOut)) | Err(_) => {
            Err(not_sent(why_no_connection(pool, deadline).await))
        }
        Ok(Err(e)) => Err(not_sent(e)),
    }
}

/// Why no connection came: an exhausted pool (every connection in use), or a server that cannot
/// be reached, which one direct connect attempt (bounded by `deadline`) names.
async fn why_no_connection<DB: Database>(pool: &Pool<DB>, deadline: Instant) -> sqlx::Error {
    let max = pool.options().get_max_connections();
    if pool.size() >= max && pool.num_idle() == 0 {
        return sqlx::Error::PoolTimedOut;
    }
    let options = pool.connect_options();
    let limit = deadline.max(Instant::now() + Duration::from_millis(10));
    match tokio::time::timeout_at(limit, sqlx::ConnectOptions::connect(&*options)).await {
        Ok(Ok(conn)) => {
            // The server answers: the pool was just slow to hand out a connection.
            tokio::spawn(async move {
                let _ = conn.close().await;
            });
            sqlx::Error::PoolTimedOut
        }
        Ok(Err(e)) => e,
        Err(_) => sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "connecting to the database timed out (server unreachable?)",
        )),
    }
}
