//! The operator's reads beyond the rows (`Locker::migration_status`, `Locker::waiters` in
//! `operator.rs`): which migrations a table has, probed by reading none of the rows of the
//! tables and columns each creates, and the fair queue's live tickets. Statements without
//! parameters, so the same text runs behind a transaction pooler.

use sqlx::{AssertSqlSafe, Database, Executor};

use super::{permits_table, queue_table, quote_ident, Columns, Statement};

/// A migration and what proves it applied: for each table it touches (see [`Tables`]), columns
/// it creates. A probe `SELECT <columns> FROM <table> WHERE 1 = 0` answers "no such table /
/// column" exactly when they are missing, on every backend.
pub(crate) struct Migration {
    pub(crate) version: u32,
    pub(crate) name: &'static str,
    probes: &'static [(Tables, &'static str)],
}

/// Every migration, in order (the files of `migrations/<backend>/`).
pub(crate) const MIGRATIONS: [Migration; 7] = [
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
    Migration {
        version: 7,
        name: "renewals",
        probes: &[
            (Tables::Locks, RENEWAL_COLUMNS),
            (Tables::Permits, RENEWAL_COLUMNS),
        ],
    },
];

const LOCK_COLUMNS: &str =
    "lock_key, owner, hold_count, fencing_token, expires_at, acquired_at, holder, attempt_id";
const OUTCOME_COLUMNS: &str = "last_outcome, finished_at, available_at";
const EXACTLY_ONCE_COLUMNS: &str = "success_token, once_key, release_id, release_token";
const QUEUE_COLUMNS: &str = "lock_key, ticket, owner, expires_at";
const SHARED_COLUMNS: &str = "readers, intent_until, intent_token, intent_owner";
const RENEWAL_COLUMNS: &str = "renewals, renewals_token";

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

/// Each migration's probes on the lock table it names (validated): whether each is applied.
pub(crate) struct Probes<'a>(pub(crate) &'a str);

impl Probes<'_> {
    /// Runs the probes on `conn`; `missing` tells a "no such table / column" error.
    pub(crate) async fn run<DB>(
        &self,
        conn: &mut DB::Connection,
        quote: char,
        missing: fn(&dyn sqlx::error::DatabaseError) -> bool,
    ) -> sqlx::Result<Vec<bool>>
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
                    table.quoted(self.0, quote)
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
}

/// The live tickets of the queue of the lock table it names (validated), by key and ticket.
pub(crate) struct Queue<'a>(pub(crate) &'a str);

/// One live ticket of the queue, as the read returns it.
pub(crate) struct QueueRow {
    pub(crate) key: String,
    pub(crate) ticket: i64,
    pub(crate) owner: String,
    /// Lease end, µs since the epoch (database clock).
    pub(crate) expires_at_us: i64,
    /// Lease left, ms, measured by the database.
    pub(crate) left_ms: i64,
}

/// Reads a [`QueueRow`] from the queue read's columns: key, ticket, owner, lease end (µs since
/// the epoch), lease left (ms), as every backend's text returns them.
fn waiter(r: &impl Columns) -> sqlx::Result<QueueRow> {
    Ok(QueueRow {
        key: r.text(0)?,
        ticket: r.int(1)?,
        owner: r.text(2)?,
        expires_at_us: r.int(3)?,
        left_ms: r.int(4)?,
    })
}

impl Statement for Queue<'_> {
    type Output = Vec<QueueRow>;
}

impl Queue<'_> {
    /// Runs a backend's queue read `text` (the queue's name, quoted with `quote`, for
    /// `{table}`) on `conn`.
    pub(crate) async fn run<DB>(
        &self,
        conn: &mut DB::Connection,
        text: &str,
        quote: char,
    ) -> sqlx::Result<Vec<QueueRow>>
    where
        DB: Database,
        for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
        DB::Row: Columns,
    {
        let sql = text.replace("{table}", &Tables::Queue.quoted(self.0, quote));
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
