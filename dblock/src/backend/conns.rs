//! Where a statement's connection comes from and goes back to: the pool, and for a pool the
//! locker built itself (`Locker::connect`), a few connections kept out of it between statements.
//!
//! sqlx's pool tests every connection on its way back (`PoolConnection`'s drop spawns a task
//! that pings the server, a round trip, before the connection can be handed out again). For a
//! lock statement that answered in full, the test learns nothing the statement did not, and it
//! costs a task, a round trip and the wake-ups on both sides for every statement; the
//! connection is not free for the next statement until it is over. It also holds the connection
//! for as long as the server takes to answer it: after a stretch of slow replies, every
//! connection of a small pool can be out at once in its ping while the server answers new
//! connections at once, and the next statement waits for the pool's time-out.
//!
//! So a connection whose statement completed (an answer in full, not an error, not cut at its
//! deadline, not dropped half-way) is kept here instead, and the next statement takes it
//! first. A kept connection goes back through the pool (with sqlx's test, lifetime and idle checks)
//! once it has been idle for [`IDLE`] or out of the pool for [`OUT`], and when the pool is closed.
//! A statement that waits for the pool also takes a connection that comes back here meanwhile, so a
//! kept connection never leaves a caller waiting for one; and while any statement waits, a
//! connection that comes back goes to the one that has waited longest, never to one that has
//! just come (which would leave the waiters behind each newcomer: with 64 callers on 10
//! connections, p99 went from 20 ms to 240–320 ms when newcomers took kept connections first).
//!
//! Never for the application's own pool (`Locker::postgres(pool)` and friends): SPEC section 5,
//! "the caller's pool is the caller's" (no pooled connection kept beyond one statement).

use std::collections::VecDeque;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool};
use tokio::sync::oneshot;
use tokio::time::Instant;

/// A kept connection idle this long goes back to the pool: under a steady load the kept set
/// shrinks to what the load uses, and after it the pool's own idle time-out applies.
const IDLE: Duration = Duration::from_secs(1);

/// A connection out of the pool this long goes back to it after its statement, so that the
/// pool's checks (its test, `max_lifetime`) still see every connection regularly.
const OUT: Duration = Duration::from_secs(30);

/// The pool of a dialect, with the connections kept out of it when the pool is the locker's own
/// (see the module doc). Clones share both. Reads as the pool for everything else.
#[derive(Debug)]
pub(crate) struct Conns<DB: Database> {
    pool: Pool<DB>,
    kept: Option<Arc<Kept<DB>>>,
    /// A test locker's faults and clock (`dblock::testing`): every statement on these
    /// connections consults them.
    #[cfg(feature = "testing")]
    faults: Option<Arc<crate::testing::faults::Faults>>,
}

impl<DB: Database> Clone for Conns<DB> {
    fn clone(&self) -> Self {
        Conns {
            pool: self.pool.clone(),
            kept: self.kept.clone(),
            #[cfg(feature = "testing")]
            faults: self.faults.clone(),
        }
    }
}

/// The application's pool: every connection goes back to it after its statement.
impl<DB: Database> From<Pool<DB>> for Conns<DB> {
    fn from(pool: Pool<DB>) -> Self {
        Conns {
            pool,
            kept: None,
            #[cfg(feature = "testing")]
            faults: None,
        }
    }
}

impl<DB: Database> Deref for Conns<DB> {
    type Target = Pool<DB>;

    fn deref(&self) -> &Pool<DB> {
        &self.pool
    }
}

impl<DB: Database> Conns<DB> {
    /// A pool the locker built and nothing else uses: connections are kept between statements.
    pub(crate) fn own(pool: Pool<DB>) -> Self {
        Conns {
            kept: Some(Arc::new(Kept {
                idle: Mutex::new(Idle {
                    conns: Vec::new(),
                    waiting: VecDeque::new(),
                    sweeping: false,
                }),
            })),
            pool,
            #[cfg(feature = "testing")]
            faults: None,
        }
    }

    /// The same connections, consulting `faults` at every statement (`dblock::testing`).
    #[cfg(feature = "testing")]
    pub(crate) fn with_faults(mut self, faults: Arc<crate::testing::faults::Faults>) -> Self {
        self.faults = Some(faults);
        self
    }

    /// A test locker's faults and clock, if these are a test locker's connections.
    #[cfg(feature = "testing")]
    pub(crate) fn faults(&self) -> Option<&Arc<crate::testing::faults::Faults>> {
        self.faults.as_ref()
    }

    /// A connection for one statement: a kept one if there is one, else the pool's, whichever
    /// comes first. Bounded by the pool's own time-out (`PoolTimedOut`); callers bound it by
    /// their deadline too.
    pub(crate) async fn acquire(&self) -> sqlx::Result<Conn<DB>> {
        let Some(kept) = &self.kept else {
            return Ok(Conn::pooled(self.pool.acquire().await?));
        };
        let back = match kept.take_or_wait() {
            Ok(conn) => return Ok(conn),
            Err(back) => back,
        };
        // Boxed: sqlx's acquire future is large, and a caller that finds a kept connection
        // (the common case under load) never makes one.
        let mut from_pool = Box::pin(self.pool.acquire());
        tokio::select! {
            // A connection given to this caller as the pool's came (both at once): the pool's
            // goes on to the next waiter, or is kept.
            biased;
            Ok(given) = back => {
                // The pool's acquire may be opening a connection (the pool is not at its size):
                // it finishes, for whoever waits next. Dropped, it would leave the pool as
                // small as it was and the server with a half-made session, at every hand-over:
                // 8 callers on a pool of 10 fell to a fifth of their rate, each hand-over a
                // connect the server started and the client gave up. At its size, the pool
                // only has idle connections to give, and it is dropped.
                if self.pool.size() < self.pool.options().get_max_connections() {
                    let kept = kept.clone();
                    tokio::spawn(async move {
                        if let Ok(conn) = from_pool.await {
                            kept.put(conn, Instant::now());
                        }
                    });
                }
                Ok(given.into())
            }
            conn = &mut from_pool => Ok(Conn::pooled(conn?)),
        }
    }

    /// After a statement that answered in full (not an error, not cut at its deadline): keeps
    /// its connection for the next statement, where this pool keeps connections and the
    /// connection has not been out of the pool for [`OUT`]; otherwise it goes back to the pool.
    pub(crate) fn keep(&self, conn: Conn<DB>) {
        let Some(kept) = &self.kept else { return };
        if conn.out.elapsed() < OUT
            && !self.pool.is_closed()
            && tokio::runtime::Handle::try_current().is_ok()
        {
            kept.put(conn.conn, conn.out);
        }
    }

    /// Closes the pool, once the kept connections have gone back to it (it waits for every
    /// connection).
    #[cfg(any(feature = "postgres", all(test, feature = "sqlite")))]
    pub(crate) async fn close(&self) {
        if let Some(kept) = &self.kept {
            drop(kept.drain());
        }
        self.pool.close().await;
    }
}

/// Connections kept out of one pool between statements.
#[derive(Debug)]
struct Kept<DB: Database> {
    idle: Mutex<Idle<DB>>,
}

#[derive(Debug)]
struct Idle<DB: Database> {
    /// Oldest first; a statement takes the newest (warm, and the oldest age out).
    conns: Vec<Idling<DB>>,
    /// Statements waiting for a connection, longest first: a connection that comes back goes
    /// to the first still waiting.
    waiting: VecDeque<oneshot::Sender<Idling<DB>>>,
    /// A task returns idle connections to the pool ([`sweep`]) while any are kept.
    sweeping: bool,
}

#[derive(Debug)]
struct Idling<DB: Database> {
    conn: PoolConnection<DB>,
    /// When it left the pool.
    out: Instant,
    /// When its last statement ended.
    since: Instant,
}

impl<DB: Database> Kept<DB> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Idle<DB>> {
        // Nothing panics while holding it; a poisoned lock still holds a consistent list.
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The newest kept connection, if there is one and no statement waits for one; otherwise
    /// where a connection that comes back will be given (the caller waits on the pool too).
    fn take_or_wait(&self) -> Result<Conn<DB>, oneshot::Receiver<Idling<DB>>> {
        let mut idle = self.lock();
        if idle.waiting.iter().all(oneshot::Sender::is_closed) {
            idle.waiting.clear();
            if let Some(idling) = idle.conns.pop() {
                return Ok(idling.into());
            }
        }
        let (give, back) = oneshot::channel();
        idle.waiting.push_back(give);
        Err(back)
    }

    /// Every kept connection, taken out (to go back to the pool as they are dropped).
    #[cfg(any(feature = "postgres", all(test, feature = "sqlite")))]
    fn drain(&self) -> Vec<PoolConnection<DB>> {
        let mut idle = self.lock();
        idle.conns.drain(..).map(|i| i.conn).collect()
    }

    /// A connection back from its statement: to the statement that has waited longest, or
    /// kept.
    fn put(self: &Arc<Self>, conn: PoolConnection<DB>, out: Instant) {
        let mut idling = Idling {
            conn,
            out,
            since: Instant::now(),
        };
        let spawn_sweeper = {
            let mut idle = self.lock();
            while let Some(waiter) = idle.waiting.pop_front() {
                // A waiter gone (it had the pool's connection, or its deadline passed) hands
                // it back.
                match waiter.send(idling) {
                    Ok(()) => return,
                    Err(back) => idling = back,
                }
            }
            idle.conns.push(idling);
            !std::mem::replace(&mut idle.sweeping, true)
        };
        if spawn_sweeper {
            tokio::spawn(sweep(Arc::downgrade(self)));
        }
    }
}

/// Returns the connections kept idle for [`IDLE`] to the pool, every [`IDLE`], until none is
/// kept (or the pool is gone).
async fn sweep<DB: Database>(kept: Weak<Kept<DB>>) {
    loop {
        tokio::time::sleep(IDLE).await;
        let Some(kept) = kept.upgrade() else { return };
        let (stale, done) = {
            let mut idle = kept.lock();
            let now = Instant::now();
            let fresh = idle
                .conns
                .iter()
                .position(|i| now.duration_since(i.since) < IDLE)
                .unwrap_or(idle.conns.len());
            let stale: Vec<Idling<DB>> = idle.conns.drain(..fresh).collect();
            let done = idle.conns.is_empty();
            if done {
                idle.sweeping = false;
            }
            (stale, done)
        };
        // Dropped outside the lock: each goes back through the pool (a task of sqlx's).
        drop(stale);
        if done {
            return;
        }
    }
}

impl<DB: Database> Drop for Kept<DB> {
    fn drop(&mut self) {
        // sqlx returns a dropped connection to its pool from a task, which needs a runtime: a
        // locker dropped outside one lets its kept connections go with the process instead of
        // panicking.
        if tokio::runtime::Handle::try_current().is_err() {
            let idle = self.idle.get_mut().unwrap_or_else(|e| e.into_inner());
            for i in idle.conns.drain(..) {
                std::mem::forget(i.conn);
            }
        }
    }
}

/// One statement's connection: back to the pool as sqlx does it when dropped, or kept for the
/// next statement by [`Conns::keep`].
pub(crate) struct Conn<DB: Database> {
    conn: PoolConnection<DB>,
    /// When it left the pool.
    out: Instant,
}

impl<DB: Database> Conn<DB> {
    fn pooled(conn: PoolConnection<DB>) -> Self {
        Conn {
            conn,
            out: Instant::now(),
        }
    }

    /// Closes the connection when dropped, instead of pooling it.
    pub(crate) fn close_on_drop(&mut self) {
        self.conn.close_on_drop();
    }

    /// The pool's connection itself.
    #[cfg(feature = "sqlite")]
    pub(crate) fn pooled_mut(&mut self) -> &mut PoolConnection<DB> {
        &mut self.conn
    }
}

/// A kept connection, taken for a statement.
impl<DB: Database> From<Idling<DB>> for Conn<DB> {
    fn from(idling: Idling<DB>) -> Self {
        Conn {
            conn: idling.conn,
            out: idling.out,
        }
    }
}

impl<DB: Database> Deref for Conn<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        &self.conn
    }
}

impl<DB: Database> DerefMut for Conn<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        &mut self.conn
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;
    use sqlx::sqlite::{Sqlite, SqliteConnectOptions, SqlitePoolOptions};
    use std::str::FromStr;

    /// A pool of at most `most` connections to a database file in a directory of its own
    /// (deleted with the `TempDir`).
    async fn file_pool(most: u32) -> (tempfile::TempDir, Pool<Sqlite>) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("t.db").display());
        let pool = SqlitePoolOptions::new()
            .max_connections(most)
            .test_before_acquire(false)
            .connect_with(SqliteConnectOptions::from_str(&url).unwrap())
            .await
            .unwrap();
        (dir, pool)
    }

    /// [`file_pool`] as the locker's own pool (`Conns::own`: connections kept between
    /// statements).
    async fn owned(most: u32) -> (tempfile::TempDir, Pool<Sqlite>, Conns<Sqlite>) {
        let (dir, pool) = file_pool(most).await;
        let conns = Conns::own(pool.clone());
        (dir, pool, conns)
    }

    /// Until the pool has taken back what was dropped into it (sqlx does it in a task).
    async fn idle_in_pool(pool: &Pool<Sqlite>, n: usize) {
        let until = Instant::now() + Duration::from_secs(5);
        while pool.num_idle() != n && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(pool.num_idle(), n);
    }

    fn kept_count(conns: &Conns<Sqlite>) -> usize {
        conns.kept.as_ref().map_or(0, |k| k.lock().conns.len())
    }

    /// A kept connection serves the next statement without going through the pool, and goes
    /// back to the pool once idle for `IDLE`.
    #[tokio::test]
    async fn a_kept_connection_serves_the_next_statement_then_goes_back_when_idle() {
        let (_dir, pool, conns) = owned(2).await;
        let mut conn = conns.acquire().await.unwrap();
        sqlx::query("SELECT 1").execute(&mut *conn).await.unwrap();
        conns.keep(conn);
        assert_eq!(kept_count(&conns), 1);
        assert_eq!(pool.num_idle(), 0, "kept, not pooled");
        let again = conns.acquire().await.unwrap();
        assert_eq!(kept_count(&conns), 0, "the kept one was taken");
        assert_eq!(pool.size(), 1, "no second connection opened");
        conns.keep(again);
        tokio::time::sleep(IDLE + Duration::from_millis(200)).await;
        assert_eq!(kept_count(&conns), 0, "swept after {IDLE:?} idle");
        idle_in_pool(&pool, 1).await;
    }

    /// The application's pool: every connection goes back to it after its statement.
    #[tokio::test]
    async fn the_callers_pool_gets_every_connection_back() {
        let (_dir, pool) = file_pool(2).await;
        let conns = Conns::from(pool.clone());
        let conn = conns.acquire().await.unwrap();
        conns.keep(conn);
        idle_in_pool(&pool, 1).await;
    }

    /// While a statement waits for a connection, one that comes back goes to it, not to a
    /// statement that asks after it (which would otherwise take it first, every time, and leave
    /// the one waiting behind every newcomer).
    #[tokio::test]
    async fn a_connection_back_goes_to_the_statement_waiting_longest() {
        let (_dir, _pool, conns) = owned(1).await;
        let held = conns.acquire().await.unwrap();
        let first = tokio::spawn({
            let conns = conns.clone();
            async move {
                let conn = conns.acquire().await;
                let had = Instant::now();
                // Held a while, so that a newcomer could only have had it by taking it first.
                tokio::time::sleep(Duration::from_millis(300)).await;
                conn.map(|_| had)
            }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let back = Instant::now();
        conns.keep(held);
        // A newcomer asks the moment it is back: the waiter has it, so the newcomer waits.
        let newcomer = tokio::time::timeout(Duration::from_millis(100), conns.acquire()).await;
        assert!(
            newcomer.is_err(),
            "the newcomer took the waiter's connection"
        );
        let had = first.await.unwrap().expect("the waiter got the connection");
        assert!(
            had.duration_since(back) < Duration::from_millis(100),
            "the waiter got it {:?} after it came back",
            had.duration_since(back)
        );
    }

    /// Closing waits for every connection of the pool: the kept ones go back first.
    #[tokio::test]
    async fn closing_returns_the_kept_connections() {
        let (_dir, pool, conns) = owned(2).await;
        let conn = conns.acquire().await.unwrap();
        conns.keep(conn);
        tokio::time::timeout(Duration::from_secs(5), conns.close())
            .await
            .expect("closed");
        assert!(pool.is_closed());
    }

    /// A locker dropped after its runtime: its kept connections go with the process, no panic
    /// (sqlx would spawn a task to take each back).
    #[test]
    fn a_locker_dropped_outside_its_runtime_does_not_panic() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("t.db").display());
        let rt = tokio::runtime::Runtime::new().unwrap();
        let locker = rt.block_on(async {
            let locker = crate::Locker::connect(&url).await.unwrap();
            locker.migrate().await.unwrap();
            locker.lock("k").await.unwrap().release().await.unwrap();
            locker
        });
        drop(rt);
        drop(locker);
    }
}
