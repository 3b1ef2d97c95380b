//! What an operator asks about a lock table beyond its rows (`Locker::inspect`, `held`): which of
//! the schema's migrations its database has ([`Locker::migration_status`]), and who waits in the
//! fair queue of its keys ([`Locker::waiters`]). The `dblock` command-line tool (crate
//! `dblock-cli`) is built on these.
//!
//! Both are reads sent as plain simple-protocol statements without parameters (one round trip
//! each, nothing prepared), so they work the same through a transaction pooler (PgBouncer in
//! transaction mode) as against the server.

use std::time::{Duration, SystemTime};

use sqlx::{AssertSqlSafe, ColumnIndex, Database, Decode, Executor, Row, Type};

use crate::backend::{permits_table, queue_table, quote_ident, Statement};
use crate::error::LockError;
use crate::info::{millis, time_from_micros};
use crate::locker::Locker;

/// One migration of the lock table's schema (the files `migrations/<backend>/NNNN_name.sql` of
/// the dblock package, which [`Locker::migrate`] applies in order), and whether the database has
/// it.
///
/// ```
/// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
/// for m in locker.migration_status().await? {
///     println!("{:04} {:<14} {}", m.version, m.name, if m.applied { "applied" } else { "pending" });
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationStatus {
    /// The migration's number: 1 for `0001_dblock_locks.sql`.
    pub version: u32,
    /// Its file's name without number and extension: `"dblock_locks"`, `"outcomes"`,
    /// `"exactly_once"`, `"fair_queue"`, `"permits"`, `"shared"`.
    pub name: &'static str,
    /// Whether the tables and columns it creates are there.
    pub applied: bool,
}

/// A caller waiting in arrival order for a key ([`LockRequest::fair`](crate::LockRequest::fair)):
/// its ticket in the key's queue (the lock table's `<table>_queue`). The ticket is a short lease
/// the waiter renews while it waits, so a waiter that died leaves the queue by itself.
///
/// ```
/// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
/// for w in locker.waiters("report:").await? {
///     println!("{} ticket {} owner {} (ticket lease {:?} left)", w.key, w.ticket, w.owner, w.time_left);
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Waiter {
    /// The key waited for.
    pub key: String,
    /// Its place in the key's queue: smaller tickets go first.
    pub ticket: u64,
    /// The waiting owner's id.
    pub owner: String,
    /// When the ticket's lease ends unless the waiter renews it. Database clock.
    pub expires_at: SystemTime,
    /// What is left of the ticket's lease, measured by the database.
    pub time_left: Duration,
}

/// A migration and what proves it applied: for each table it touches (see [`Tables`]), columns
/// it creates. A probe `SELECT <columns> FROM <table> WHERE 1 = 0` answers "no such table /
/// column" exactly when they are missing, on every backend.
struct Migration {
    version: u32,
    name: &'static str,
    probes: &'static [(Tables, &'static str)],
}

/// Every migration, in order (the files of `migrations/<backend>/`).
const MIGRATIONS: [Migration; 6] = [
    Migration {
        version: 1,
        name: "dblock_locks",
        probes: &[(Tables::Locks, LOCK_COLUMNS)],
    },
    Migration {
        version: 2,
        name: "outcomes",
        probes: &[(Tables::Locks, OUTCOME_COLUMNS)],
    },
    Migration {
        version: 3,
        name: "exactly_once",
        probes: &[(Tables::Locks, EXACTLY_ONCE_COLUMNS)],
    },
    Migration {
        version: 4,
        name: "fair_queue",
        probes: &[(Tables::Queue, QUEUE_COLUMNS)],
    },
    Migration {
        version: 5,
        name: "permits",
        probes: &[
            (Tables::Permits, LOCK_COLUMNS),
            (Tables::Permits, OUTCOME_COLUMNS),
            (Tables::Permits, EXACTLY_ONCE_COLUMNS),
            (Tables::PermitsQueue, QUEUE_COLUMNS),
        ],
    },
    Migration {
        version: 6,
        name: "shared",
        probes: &[
            (Tables::Locks, SHARED_COLUMNS),
            (Tables::Permits, SHARED_COLUMNS),
        ],
    },
];

const LOCK_COLUMNS: &str =
    "lock_key, owner, hold_count, fencing_token, expires_at, acquired_at, holder, attempt_id";
const OUTCOME_COLUMNS: &str = "last_outcome, finished_at, available_at";
const EXACTLY_ONCE_COLUMNS: &str = "success_token, once_key, release_id, release_token";
const QUEUE_COLUMNS: &str = "lock_key, ticket, owner, expires_at";
const SHARED_COLUMNS: &str = "readers, intent_until, intent_token, intent_owner";

/// The tables of one lock table's schema.
#[derive(Clone, Copy)]
enum Tables {
    /// The lock table itself.
    Locks,
    /// Its fair waiters' queue (0004).
    Queue,
    /// The semaphores' permits (0005), a lock table of its own.
    Permits,
    /// The permits table's queue (0005).
    PermitsQueue,
}

impl Tables {
    /// The table's name, quoted with `quote`, for lock table `table` (validated).
    fn quoted(self, table: &str, quote: char) -> String {
        let name = match self {
            Tables::Locks => table.to_owned(),
            Tables::Queue => queue_table(table),
            Tables::Permits => permits_table(table),
            Tables::PermitsQueue => queue_table(&permits_table(table)),
        };
        quote_ident(&name, quote)
    }
}

impl Locker {
    /// Which migrations of the lock table's schema (`migrations/<backend>/`, 0001 to 0006) this
    /// locker's table has, oldest first: each probed by reading none of the rows of the
    /// tables and columns it creates. Read-only; a table that is not there is no error (its
    /// migrations are pending). [`migrate`](Locker::migrate) applies the pending ones.
    ///
    #[cfg_attr(feature = "sqlite", doc = "```")]
    #[cfg_attr(not(feature = "sqlite"), doc = "```no_run")]
    /// # async fn demo() -> Result<(), dblock::LockError> {
    /// let locker = dblock::Locker::connect("sqlite::memory:").await?;
    /// assert!(locker.migration_status().await?.iter().all(|m| !m.applied));
    /// locker.migrate().await?;
    /// let status = locker.migration_status().await?;
    /// assert_eq!(status.len(), 6);
    /// assert!(status.iter().all(|m| m.applied));
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub async fn migration_status(&self) -> Result<Vec<MigrationStatus>, LockError> {
        LockError::require_runtime()?;
        let shared = self.shared();
        shared.check_open()?;
        let backend = shared.backend()?;
        let probes = Probes {
            table: self.table_name(),
        };
        let applied = shared
            .once("migration status", |limit| backend.run(&probes, limit))
            .await?;
        Ok(MIGRATIONS
            .iter()
            .zip(applied)
            .map(|(m, applied)| MigrationStatus {
                version: m.version,
                name: m.name,
                applied,
            })
            .collect())
    }

    /// The fair waiters ([`LockRequest::fair`](crate::LockRequest::fair)) of the keys that
    /// start with `prefix` (`""`: every key) whose tickets are live, ordered by key, then in
    /// the order they will be served. Callers waiting without `fair` poll and are not
    /// recorded anywhere. Read-only.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let queued = locker.waiters("payout:").await?;
    /// if let Some(next) = queued.first() {
    ///     println!("{} is next for {}", next.owner, next.key);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn waiters(&self, prefix: &str) -> Result<Vec<Waiter>, LockError> {
        LockError::require_runtime()?;
        let shared = self.shared();
        shared.check_open()?;
        let backend = shared.backend()?;
        let read = Queue {
            table: self.table_name(),
        };
        let mut waiters = shared
            .once("waiters", |limit| backend.run(&read, limit))
            .await?;
        // The queue holds live waiters only: reading it whole and keeping the prefix here
        // needs no parameter (nothing to inline behind a pooler).
        waiters.retain(|w| w.key.starts_with(prefix));
        Ok(waiters)
    }
}

/// Each migration's probes on lock table `table` (validated): whether each is applied.
struct Probes<'a> {
    table: &'a str,
}

impl Probes<'_> {
    /// Runs the probes on `conn`; `missing` tells a "no such table / column" error.
    async fn run<DB>(
        &self,
        conn: &mut DB::Connection,
        quote: char,
        missing: fn(&dyn sqlx::error::DatabaseError) -> bool,
    ) -> Result<Vec<bool>, sqlx::Error>
    where
        DB: Database,
        for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    {
        let mut applied = Vec::with_capacity(MIGRATIONS.len());
        for m in &MIGRATIONS {
            let mut all = true;
            for (table, columns) in m.probes {
                let sql = format!(
                    "SELECT {columns} FROM {} WHERE 1 = 0",
                    table.quoted(self.table, quote)
                );
                match sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut *conn).await {
                    Ok(_) => {}
                    Err(sqlx::Error::Database(e)) if missing(e.as_ref()) => {
                        all = false;
                        break;
                    }
                    Err(e) => return Err(e),
                }
            }
            applied.push(all);
        }
        Ok(applied)
    }
}

impl Statement for Probes<'_> {
    type Output = Vec<bool>;

    #[cfg(feature = "postgres")]
    async fn postgres(
        &self,
        _: &crate::backend::postgres::Pg,
        conn: &mut sqlx::PgConnection,
    ) -> Result<Vec<bool>, sqlx::Error> {
        // undefined_table, undefined_column, invalid_schema_name.
        self.run::<sqlx::Postgres>(conn, '"', |e| {
            matches!(e.code().as_deref(), Some("42P01" | "42703" | "3F000"))
        })
        .await
    }

    #[cfg(feature = "mysql")]
    async fn mysql(
        &self,
        _: &crate::backend::mysql::My,
        conn: &mut sqlx::MySqlConnection,
    ) -> Result<Vec<bool>, sqlx::Error> {
        // ER_NO_SUCH_TABLE (SQLSTATE 42S02), ER_BAD_FIELD_ERROR (42S22).
        self.run::<sqlx::MySql>(conn, '`', |e| {
            matches!(e.code().as_deref(), Some("42S02" | "42S22"))
        })
        .await
    }

    #[cfg(feature = "sqlite")]
    async fn sqlite(
        &self,
        _: &crate::backend::sqlite::Lite,
        conn: &mut sqlx::SqliteConnection,
    ) -> Result<Vec<bool>, sqlx::Error> {
        // A plain SQLITE_ERROR, told by its message.
        self.run::<sqlx::Sqlite>(conn, '"', |e| {
            e.message().starts_with("no such table") || e.message().starts_with("no such column")
        })
        .await
    }
}

/// The live tickets of the queue of lock table `table` (validated), by key and ticket.
struct Queue<'a> {
    table: &'a str,
}

/// Reads a [`Waiter`] from the queue read's columns: key, ticket, owner, lease end (µs since
/// the epoch), lease left (ms), as every backend's text returns them.
fn waiter<'r, R>(r: &'r R) -> Result<Waiter, sqlx::Error>
where
    R: Row,
    usize: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(Waiter {
        key: r.try_get(0)?,
        ticket: u64::try_from(r.try_get::<i64, _>(1)?).unwrap_or(0),
        owner: r.try_get(2)?,
        expires_at: time_from_micros(r.try_get(3)?),
        time_left: millis(r.try_get(4)?),
    })
}

impl Statement for Queue<'_> {
    type Output = Vec<Waiter>;

    #[cfg(feature = "postgres")]
    async fn postgres(
        &self,
        _: &crate::backend::postgres::Pg,
        conn: &mut sqlx::PgConnection,
    ) -> Result<Vec<Waiter>, sqlx::Error> {
        let sql = format!(
            "SELECT lock_key, ticket, owner, (extract(epoch FROM expires_at) * 1000000)::int8,
                    greatest(0, ceil(extract(epoch FROM expires_at - statement_timestamp()) * 1000))::int8
             FROM {} WHERE expires_at > statement_timestamp() ORDER BY lock_key, ticket",
            Tables::Queue.quoted(self.table, '"')
        );
        let rows = sqlx::raw_sql(AssertSqlSafe(sql)).fetch_all(conn).await?;
        rows.iter().map(waiter).collect()
    }

    #[cfg(feature = "mysql")]
    async fn mysql(
        &self,
        _: &crate::backend::mysql::My,
        conn: &mut sqlx::MySqlConnection,
    ) -> Result<Vec<Waiter>, sqlx::Error> {
        // Keys are binary; dblock only writes keys that came from a Rust `&str` (valid UTF-8).
        let sql = format!(
            "SELECT CONVERT(lock_key USING utf8mb4), ticket, owner,
                    TIMESTAMPDIFF(MICROSECOND, '1970-01-01', expires_at),
                    GREATEST(0, (TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) + 999) DIV 1000)
             FROM {} WHERE expires_at > UTC_TIMESTAMP(6) ORDER BY lock_key, ticket",
            Tables::Queue.quoted(self.table, '`')
        );
        let rows = sqlx::raw_sql(AssertSqlSafe(sql)).fetch_all(conn).await?;
        rows.iter().map(waiter).collect()
    }

    #[cfg(feature = "sqlite")]
    async fn sqlite(
        &self,
        _: &crate::backend::sqlite::Lite,
        conn: &mut sqlx::SqliteConnection,
    ) -> Result<Vec<Waiter>, sqlx::Error> {
        // Times are whole milliseconds since the epoch (the clock of the process).
        const NOW: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)";
        let sql = format!(
            "SELECT lock_key, ticket, owner, expires_at * 1000, max(0, expires_at - {NOW})
             FROM {} WHERE expires_at > {NOW} ORDER BY lock_key, ticket",
            Tables::Queue.quoted(self.table, '"')
        );
        let rows = sqlx::raw_sql(AssertSqlSafe(sql)).fetch_all(conn).await?;
        rows.iter().map(waiter).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::MIGRATIONS;

    /// The migrations probed are the migration files, in their order and by their names.
    #[test]
    fn the_probes_follow_the_migration_files() {
        let names: Vec<&str> = MIGRATIONS.iter().map(|m| m.name).collect();
        assert_eq!(names, crate::backend::migrations::NAMES);
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.version as usize, i + 1);
        }
    }
}
