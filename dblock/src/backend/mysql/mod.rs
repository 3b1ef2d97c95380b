//! MySQL 8 and MariaDB ≥ 10.5: statements on `UTC_TIMESTAMP(6)` (fixed for the statement and
//! independent of the session time zone), the pool set-up (READ COMMITTED, Galera settings) and
//! the error numbers that decide retries.
//!
//! MySQL evaluates `SET` / `ON DUPLICATE KEY UPDATE` assignments left to right, each one seeing
//! the columns already assigned. Every statement here is ordered so that each assignment reads
//! only columns that are still old, except where it means to read a new value (said in place).

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::mysql::{
    MySql, MySqlConnectOptions, MySqlConnection, MySqlDatabaseError, MySqlPoolOptions,
};
use sqlx::{AssertSqlSafe, Row, SqlSafeStr, SqlStr};
use tokio::sync::OnceCell;

use super::admin::AdminSql;

mod admin;
pub(crate) mod batch;
mod lock;
mod migrate;
mod queue;
pub(crate) mod read;
mod sql;
use super::{quote_ident, Acquire, Dialect};
use crate::backend::kind_sql::KindSqls;
use crate::backend::Conns;
use crate::connect::ConnectOptions;
use crate::error::LockError;
use crate::retry::Failure;
use sql::Statements;

/// Server and client error numbers that decide how a failed statement is retried.
mod code {
    /// Rolled back: deadlock victim, and Galera's certification conflict.
    pub(super) const ER_LOCK_DEADLOCK: u16 = 1213;
    /// Rolled back: `innodb_lock_wait_timeout` ran out (an autocommit statement is undone).
    pub(super) const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;
    /// Rolled back: the statement was killed (`KILL QUERY`).
    pub(super) const ER_QUERY_INTERRUPTED: u16 = 1317;
    /// Rolled back: MariaDB's `max_statement_time` ran out ("Query execution was interrupted
    /// (max_statement_time exceeded)"; seen on Galera while a dead node was being evicted).
    pub(super) const ER_STATEMENT_TIMEOUT: u16 = 1969;
    /// Galera: "WSREP has not yet prepared node for application use".
    pub(super) const ER_UNKNOWN_COM_ERROR: u16 = 1047;
    pub(super) const ER_SERVER_SHUTDOWN: u16 = 1053;
    /// MariaDB: the connection was killed.
    pub(super) const ER_CONNECTION_KILLED: u16 = 1927;
    pub(super) const CR_SERVER_GONE_ERROR: u16 = 2006;
    pub(super) const CR_SERVER_LOST: u16 = 2013;
    /// A column added twice (a migration that raced another process's).
    pub(super) const ER_DUP_FIELDNAME: u16 = 1060;
    /// `SET` of a variable the server does not have (wsrep_* on a server without Galera).
    pub(super) const ER_UNKNOWN_SYSTEM_VARIABLE: u16 = 1193;
}

/// How long `Locker::connect`'s pool waits for a connection before failing.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// `hold_count` travels in the bits above this in `LAST_INSERT_ID` on the MySQL 8 path and in
/// the read acquire (fencing tokens are seeded from the clock in µs and stay below 2^52 until
/// the year 2112; the statements write the shift as `4503599627370496`).
const COUNT_SHIFT: u32 = 52;

/// A grant from a `LAST_INSERT_ID` answer (`hold_count << 52 | fencing_token`, not zero). Those
/// statements cannot read the server's lease end back: the send time plus the lease, on the
/// client's clock, is reported instead, for display only. Nothing decides expiry by it (the
/// database does; the hold's local deadline is an `Instant` taken at the send).
fn packed_grant(packed: u64, sent_at: std::time::SystemTime, lease_us: i64) -> super::Grant {
    let local_us = sent_at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64);
    super::Grant {
        hold_count: (packed >> COUNT_SHIFT) as u32,
        fencing_token: packed & ((1u64 << COUNT_SHIFT) - 1),
        expires_at_us: local_us.saturating_add(lease_us),
    }
}

const US_NOW: &str = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6))";

#[derive(Clone, Debug)]
pub(crate) struct My {
    pool: Conns<MySql>,
    /// The quoted table name, for statements built per call.
    table: Arc<str>,
    sql: Arc<Statements>,
    /// The texts of kinds' own statements (shared locks', `mysql/read.rs`), each built on
    /// first use.
    kind_sql: Arc<KindSqls>,
    /// `true` when the server takes `INSERT ... RETURNING` (MariaDB ≥ 10.5); decided once.
    returning: Arc<OnceCell<bool>>,
}

/// A pool configured for locking: autocommit connections at READ COMMITTED, statement and row
/// lock time-outs, Galera's automatic retry off and causal reads on, no ping before each
/// statement, a bounded wait for a connection.
pub(crate) async fn connect(
    url: &str,
    table: &str,
    opts: &ConnectOptions,
) -> Result<My, LockError> {
    let url = url.replacen("mariadb://", "mysql://", 1);
    let options = MySqlConnectOptions::from_str(&url).map_err(|e| super::bad_url(&url, e))?;
    let secs = opts.statement_timeout.as_secs_f64();
    // MariaDB's max_statement_time (seconds, any statement); innodb_lock_wait_timeout is whole
    // seconds, at least 1 on MySQL: the shortest wait for a row lock there is. Lock statements
    // hold a row for one statement's time; only a transaction (a fenced one, or a key taken
    // with `lock_in`) holds it longer, and a call on such a key answers `Busy` near its `wait`
    // (the statement rolled back, 1205, and tried again) instead of blocking for longer.
    let session = Arc::new([
        "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED".to_owned(),
        "SET SESSION innodb_lock_wait_timeout = 1".to_owned(),
        format!("SET SESSION max_statement_time = {secs:.3}"),
        // Galera: no automatic autocommit retry (it can answer one RETURNING statement with two
        // rows, the first stale), and causal reads for read-only paths.
        "SET SESSION wsrep_retry_autocommit = 0, wsrep_sync_wait = 1".to_owned(),
    ]);
    let acquire_timeout = opts.acquire_timeout.unwrap_or(ACQUIRE_TIMEOUT);
    let pool = MySqlPoolOptions::new()
        .max_connections(opts.max_connections.unwrap_or(10))
        .test_before_acquire(false)
        .acquire_timeout(acquire_timeout)
        .after_connect(move |conn, _meta| {
            let session = session.clone();
            Box::pin(async move {
                use sqlx::Executor as _;
                for statement in session.iter() {
                    match conn.execute(AssertSqlSafe(statement.as_str())).await {
                        // A server without the variable (MySQL has no max_statement_time and
                        // no wsrep_*): that setting does not apply there.
                        Err(sqlx::Error::Database(e))
                            if e.try_downcast_ref::<MySqlDatabaseError>().is_some_and(|e| {
                                e.number() == code::ER_UNKNOWN_SYSTEM_VARIABLE
                            }) => {}
                        other => {
                            other?;
                        }
                    }
                }
                Ok(())
            })
        })
        .connect_lazy_with(options);
    let pool = Conns::own(pool);
    super::exec::first_connection(&pool, acquire_timeout).await?;
    Ok(My::new(pool, table))
}

impl My {
    async fn supports_returning(&self, conn: &mut MySqlConnection) -> sqlx::Result<bool> {
        self.returning
            .get_or_try_init(|| async {
                let version: String = sqlx::query_scalar("SELECT VERSION()")
                    .fetch_one(&mut *conn)
                    .await?;
                Ok(mariadb_with_returning(&version))
            })
            .await
            .copied()
    }

    /// Before a `lock_in` attempt, on this pool (autocommit, READ COMMITTED: the latest committed
    /// row, never in the caller's transaction): whether the key looks free, creating its row
    /// (free) if no one has used the key; and whether the server is MariaDB, whose statement can
    /// bound its own wait for the row lock.
    ///
    /// Why here and not in the caller's transaction: InnoDB locks a row it reads for an `UPDATE`
    /// before it tests the rest of the `WHERE`, and at REPEATABLE READ (MySQL's default) keeps
    /// that lock to the end of the transaction even when the row did not match. An attempt
    /// on a key a lease holds would hold up that holder's renewal and release for as long as
    /// the caller's transaction stays open. So the caller's transaction only sends its `UPDATE`
    /// when the key looked free here (a lease taken in between still makes that one attempt
    /// lock the row: the race is one round trip wide). Likewise an insert of a new key in the
    /// caller's transaction would hold insert-intention and, at REPEATABLE READ, gap locks that
    /// block other sessions' inserts of neighbouring keys until it ends.
    pub(crate) async fn prepare_lock_in(&self, key: &str) -> sqlx::Result<(bool, bool)> {
        let mut conn = self.pool.acquire().await?;
        let mariadb = self.supports_returning(&mut conn).await?;
        let state = format!(
            "SELECT CAST(expires_at <= UTC_TIMESTAMP(6) AS SIGNED) FROM {} WHERE lock_key = ?",
            self.table
        );
        let free: Option<i64> = sqlx::query_scalar(AssertSqlSafe(state))
            .bind(key)
            .fetch_optional(&mut *conn)
            .await?;
        if free.is_none() {
            // A racing creator makes this a no-op. Its lease ended at the epoch; its token is
            // the clock's microseconds, as an acquire seeds it.
            let create = format!(
                "INSERT IGNORE INTO {} (lock_key, owner, hold_count, fencing_token, expires_at,
    acquired_at) VALUES (?, NULL, 0, {US_NOW}, '1970-01-01 00:00:01', '1970-01-01 00:00:01')",
                self.table
            );
            sqlx::query(AssertSqlSafe(create))
                .bind(key)
                .execute(&mut *conn)
                .await?;
        }
        self.pool.keep(conn);
        Ok((free != Some(0), mariadb))
    }
}

super::backend_trait!(OnMySql, mysql, My, sqlx::MySqlConnection);

impl Dialect for My {
    const NAME: &'static str = "mysql";
    type Db = MySql;

    fn with_table(&self, table: &str) -> Self {
        My {
            // Keeps a forced dialect (tests of the MySQL 8 path) and the detected one.
            returning: self.returning.clone(),
            ..My::new(self.pool.clone(), table)
        }
    }

    fn classify(e: &dyn sqlx::error::DatabaseError) -> Failure {
        let Some(e) = e.try_downcast_ref::<MySqlDatabaseError>() else {
            return Failure::Fatal;
        };
        match e.number() {
            code::ER_LOCK_WAIT_TIMEOUT => Failure::Locked,
            code::ER_LOCK_DEADLOCK | code::ER_QUERY_INTERRUPTED | code::ER_STATEMENT_TIMEOUT => {
                Failure::NotCommitted
            }
            code::ER_UNKNOWN_COM_ERROR
            | code::ER_SERVER_SHUTDOWN
            | code::ER_CONNECTION_KILLED
            | code::CR_SERVER_GONE_ERROR
            | code::CR_SERVER_LOST => Failure::Unknown,
            _ => Failure::Fatal,
        }
    }

    fn pool(&self) -> &Conns<MySql> {
        &self.pool
    }

    fn database(&self) -> String {
        let o = self.pool.connect_options();
        let db = o.get_database().unwrap_or_default();
        super::dialect::server_database(o.get_socket(), o.get_host(), o.get_port(), db)
    }
}

/// Error 1205: a row lock not had within `innodb_lock_wait_timeout` (only the statement is
/// rolled back, `innodb_rollback_on_timeout` being off by default).
pub(crate) fn lock_wait_timed_out(e: &dyn sqlx::error::DatabaseError) -> bool {
    e.try_downcast_ref::<MySqlDatabaseError>()
        .is_some_and(|e| e.number() == code::ER_LOCK_WAIT_TIMEOUT)
}

/// `true` for MariaDB 10.5 and later, whose INSERT takes RETURNING.
fn mariadb_with_returning(version: &str) -> bool {
    let Some(at) = version.find("MariaDB") else {
        return false;
    };
    // "10.11.19-MariaDB-0+deb12u1", or "5.5.5-10.11.19-MariaDB" from some proxies.
    let head = version[..at].trim_start_matches("5.5.5-");
    let mut parts = head.split(['.', '-']).filter_map(|p| p.parse::<u32>().ok());
    match (parts.next(), parts.next()) {
        (Some(major), Some(minor)) => (major, minor) >= (10, 5),
        _ => false,
    }
}

#[cfg(any(test, feature = "_test-util"))]
impl My {
    /// Uses the MySQL 8 statement even on MariaDB (tests run it against MariaDB that way).
    pub(crate) fn without_returning(&self) -> Self {
        My {
            returning: Arc::new(OnceCell::new_with(Some(false))),
            ..self.clone()
        }
    }

    /// The session value of the system variable `name` (a plain identifier, checked by the
    /// caller), as text, on a connection of the pool: the settings lock statements run with.
    #[cfg(feature = "_test-util")]
    pub(crate) async fn session_variable(&self, name: &str) -> sqlx::Result<String> {
        let sql = format!("SELECT CAST(@@session.{name} AS CHAR)");
        let mut conn = self.pool.acquire().await?;
        let value = sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(&mut *conn)
            .await?;
        self.pool.keep(conn);
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::mariadb_with_returning;

    #[test]
    fn tells_mariadb_with_returning_from_the_rest() {
        assert!(mariadb_with_returning("10.11.19-MariaDB-0+deb12u1"));
        assert!(mariadb_with_returning("10.5.0-MariaDB"));
        assert!(mariadb_with_returning("11.4.2-MariaDB-log"));
        assert!(mariadb_with_returning("5.5.5-10.6.12-MariaDB"));
        assert!(!mariadb_with_returning("10.4.30-MariaDB"));
        assert!(!mariadb_with_returning("8.0.36"));
        assert!(!mariadb_with_returning("8.4.0-commercial"));
    }
}
