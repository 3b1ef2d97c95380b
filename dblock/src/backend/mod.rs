//! The database side: one module per backend, each with the handful of statements dblock needs,
//! its pool set-up and its error codes, all behind one contract ([`Dialect`]). Nothing outside
//! this folder names a backend, apart from the public `Locker` constructors that take a
//! backend's own pool.
//!
//! Every lock operation is ONE statement sent in ONE round trip on an autocommit connection. The
//! comment above each statement says why it is atomic on its own.

pub(crate) use admin::{ForceRelease, Inspect, LiveRows, Purge, Purged, Reset, RowsIn};
pub(crate) use conns::Conns;
use tokio::time::Instant;

use crate::connect::ConnectOptions;
use crate::error::LockError;
use crate::retry::{self, Failure};
pub(crate) use contract::*;
pub(crate) use dialect::*;
pub(crate) use runs::*;
pub(crate) use tables::{permits_table, queue_table, quote_ident};

mod admin;
pub(crate) mod batch;
pub(crate) mod coalesce;
pub(crate) mod conns;
pub(crate) mod contract;
mod dialect;
pub(crate) mod exec;
pub(crate) mod fence;
pub(crate) mod kind_sql;
pub(crate) mod migrations;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
pub(crate) mod operator;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
pub(crate) mod read;
mod runs;
pub(crate) mod semaphore;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;
mod tables;

pub(crate) use crate::retry::Failed;

#[cfg(not(any(feature = "postgres", feature = "mysql", feature = "sqlite")))]
compile_error!("dblock needs at least one backend feature: `sqlite`, `postgres` or `mysql`");

/// The database behind a [`Locker`](crate::Locker): a closed set, dispatched statically.
#[derive(Clone, Debug)]
pub(crate) enum Backend {
    #[cfg(feature = "postgres")]
    Postgres(postgres::Pg),
    #[cfg(feature = "mysql")]
    MySql(mysql::My),
    #[cfg(feature = "sqlite")]
    Sqlite(sqlite::Lite),
}

/// Forwards a call to whichever backend is active: `$b` is the dialect value, `$D` its type.
macro_rules! dispatch {
    ($self:expr, $b:ident, $D:ident => $call:expr) => {
        match $self {
            #[cfg(feature = "postgres")]
            Backend::Postgres($b) => {
                #[allow(dead_code)]
                type $D = postgres::Pg;
                $call
            }
            #[cfg(feature = "mysql")]
            Backend::MySql($b) => {
                #[allow(dead_code)]
                type $D = mysql::My;
                $call
            }
            #[cfg(feature = "sqlite")]
            Backend::Sqlite($b) => {
                #[allow(dead_code)]
                type $D = sqlite::Lite;
                $call
            }
        }
    };
}

impl Backend {
    /// Connects to `url` with a pool configured for locking, by the URL's scheme.
    pub(crate) async fn connect(
        url: &str,
        table: &str,
        options: &ConnectOptions,
    ) -> Result<Backend, LockError> {
        let scheme = crate::redact::scheme(url).unwrap_or_default();
        match scheme {
            #[cfg(feature = "postgres")]
            "postgres" | "postgresql" => Ok(Backend::Postgres(
                postgres::connect(url, table, options).await?,
            )),
            #[cfg(feature = "mysql")]
            "mysql" | "mariadb" => Ok(Backend::MySql(mysql::connect(url, table, options).await?)),
            #[cfg(feature = "sqlite")]
            "sqlite" => Ok(Backend::Sqlite(sqlite::connect(url, table, options).await?)),
            #[allow(unreachable_patterns)]
            "postgres" | "postgresql" | "mysql" | "mariadb" | "sqlite" => {
                let feature = match scheme {
                    "postgres" | "postgresql" => "postgres",
                    "mysql" | "mariadb" => "mysql",
                    _ => "sqlite",
                };
                Err(LockError::Config(format!(
                    "dblock was built without the `{feature}` feature"
                )))
            }
            _ => Err(LockError::Config(format!(
                "unsupported database URL {} (expected postgres://, mysql:// or sqlite:)",
                crate::redact::redact(url)
            ))),
        }
    }

    pub(crate) fn name(&self) -> &'static str {
        dispatch!(self, _b, D => D::NAME)
    }

    /// The longest a lock statement of this locker waits for a row lock (SQLite: the file's
    /// write lock) before the server rolls it back ([`Failure::Locked`]): PostgreSQL's
    /// `lock_timeout` (250 ms), MySQL's `innodb_lock_wait_timeout` (1 s, its shortest), SQLite's
    /// busy timeout (500 ms). A pool the application passes in keeps its own settings; this is
    /// what the locker's own pools use.
    pub(crate) fn row_lock_wait(
        &self,
        statement_timeout: std::time::Duration,
    ) -> std::time::Duration {
        let wait = match self {
            #[cfg(feature = "postgres")]
            Backend::Postgres(_) => postgres::row_lock_wait(statement_timeout),
            #[cfg(feature = "mysql")]
            Backend::MySql(_) => std::time::Duration::from_secs(1),
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(_) => sqlite::WRITE_LOCK_WAIT,
        };
        wait.min(statement_timeout)
    }

    /// Statements of one kind a locker keeps in flight before further calls queue and travel
    /// together (`backend/coalesce/`). SQLite: one, since it has one writer at a time and a
    /// second statement would only wait for the file's write lock (in its busy handler's
    /// sleeps). A server: at most one per pooled connection, so that coalescing takes away no
    /// parallelism while batches stay small: only a call that would have waited for a
    /// connection waits for a batch instead.
    ///
    /// Once batches grow (8 rows on average), lone calls keep one slot (whose call then
    /// gathers the calls woken beside it rather than go alone: `coalesce::GATHER_YIELDS`),
    /// and every other call waits for a batch; below 4 rows on average they get every slot back
    /// ([`coalesce::Slots`]). Then most rows travel in few, large statements, and the server
    /// spends its CPU on rows, not on statements. A fixed 3 or 5 slots per kind (not moving
    /// with the batches) took the parallelism of 8 owners away (0.5–0.8× `coalesce(false)`);
    /// the moving bound leaves 1 and 8 owners as they were (0.99–1.04×). Measured 2026-11-26,
    /// 64 owners, pool of 10, each server's lock table vacuumed before every round:
    ///
    /// | lone calls' slots once batches are large | PostgreSQL | MariaDB |
    /// |---|---|---|
    /// | 10 (all) | 2.63–2.81× `coalesce(false)`, 12 rows a batch | – |
    /// | 5 | 2.90× | – |
    /// | 3 | 2.99–3.61×, 19 rows | 2.29–2.41×, 19.5 rows |
    /// | 2 | 3.74–3.75×, 24 rows | 2.55× |
    /// | 1 | 3.92–4.24×, 33 rows; p99 7.4–9.7 ms against 25–29 ms | 3.24–3.28×, 30 rows |
    pub(crate) fn coalesce_slots(&self) -> coalesce::Slots {
        match self {
            #[cfg(feature = "postgres")]
            Backend::Postgres(b) => {
                let most = b.pool().options().get_max_connections() as usize;
                coalesce::Slots { most, least: 1 }
            }
            #[cfg(feature = "mysql")]
            Backend::MySql(b) => {
                let most = b.pool().options().get_max_connections() as usize;
                coalesce::Slots { most, least: 1 }
            }
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(_) => coalesce::Slots { most: 1, least: 1 },
        }
    }

    /// Statements every lane of a locker keeps in flight together ([`coalesce::Budget`]): while
    /// batches are small, and once they are large (8 rows on average).
    /// - PostgreSQL: one per pooled connection while batches are small; three fifths of that
    ///   once they are large: 64 owners, pool of 10, 2026-11-26, with lone calls keeping one
    ///   slot: 4 or 6 in flight gave 4.00–4.19× `coalesce(false)` and 3.89–4.37× pgbench in
    ///   four runs, all 10 gave 3.74–3.85× and 3.45–4.12× in six; a fixed 6 took 8 owners'
    ///   parallelism (0.75–0.79×), which the moving bound keeps (1.00×). Before that,
    ///   measured 2026-11-25 at 64 owners, pool of 10, in the same conditions: 2.09–2.70×
    ///   `coalesce(false)` with p99 16–32 ms (its own:
    ///   31–39 ms) in seven runs of eight (the eighth 1.63×, 60 ms), against 1.06–1.65× and
    ///   p99 54–98 ms (`coalesce(false)`: 28–72 ms) with each lane's 10 slots alone (a batch
    ///   given a slot then queued again in the pool); 1 and 8 owners unchanged (1.00–1.12×).
    /// - MySQL/MariaDB: no bound beyond the lanes' own slots ([`coalesce::Slots`]). A shared
    ///   budget sends a lane's queue whenever any lane's statement ends, so batches halved
    ///   (18 to 10.5 rows) and 64 owners fell from 2.23–2.44× to 1.90–2.19×: there the server
    ///   runs out of CPU per statement, and fewer, larger statements serve more.
    /// - SQLite: its statements take turns in the process ([`Dialect::one_at_a_time`]) anyway.
    pub(crate) fn coalesce_budget(&self) -> (usize, usize) {
        match self {
            #[cfg(feature = "postgres")]
            Backend::Postgres(b) => {
                let most = b.pool().options().get_max_connections() as usize;
                (most, (most * 3 / 5).max(2))
            }
            #[cfg(feature = "mysql")]
            Backend::MySql(_) => (usize::MAX, usize::MAX),
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(_) => (usize::MAX, usize::MAX),
        }
    }

    /// Whether a statement of releases alone commits without waiting for a flush to disk, which
    /// a statement beside an acquire waits for: SQLite's lazily durable releases, which go
    /// ahead of the acquires in its lane of every kind ([`coalesce::Row::leads`]). Elsewhere
    /// each kind has a lane of its own.
    pub(crate) fn releases_lead(&self) -> bool {
        match self {
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(b) => b.releases_lazily(),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Whether statements of every kind go together ([`coalesce::WriteRow`]): SQLite, whose
    /// statements take turns at one write lock anyway, and whose acquires each wait for a WAL
    /// flush: a transaction of a batch of each kind pays one flush for all of them.
    pub(crate) fn coalesce_kinds_together(&self) -> bool {
        match self {
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(_) => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Coalesced rows of every kind (sorted by key each, distinct keys over all): on SQLite one
    /// transaction (`sqlite/batch.rs`), elsewhere a statement per kind.
    pub(crate) async fn write_batch(
        &self,
        acquires: &[Acquire<'_>],
        releases: &[coalesce::ReleaseRow],
        extends: &[RenewItem<'_>],
        deadline: Instant,
    ) -> Result<(Vec<Attempt>, Vec<Released>, Extended), Failed> {
        #[cfg(feature = "sqlite")]
        #[allow(irrefutable_let_patterns)] // the only backend of a SQLite-only build
        if let Backend::Sqlite(b) = self {
            let kinds = [
                !acquires.is_empty(),
                !releases.is_empty(),
                !extends.is_empty(),
            ];
            if kinds == [true, true, false] && sqlite::one_command(acquires, releases) {
                let (attempts, released) = run_to_end(b, b.pool(), deadline, async |c| {
                    sqlite::write_whole(b, c, acquires, releases).await
                })
                .await?;
                return Ok((attempts, released, Vec::new()));
            }
            if kinds.iter().filter(|k| **k).count() > 1 {
                return run(b, b.pool(), deadline, async |c| {
                    sqlite::write_batch(b, c, acquires, releases, extends).await
                })
                .await;
            }
        }
        // One kind (its own batch, or its one-row statement), or a backend whose kinds are
        // statements of their own.
        let attempts = if acquires.is_empty() {
            Vec::new()
        } else {
            self.acquire_batch(acquires, deadline).await?
        };
        let released = if releases.is_empty() {
            Vec::new()
        } else {
            self.release_batch(releases, deadline).await?
        };
        let extended = self.extend_many(extends, deadline).await?;
        Ok((attempts, released, extended))
    }

    /// Runs statement `s` under `policy`: sent again as the failures' classes allow
    /// ([`retry::run`]).
    pub(crate) async fn retried<S: Runs>(
        &self,
        s: &S,
        policy: retry::Policy,
    ) -> retry::Tried<S::Output> {
        retry::run(policy, |f| self.classify(f), |limit| self.run(s, limit)).await
    }

    /// Runs statement `s` on a pooled connection within `deadline` (see [`Statement`]).
    pub(crate) async fn run<S: Runs>(&self, s: &S, deadline: Instant) -> Result<S::Output, Failed> {
        match self {
            #[cfg(feature = "postgres")]
            Backend::Postgres(b) => {
                run(b, b.pool_for::<S>(), deadline, async |c| {
                    s.postgres(b, c).await
                })
                .await
            }
            #[cfg(feature = "mysql")]
            Backend::MySql(b) => {
                run(b, b.pool_for::<S>(), deadline, async |c| {
                    s.mysql(b, c).await
                })
                .await
            }
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(b) => {
                run(b, b.pool_for::<S>(), deadline, async |c| {
                    s.sqlite(b, c).await
                })
                .await
            }
        }
    }

    /// See [`Dialect::database`].
    pub(crate) fn database(&self) -> String {
        dispatch!(self, b, D => format!("{}://{}", D::NAME, b.database()))
    }

    pub(crate) fn with_table(&self, table: &str) -> Backend {
        dispatch!(self, b, D => b.with_table(table).into())
    }

    /// How a failed statement may be retried: the server's own codes by this backend's
    /// mapping, everything else by the transport's; whatever failed before anything was sent
    /// certainly did not commit.
    pub(crate) fn classify(&self, failed: &Failed) -> Failure {
        let failure = match (&failed.error, failed.class) {
            // A row of a coalesced statement that failed: classed as the statement was.
            (_, Some(class)) => class,
            (sqlx::Error::Database(db), None) => dispatch!(self, _b, D => D::classify(db.as_ref())),
            (other, None) => retry::transport(other),
        };
        match failure {
            Failure::Unknown | Failure::NotCommitted | Failure::Locked if !failed.sent => {
                Failure::NotSent
            }
            other => other,
        }
    }

    /// Coalesced acquires ([`AcquireBatch`](coalesce::AcquireBatch)); one row goes as the
    /// one-row statement.
    pub(crate) async fn acquire_batch(
        &self,
        rows: &[Acquire<'_>],
        deadline: Instant,
    ) -> Result<Vec<Attempt>, Failed> {
        match rows {
            [one] => Ok(vec![self.run(one, deadline).await?]),
            rows => self.run(&coalesce::AcquireBatch(rows), deadline).await,
        }
    }

    /// Coalesced releases ([`ReleaseBatch`](coalesce::ReleaseBatch)); one row goes as the
    /// one-row statement.
    pub(crate) async fn release_batch(
        &self,
        rows: &[coalesce::ReleaseRow],
        deadline: Instant,
    ) -> Result<Vec<Released>, Failed> {
        match rows {
            [one] => Ok(vec![self.run(&one.statement(), deadline).await?]),
            rows => self.run(&coalesce::ReleaseBatch(rows), deadline).await,
        }
    }

    /// Renewal's extensions ([`ExtendMany`]); none is no statement.
    pub(crate) async fn extend_many(
        &self,
        items: &[RenewItem<'_>],
        deadline: Instant,
    ) -> Result<Extended, Failed> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        self.run(&ExtendMany(items), deadline).await
    }

    /// PostgreSQL behind a transaction pooler (`ConnectOptions::pooler`): statements go as
    /// simple queries with inlined values. `false` elsewhere.
    pub(crate) fn pooler(&self) -> bool {
        match self {
            #[cfg(feature = "postgres")]
            Backend::Postgres(pg) => pg.pooler(),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// PostgreSQL: stops the LISTEN connection for good (waiters then only poll).
    pub(crate) fn stop_listening(&self) {
        match self {
            #[cfg(feature = "postgres")]
            Backend::Postgres(pg) => pg.stop_listening(),
            #[allow(unreachable_patterns)]
            _ => {}
        }
    }

    /// PostgreSQL: interest in a release of `key`, woken by NOTIFY (the LISTEN connection is set
    /// up on first use). `None` elsewhere, or when LISTEN is off or failed: the caller polls.
    pub(crate) async fn interest(&self, key: &str) -> Option<Interest> {
        match self {
            #[cfg(feature = "postgres")]
            Backend::Postgres(pg) => pg.interest(key).await.map(|inner| Interest { inner }),
            #[allow(unreachable_patterns)]
            _ => {
                let _ = key;
                None
            }
        }
    }
}

/// Hooks for tests and the benchmark (`crate::test_util`).
/// What [`Backend::prepare_lock_in`] found.
pub(crate) struct LockInCheck {
    /// The key may be free: send the attempt (else it is busy this time).
    pub(crate) free: bool,
    /// MariaDB: the statement's own bound on its wait for the row lock, in whole seconds.
    pub(crate) mariadb_wait: Option<u64>,
}

impl Backend {
    /// Before each `lock_in` attempt: whether to send it (on MySQL the key must look free on
    /// the locker's own pool first, which also creates a new key's row: `My::prepare_lock_in`),
    /// and how long (whole seconds) the statement may wait for a row lock when it can bound that
    /// itself (MariaDB: `SET STATEMENT`).
    pub(crate) async fn prepare_lock_in(&self, key: &str) -> sqlx::Result<LockInCheck> {
        match self {
            #[cfg(feature = "mysql")]
            Backend::MySql(my) => {
                let (free, mariadb) = my.prepare_lock_in(key).await?;
                Ok(LockInCheck {
                    free,
                    mariadb_wait: mariadb.then_some(0),
                })
            }
            #[allow(unreachable_patterns)]
            _ => {
                let _ = key;
                Ok(LockInCheck {
                    free: true,
                    mariadb_wait: None,
                })
            }
        }
    }

    /// Whether a failure of a statement sent on the caller's connection rolled back only that
    /// statement because a lock was not to be had in time (MariaDB's bounded wait, error 1205
    /// at `innodb_lock_wait_timeout = 0`; SQLite's `SQLITE_BUSY`): the key is busy, the
    /// transaction goes on.
    pub(crate) fn lock_not_had(&self, e: &sqlx::Error) -> bool {
        match (self, e) {
            #[cfg(feature = "mysql")]
            (Backend::MySql(_), sqlx::Error::Database(db)) => {
                mysql::lock_wait_timed_out(db.as_ref())
            }
            // The caller's busy timeout ran out on the file's write lock (a deferred transaction
            // that had not written yet): the statement failed, the transaction goes on.
            #[cfg(feature = "sqlite")]
            (Backend::Sqlite(_), sqlx::Error::Database(db)) => {
                matches!(db.code().as_deref(), Some("5") | Some("773"))
            }
            _ => false,
        }
    }
}

impl Backend {
    /// MySQL: the MySQL 8 statements even on MariaDB. Others: unchanged.
    #[cfg(any(test, feature = "_test-util"))]
    pub(crate) fn without_returning(&self) -> Backend {
        match self {
            #[cfg(feature = "mysql")]
            Backend::MySql(my) => Backend::MySql(my.without_returning()),
            #[allow(unreachable_patterns)]
            other => other.clone(),
        }
    }

    /// PostgreSQL: no LISTEN/NOTIFY wake-ups. Others: unchanged.
    #[cfg(feature = "_test-util")]
    pub(crate) fn without_notify(&self) -> Backend {
        match self {
            #[cfg(feature = "postgres")]
            Backend::Postgres(pg) => Backend::Postgres(pg.without_notify()),
            #[allow(unreachable_patterns)]
            other => other.clone(),
        }
    }

    /// PostgreSQL: the NOTIFY channel of the table.
    #[cfg(feature = "_test-util")]
    pub(crate) fn notify_channel(&self) -> Option<String> {
        match self {
            #[cfg(feature = "postgres")]
            Backend::Postgres(pg) => Some(pg.channel().to_owned()),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// PostgreSQL: a `pgbench` script of one lock cycle with this backend's own statements.
    #[cfg(feature = "_test-util")]
    pub(crate) fn pgbench_script(&self) -> Option<String> {
        match self {
            #[cfg(feature = "postgres")]
            Backend::Postgres(pg) => Some(pg.pgbench_script()),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// MySQL / MariaDB: the session value of the system variable `name` (a plain identifier)
    /// on a connection of the pool. Others: `None`.
    #[cfg(feature = "_test-util")]
    pub(crate) async fn mysql_session_variable(&self, name: &str) -> sqlx::Result<Option<String>> {
        match self {
            #[cfg(feature = "mysql")]
            Backend::MySql(my) => my.session_variable(name).await.map(Some),
            #[allow(unreachable_patterns)]
            _ => {
                let _ = name;
                Ok(None)
            }
        }
    }
}

/// A waiter's interest in a release of one key; dropping it withdraws the interest.
pub(crate) struct Interest {
    #[cfg(feature = "postgres")]
    inner: postgres::notify::Interest,
}

impl Interest {
    /// Resolves when a release of the key is announced.
    pub(crate) async fn notified(&self) {
        #[cfg(feature = "postgres")]
        self.inner.notify.notified().await;
    }
}

#[cfg(feature = "postgres")]
impl From<postgres::Pg> for Backend {
    fn from(b: postgres::Pg) -> Self {
        Backend::Postgres(b)
    }
}

#[cfg(feature = "mysql")]
impl From<mysql::My> for Backend {
    fn from(b: mysql::My) -> Self {
        Backend::MySql(b)
    }
}

#[cfg(feature = "sqlite")]
impl From<sqlite::Lite> for Backend {
    fn from(b: sqlite::Lite) -> Self {
        Backend::Sqlite(b)
    }
}

/// A URL sqlx could not parse, reported without its password.
pub(crate) fn bad_url(url: &str, e: sqlx::Error) -> LockError {
    // sqlx's own message may quote what it could not parse: scrubbed of the URL's secrets.
    LockError::Config(format!(
        "cannot parse database URL {}: {}",
        crate::redact::redact(url),
        crate::redact::scrub(&e.to_string(), url)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each `0005_permits.sql` is 0001 to 0004 again (their comment lines aside) for the
    /// permits table and its queue, as `Locker::migrate` runs them (`semaphore.rs`).
    #[test]
    fn the_permits_migration_is_the_lock_tables_under_its_own_name() {
        let files = [
            (
                [
                    include_str!("../../migrations/postgres/0001_dblock_locks.sql"),
                    include_str!("../../migrations/postgres/0002_outcomes.sql"),
                    include_str!("../../migrations/postgres/0003_exactly_once.sql"),
                    include_str!("../../migrations/postgres/0004_fair_queue.sql"),
                ],
                include_str!("../../migrations/postgres/0005_permits.sql"),
                '"',
            ),
            (
                [
                    include_str!("../../migrations/mysql/0001_dblock_locks.sql"),
                    include_str!("../../migrations/mysql/0002_outcomes.sql"),
                    include_str!("../../migrations/mysql/0003_exactly_once.sql"),
                    include_str!("../../migrations/mysql/0004_fair_queue.sql"),
                ],
                include_str!("../../migrations/mysql/0005_permits.sql"),
                '`',
            ),
            (
                [
                    include_str!("../../migrations/sqlite/0001_dblock_locks.sql"),
                    include_str!("../../migrations/sqlite/0002_outcomes.sql"),
                    include_str!("../../migrations/sqlite/0003_exactly_once.sql"),
                    include_str!("../../migrations/sqlite/0004_fair_queue.sql"),
                ],
                include_str!("../../migrations/sqlite/0005_permits.sql"),
                '"',
            ),
        ];
        for (earlier, permits, q) in files {
            let name = |t: &str| quote_ident(t, q);
            let expected: String = earlier
                .iter()
                .map(|f| {
                    let body: Vec<&str> = f.lines().filter(|l| !l.starts_with("--")).collect();
                    (body.join("\n") + "\n")
                        .replace(
                            &name("dblock_locks_queue"),
                            &name(&queue_table(&permits_table("dblock_locks"))),
                        )
                        .replace(&name("dblock_locks"), &name(&permits_table("dblock_locks")))
                })
                .collect();
            let body: Vec<&str> = permits.lines().filter(|l| !l.starts_with("--")).collect();
            assert_eq!(body.join("\n") + "\n", expected);
        }
    }
}

#[cfg(test)]
pub(crate) mod statement_tests;

/// Whether a test may not skip for want of a server (`DBLOCK_REQUIRE_SERVERS=1`, as in CI).
#[cfg(test)]
pub(crate) fn servers_required() -> bool {
    std::env::var("DBLOCK_REQUIRE_SERVERS").is_ok_and(|v| v == "1")
}
