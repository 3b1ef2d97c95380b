//! SQLite ≥ 3.35 (RETURNING): statements on `julianday('now')`, which is fixed for the statement.
//! Times are stored as integer milliseconds since the Unix epoch. Also the pool set-up (WAL,
//! FULL sync, busy timeout) and the result codes that decide retries.
//!
//! SQLite has no server: "the database clock" is the clock of the process running the
//! statement, so every process sharing one SQLite file must share one machine clock.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::query::Query;
use sqlx::sqlite::{
    Sqlite, SqliteArguments, SqliteConnectOptions, SqliteConnection, SqliteJournalMode,
    SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, Connection, Row, SqlSafeStr, SqlStr};

use super::admin::AdminSql;

mod batch;
mod lock;
mod migrate;
mod queue;

pub(crate) use batch::{one_command, write as write_batch, write_whole};
pub(crate) mod read;
use super::migrations::RENEWED;
use super::{quote_ident, Acquire, Attempt, Dialect, QueueSql};
use crate::backend::kind_sql::KindSqls;
use crate::backend::Conns;
use crate::connect::ConnectOptions;
use crate::error::LockError;
use crate::retry::Failure;

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
const NOW: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)";

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

#[derive(Debug)]
struct Statements {
    schema: super::migrations::Schema,
    /// A read that fails unless the columns of the schema's `columns` of the same place are
    /// there.
    has_columns: [SqlStr; 4],
    queue_steps: QueueSql<SqlStr>,
    done: SqlStr,
    clock_check: SqlStr,
    acquire: SqlStr,
    release: SqlStr,
    extend: SqlStr,
    admin: AdminSql,
}

/// The acquire statement's "a live hold of ours in the tenure this process holds ({tenure}), or
/// one written by this very attempt"; never NULL.
const SAME: &str = "coalesce(l.owner = excluded.owner AND l.expires_at > {now}
                   AND (l.attempt_id = excluded.attempt_id OR l.fencing_token = {tenure}), 0)";

/// The `ON CONFLICT` part of the acquire statements (one key, several keys): `{tenure}` and
/// `{held}` are what the process holds of the key.
const TAKE_OVER: &str = "ON CONFLICT (lock_key) DO UPDATE SET
    hold_count    = CASE WHEN {same}
                         THEN CASE WHEN l.attempt_id = excluded.attempt_id
                                   THEN l.hold_count ELSE {held} + 1 END
                         ELSE 1 END,
    fencing_token = CASE WHEN {same} THEN l.fencing_token ELSE l.fencing_token + 1 END,
    acquired_at   = CASE WHEN {same} THEN l.acquired_at ELSE excluded.acquired_at END,
    holder        = CASE WHEN {same} THEN l.holder ELSE excluded.holder END,
    expires_at    = CASE WHEN {same} AND l.expires_at > excluded.expires_at
                         THEN l.expires_at ELSE excluded.expires_at END,
    available_at  = CASE WHEN {same} THEN l.available_at ELSE excluded.available_at END,
    last_outcome  = CASE WHEN NOT {same} AND {ran_out_l} THEN 2 ELSE l.last_outcome END,
    finished_at   = CASE WHEN NOT {same} AND {ran_out_l} THEN l.expires_at ELSE l.finished_at END,
    once_key      = l.once_key OR excluded.once_key,
    attempt_id    = excluded.attempt_id,
    owner         = excluded.owner
WHERE (l.expires_at <= {now} OR l.owner = excluded.owner)
  AND NOT ({once} AND l.last_outcome IS 1 AND NOT {ran_out_l})";

fn sql(template: &str, table: &str) -> SqlStr {
    let text = template
        .replace("{info}", INFO_COLUMNS)
        .replace("{same}", SAME)
        .replace("{ran_out_l}", &ran_out("l."))
        .replace("{ran_out}", &ran_out(""))
        .replace("{now}", NOW)
        .replace("{renewed}", RENEWED)
        .replace("{table}", table);
    AssertSqlSafe(Arc::<str>::from(text)).into_sql_str()
}

/// The columns of `LockRow`, in its order and types.
const INFO_COLUMNS: &str = "lock_key, owner, holder, hold_count, fencing_token,
       expires_at * 1000, acquired_at * 1000,
       (owner IS NOT NULL AND expires_at > {now}),
       max(0, expires_at - {now}),
       CASE WHEN {ran_out} THEN 2 ELSE last_outcome END,
       CASE WHEN {ran_out} THEN expires_at ELSE finished_at END * 1000,
       coalesce(intent_until > {now} AND intent_token = fencing_token, 0),
       CASE WHEN renewals_token = fencing_token THEN renewals ELSE 0 END";

/// Microseconds to whole milliseconds, rounding up so a lease is never shorter than asked.
fn ms_ceil(us: i64) -> i64 {
    (us + 999) / 1000
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
    pub(crate) fn new(pool: Conns<Sqlite>, table: &str) -> Self {
        let t = quote_ident(table, '"');
        let q = quote_ident(&super::queue_table(table), '"');
        let statements = Statements {
            schema: super::migrations::Schema::new(&super::migrations::SQLITE, '"', sql, &t, &q),
            has_columns: ["available_at", "release_token", "intent_owner", "renewals_token"]
                .map(|column| sql(&format!("SELECT {column} FROM {{table}} LIMIT 0"), &t)),
            // The fair waiters' queue: each statement runs under SQLite's one write lock (or
            // reads one snapshot). The queue orders attempts only: exclusion stays the
            // acquire's alone. A leave also clears every ticket whose lease ran out. Leases come
            // in µs ($3 of a join, $4 of a touch), rounded up to the table's milliseconds.
            queue_steps: QueueSql {
                join: sql(
                "INSERT INTO {table} (lock_key, owner, expires_at)
VALUES ($1, $2, {now} + ($3 + 999) / 1000)",
                    &q,
                ),
                ahead: sql(
                "SELECT COUNT(*) FROM (SELECT 1 FROM {table}
WHERE ticket < $2 AND lock_key = $1 AND expires_at > {now} LIMIT 8)",
                    &q,
                ),
                touch: sql(
                "UPDATE {table} SET expires_at = {now} + ($4 + 999) / 1000
WHERE ticket = $3 AND lock_key = $1 AND owner = $2",
                    &q,
                ),
                leave: sql(
                "DELETE FROM {table}
WHERE ticket = $3 AND lock_key = $1 AND owner = $2 OR expires_at <= {now}",
                    &q,
                ),
            },
            // After a busy `once` attempt (SQLite returns no row then): was it done?
            done: sql(
                "SELECT last_outcome IS 1 AND NOT {ran_out},
       finished_at * 1000 FROM {table} WHERE lock_key = $1",
                &t,
            ),
            clock_check: sql("SELECT max(acquired_at) - {now} FROM {table}", &t),
            // One INSERT ... ON CONFLICT DO UPDATE ... WHERE: SQLite runs every write under the
            // database's single write lock, so the conflict check, the WHERE ("may I take it")
            // and the update are one indivisible step. SET reads the old row throughout. When the
            // WHERE refuses (busy) nothing is written and RETURNING yields no row.
            // "Free" is `expires_at <= now`: a release leaves expires_at at `available_at` (the
            // acquisition + min_hold, $8 ms) when that is later, and the lease is at least
            // min_hold long. `once` ($9): a key whose last hold succeeded is not taken.
            // A hold taken over after it ran out is recorded as failed.
            // {same}: a live hold of ours in the tenure this process holds ($6, with $7 holds)
            // or written by this very attempt ($5, whose earlier send succeeded but whose reply
            // was lost: returned as it is). Re-entry counts from the process's holds, so a live
            // row of ours the process does not track is taken over as a new tenure.
            acquire: sql(
                &"INSERT INTO {table} AS l
    (lock_key, owner, hold_count, fencing_token, expires_at, acquired_at, holder, attempt_id,
     available_at, once_key)
VALUES ($1, $2, 1, {now} * 1000, {now} + max($3, $8), {now}, $4, $5,
        CASE WHEN $8 > 0 THEN {now} + $8 END, $9)
{take_over}
RETURNING hold_count, fencing_token, expires_at * 1000"
                    .replace("{take_over}", TAKE_OVER)
                    .replace("{same}", SAME)
                    .replace("{tenure}", "$6")
                    .replace("{held}", "$7")
                    .replace("{once}", "$9"),
                &t,
            ),
            // Single-row UPDATE under the write lock; SET reads the old row. $5 = the count the
            // process has left (absolute: a stray resend cannot count down twice); the last
            // release of a tenure records its outcome ($6; NULL: given back unused, nothing
            // recorded) and when.
            release: sql(
                "UPDATE {table} SET
    hold_count   = $5,
    owner        = CASE WHEN $5 > 0 THEN owner END,
    expires_at   = CASE WHEN $5 > 0 THEN expires_at ELSE max({now}, coalesce(available_at, 0)) END,
    last_outcome = CASE WHEN $5 > 0 THEN last_outcome
                        WHEN success_token IS fencing_token THEN 1
                        ELSE coalesce($6, last_outcome) END,
    finished_at  = CASE WHEN $5 > 0 OR $6 IS NULL THEN finished_at ELSE {now} END,
    attempt_id   = $4,
    release_id   = $4,
    release_token = fencing_token
WHERE lock_key = $1 AND owner = $2 AND fencing_token = $3 AND attempt_id IS NOT $4
  AND expires_at > {now}
RETURNING hold_count",
                &t,
            ),
            extend: sql(
                "UPDATE {table} SET expires_at = max(expires_at, min({now} + ($4 + 999) / 1000, acquired_at + $5 / 1000)),
    {renewed}
WHERE lock_key = $1 AND owner = $2 AND fencing_token = $3 AND expires_at > {now}
RETURNING expires_at * 1000",
                &t,
            ),
            admin: AdminSql {
                last_write: sql(
                    "SELECT attempt_id, fencing_token, release_id, release_token FROM {table}
WHERE lock_key = $1",
                    &t,
                ),
                inspect: sql("SELECT {info} FROM {table} WHERE lock_key = $1", &t),
                held: sql(
                    "SELECT {info} FROM {table}
WHERE owner IS NOT NULL AND expires_at > {now} ORDER BY lock_key",
                    &t,
                ),
                rows_in: sql(
                    "SELECT {info} FROM {table}
WHERE lock_key >= $1 AND lock_key < $2
  AND (owner IS NOT NULL AND expires_at > {now} OR acquired_at > {now} - $3 / 1000)
ORDER BY lock_key",
                    &t,
                ),
                force_release: sql(
                    "UPDATE {table} SET owner = NULL, hold_count = 0, expires_at = {now},
    last_outcome = CASE WHEN success_token IS fencing_token THEN 1 ELSE 2 END,
    finished_at = {now}
WHERE lock_key = $1 AND owner IS NOT NULL AND expires_at > {now}",
                    &t,
                ),
                reset: sql(
                    "UPDATE {table} SET last_outcome = NULL, finished_at = NULL,
    success_token = NULL, once_key = 0, expires_at = min(expires_at, {now})
WHERE lock_key = $1 AND NOT (owner IS NOT NULL AND expires_at > {now})",
                    &t,
                ),
                // $1 is in µs; times here are in ms. A `once` key whose last hold succeeded is
                // kept (`reset` forgets it on purpose).
                purge: sql(
                    "DELETE FROM {table} WHERE expires_at <= {now} - $1 / 1000
  AND NOT (once_key AND last_outcome IS 1 AND NOT {ran_out})",
                    &t,
                ),
            },
        };
        Lite {
            release_pool: pool.clone(),
            lazy_release: false,
            pool,
            kind_sql: KindSqls::new(&t),
            batch_sql: Arc::new(batch::Sql::new(&t)),
            turn: Arc::default(),
            table: t.into(),
            sql: Arc::new(statements),
        }
    }
}

/// `q` with an acquire's values, in the order of the acquire statements' `$1`-`$9` (one key)
/// and of each row of the coalesced statement's list (`sqlite/batch.rs`).
fn bind_acquire<'q>(
    q: Query<'q, Sqlite, SqliteArguments>,
    p: &Acquire<'_>,
) -> Query<'q, Sqlite, SqliteArguments> {
    q.bind(p.key)
        .bind(p.owner)
        .bind(ms_ceil(p.ttl_us))
        .bind(p.holder)
        .bind(p.attempt)
        .bind(p.tenure)
        .bind(i64::from(p.held))
        .bind(ms_ceil(p.min_hold_us))
        .bind(p.once)
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

super::admin::shared_admin!(OnSqlite, sqlite, Lite, sqlx::Sqlite, sql.admin);
