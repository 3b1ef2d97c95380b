//! SQLite ≥ 3.35 (RETURNING): statements on `julianday('now')`, which is fixed for the statement.
//! Times are stored as integer milliseconds since the Unix epoch. Also the pool set-up (WAL,
//! FULL sync, busy timeout) and the result codes that decide retries.
//!
//! SQLite has no server: "the database clock" is the clock of the process running the
//! statement, so every process sharing one SQLite file must share one machine clock.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::sqlite::{
    Sqlite, SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, Connection, Row, SqlSafeStr, SqlStr};

use super::admin::AdminSql;

mod admin;
mod batch;
mod lock;
mod migrate;
mod queue;
mod sql;

pub(crate) use batch::{one_command, write as write_batch, write_whole};
pub(crate) mod read;
use super::migrations::RENEWED;
use super::{quote_ident, Attempt, Dialect, QueueSql};
use crate::backend::kind_sql::KindSqls;
use crate::backend::Conns;
use crate::connect::ConnectOptions;
use crate::error::LockError;
use crate::retry::Failure;
use sql::Statements;
use sql::{sql, SAME, TAKE_OVER};

/// Result codes (primary and extended) after which the statement never got the write lock:
/// the busy timeout ran out, nothing was written.
mod code {
    pub(super) const SQLITE_BUSY: &str = "5";
    pub(super) const SQLITE_LOCKED: &str = "6";
    pub(super) const SQLITE_BUSY_RECOVERY: &str = "261";
    pub(super) const SQLITE_LOCKED_SHAREDCACHE: &str = "262";
    pub(super) const SQLITE_BUSY_SNAPSHOT: &str = "517";
    pub(super) const SQLITE_BUSY_TIMEOUT: &str = "773";
}

/// Clock differences between processes sharing a file that `migrate` lets pass without a warning.
const CLOCK_TOLERANCE_MS: i64 = 1000;

/// How long the pool waits for a connection before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a statement waits for SQLite's write lock (its busy handler) before failing with
/// `SQLITE_BUSY` (classed [`Failure::Locked`]: an acquire answers busy, other statements are
/// sent again). Lock statements hold the write lock for one statement's time; only a
/// transaction holds it longer (an application's fenced transaction, or one that took a key
/// with `lock_in`), and a call made meanwhile answers `Busy` near its `wait` instead of
/// blocking past it.
pub(crate) const WRITE_LOCK_WAIT: Duration = Duration::from_millis(500);

/// A hold that ran out without a release: it ended in failure, unless its success committed
/// with the work (`succeed_in`: `success_token` is its tenure). `{l}` is the row's alias.
const RAN_OUT: &str = "({l}owner IS NOT NULL AND {l}expires_at <= {now}
                AND {l}success_token IS NOT {l}fencing_token)";

fn ran_out(alias: &str) -> String {
    RAN_OUT.replace("{l}", alias)
}

/// Now, in whole milliseconds. `ROUND`, not a plain cast, which truncates a millisecond early.
pub(crate) const NOW: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)";

#[derive(Clone, Debug)]
pub(crate) struct Lite {
    pool: Conns<Sqlite>,
    /// Where releases run: connections of the locker's own at `synchronous = NORMAL` (a lazily
    /// durable release, `ConnectOptions::durable_release`), or `pool` itself.
    release_pool: Conns<Sqlite>,
    /// Whether `release_pool` is those connections: a release then commits without a WAL
    /// flush.
    lazy_release: bool,
    /// The quoted table name, for statements built per call.
    table: Arc<str>,
    sql: Arc<Statements>,
    /// The texts of kinds' own statements (shared locks', `sqlite/read.rs`), each built on
    /// first use.
    kind_sql: Arc<KindSqls>,
    /// The coalesced statements (`sqlite/batch.rs`).
    batch_sql: Arc<batch::Sql>,
    /// One statement at a time per database in this process ([`Dialect::one_at_a_time`]), shared by
    /// the lockers of every table made from this one.
    turn: Arc<tokio::sync::Mutex<()>>,
}

/// A pool configured for locking: WAL, `synchronous = FULL` (a granted lock and its fencing token
/// survive a power cut), a busy timeout; an in-memory database keeps its one connection forever.
pub(crate) async fn connect(
    url: &str,
    table: &str,
    opts: &ConnectOptions,
) -> Result<Lite, LockError> {
    let options = SqliteConnectOptions::from_str(url)
        .map_err(|e| super::bad_url(url, e))?
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        // A write waits for SQLite's lock at most as long as a statement may take.
        .busy_timeout(opts.statement_timeout.min(WRITE_LOCK_WAIT));
    let in_memory = url.contains(":memory:") || url.contains("mode=memory");
    let mut pool = SqlitePoolOptions::new()
        // An in-memory database is one connection's: more would each see a database of its own.
        .max_connections(if in_memory {
            1
        } else {
            opts.max_connections.unwrap_or(8)
        })
        .test_before_acquire(false)
        .acquire_timeout(opts.acquire_timeout.unwrap_or(BUSY_TIMEOUT));
    if in_memory {
        // An in-memory database lives only as long as a connection to it: keep one forever.
        pool = pool
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None);
    }
    let lazy_release = if in_memory || opts.durable_release {
        None
    } else {
        // Releases on connections of their own at `synchronous = NORMAL`: in WAL mode their
        // commits are not flushed; the next FULL commit (a grant, an extension) flushes the
        // shared log, this release included. Opened on first use.
        Some(
            SqlitePoolOptions::new()
                .max_connections(opts.max_connections.unwrap_or(8))
                .test_before_acquire(false)
                .acquire_timeout(opts.acquire_timeout.unwrap_or(BUSY_TIMEOUT))
                .connect_lazy_with(options.clone().synchronous(SqliteSynchronous::Normal)),
        )
    };
    let mut lite = Lite::new(Conns::own(pool.connect_with(options).await?), table);
    if let Some(release_pool) = lazy_release {
        lite.release_pool = Conns::own(release_pool);
        lite.lazy_release = true;
    }
    Ok(lite)
}

/// The test kit's hooks (`dblock::testing`).
#[cfg(feature = "testing")]
impl Lite {
    /// A test locker's faults, if this is one's.
    pub(crate) fn faults(&self) -> Option<&Arc<crate::testing::faults::Faults>> {
        self.pool.faults()
    }

    /// Ends now the live leases of `key` in `table` (with `slots`, of its semaphore permits,
    /// `key ␟ …`), as a vanished holder's would end: not a release. How many it ended.
    pub(crate) async fn expire(
        &self,
        table: &str,
        key: &str,
        slots: bool,
    ) -> Result<u64, LockError> {
        let which = if slots {
            "substr(lock_key, 1, length($1) + 1) = $1 || char(31)"
        } else {
            "lock_key = $1"
        };
        let sql = format!(
            "UPDATE {} SET expires_at = {NOW} WHERE {which} AND owner IS NOT NULL AND expires_at > {NOW}",
            super::quote_ident(table, '"')
        );
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        let done = super::dialect::run(self, &self.pool, deadline, async |c| {
            sqlx::query(AssertSqlSafe(sql)).bind(key).execute(c).await
        })
        .await
        .map_err(|f| LockError::Database(f.error))?;
        Ok(done.rows_affected())
    }
}

impl Lite {
    /// Whether a release commits without waiting for a WAL flush (on connections of its own at
    /// `synchronous = NORMAL`).
    pub(crate) fn releases_lazily(&self) -> bool {
        self.lazy_release
    }

    /// After a busy `once` attempt (SQLite returns no row then): done, or busy.
    async fn done(&self, conn: &mut SqliteConnection, key: &str) -> sqlx::Result<Attempt> {
        let done: Option<(bool, Option<i64>)> = sqlx::query_as(self.sql.done.clone())
            .bind(key)
            .fetch_optional(&mut *conn)
            .await?;
        Ok(match done {
            Some((true, finished_at_us)) => Attempt::Done { finished_at_us },
            _ => Attempt::Busy { retry_after: None },
        })
    }
}

super::backend_trait!(OnSqlite, sqlite, Lite, sqlx::SqliteConnection);

impl Dialect for Lite {
    const NAME: &'static str = "sqlite";
    type Db = Sqlite;

    fn with_table(&self, table: &str) -> Self {
        Lite {
            release_pool: self.release_pool.clone(),
            lazy_release: self.lazy_release,
            turn: self.turn.clone(),
            ..Lite::new(self.pool.clone(), table)
        }
    }

    fn one_at_a_time(&self) -> Option<&tokio::sync::Mutex<()>> {
        Some(&self.turn)
    }

    fn classify(e: &dyn sqlx::error::DatabaseError) -> Failure {
        match e.code().as_deref() {
            // The busy timeout ran out on the file's write lock: another connection holds it
            // (a writer; for long, an open transaction, e.g. one that took a key `lock_in`).
            Some(code::SQLITE_BUSY) | Some(code::SQLITE_BUSY_TIMEOUT) => Failure::Locked,
            Some(code::SQLITE_LOCKED)
            | Some(code::SQLITE_BUSY_RECOVERY)
            | Some(code::SQLITE_LOCKED_SHAREDCACHE)
            | Some(code::SQLITE_BUSY_SNAPSHOT) => Failure::NotCommitted,
            _ => Failure::Fatal,
        }
    }

    fn pool(&self) -> &Conns<Sqlite> {
        &self.pool
    }

    fn database(&self) -> String {
        // The same file by any path is one database (an in-memory database's name is unique
        // to its pool).
        let file = self.pool.connect_options().get_filename().to_owned();
        let canonical = std::fs::canonicalize(&file).or_else(|_| {
            // Not created yet (a lazy pool): its directory, which exists, and its name.
            let dir = file.parent().filter(|d| !d.as_os_str().is_empty());
            let dir = std::fs::canonicalize(dir.unwrap_or(std::path::Path::new(".")))?;
            file.file_name()
                .map(|name| dir.join(name))
                .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
        });
        canonical.unwrap_or(file).display().to_string()
    }

    fn release_pool(&self) -> &Conns<Sqlite> {
        &self.release_pool
    }
}
