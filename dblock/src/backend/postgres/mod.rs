//! PostgreSQL: statements on `statement_timestamp()`, the one clock that is fixed for the statement
//! and not frozen for a caller's whole transaction (as `now()` is). Also the pool set-up, the
//! SQLSTATE codes that decide retries, and the LISTEN connection (`notify.rs`).

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions, Postgres};
use sqlx::{AssertSqlSafe, Connection, Pool, Row, SqlSafeStr, SqlStr};

use super::admin::AdminSql;
use super::{
    quote_ident, Acquire, Attempt, Dialect, Extended, Grant, HoldRef, Outcome, Released, RenewItem,
};
use crate::connect::ConnectOptions;
use crate::error::LockError;
use crate::retry::Failure;

pub(crate) mod notify;

/// SQLSTATE codes (PostgreSQL manual, appendix A) that decide how a failed statement is retried.
mod sqlstate {
    /// Rolled back: the transaction could not be serialised.
    pub(super) const SERIALIZATION_FAILURE: &str = "40001";
    /// Rolled back: chosen as a deadlock victim.
    pub(super) const DEADLOCK_DETECTED: &str = "40P01";
    /// Rolled back: cancelled (statement_timeout, pg_cancel_backend).
    pub(super) const QUERY_CANCELED: &str = "57014";
    /// Class 08, connection exception: the outcome is unknown.
    pub(super) const CONNECTION_EXCEPTION: &str = "08";
    /// 57P01-57P05: administrator or crash shutdown, cannot connect now, idle session timeout.
    pub(super) const OPERATOR_SHUTDOWN: &str = "57P";
}

/// How long `Locker::connect`'s pool waits for a connection before failing.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);
/// Server-side TCP keepalives (s): a vanished client's connection is dropped within ~25 s.
const KEEPALIVE_IDLE: &str = "10";
const KEEPALIVE_INTERVAL: &str = "5";
const KEEPALIVE_COUNT: &str = "3";

/// Lease end as microseconds since the epoch.
const US: &str = "(extract(epoch FROM {c}) * 1000000)::int8";

pub(crate) const DDL: &str = r#"CREATE TABLE IF NOT EXISTS {table} (
    lock_key      TEXT COLLATE "C" NOT NULL PRIMARY KEY
                  CHECK (octet_length(lock_key) BETWEEN 1 AND 255),
    owner         TEXT,
    hold_count    INTEGER     NOT NULL DEFAULT 0 CHECK (hold_count >= 0),
    fencing_token BIGINT      NOT NULL,
    expires_at    TIMESTAMPTZ NOT NULL,
    acquired_at   TIMESTAMPTZ NOT NULL,
    holder        TEXT,
    attempt_id    BIGINT,
    contended     BOOLEAN     NOT NULL DEFAULT false
) WITH (fillfactor = 80);
"#;

/// Migration 0002: how each hold ended, and min_hold.
pub(crate) const OUTCOMES: &str = "ALTER TABLE {table}
    ADD COLUMN IF NOT EXISTS last_outcome SMALLINT,
    ADD COLUMN IF NOT EXISTS finished_at  TIMESTAMPTZ,
    ADD COLUMN IF NOT EXISTS available_at TIMESTAMPTZ;
";

#[derive(Clone, Debug)]
pub(crate) struct Pg {
    pool: PgPool,
    /// NOTIFY channel for releases of this table (see [`notify_channel`]).
    channel: Arc<str>,
    sql: Arc<Statements>,
    /// The LISTEN connection that wakes this locker's waiters; `None` when turned off.
    notifier: Option<Arc<notify::Notifier>>,
}

#[derive(Debug)]
struct Statements {
    /// The quoted table name, for `to_regclass`.
    table: String,
    ddl: SqlStr,
    outcomes: SqlStr,
    acquire: SqlStr,
    release: SqlStr,
    extend: SqlStr,
    extend_many: SqlStr,
    admin: AdminSql,
}

/// The acquire statement's "a live hold of ours in the tenure this process holds ($7), or one
/// written by this very attempt ($5)"; never NULL.
const SAME: &str = "coalesce(l.owner = $2 AND l.expires_at > statement_timestamp()
                   AND (l.attempt_id = $5 OR l.fencing_token = $7), false)";

fn sql(template: &str, table: &str) -> SqlStr {
    let text = template
        .replace("{same}", SAME)
        .replace("{us_expires}", &US.replace("{c}", "expires_at"))
        .replace("{us_acquired}", &US.replace("{c}", "acquired_at"))
        .replace("{us_finished}", &US.replace("{c}", "finished_at"))
        .replace("{table}", table);
    AssertSqlSafe(Arc::<str>::from(text)).into_sql_str()
}

/// The columns of `LockRow`, in its order and types.
const INFO_COLUMNS: &str =
    "lock_key, owner, holder, hold_count::int8, fencing_token, {us_expires}, {us_acquired},
       (owner IS NOT NULL AND expires_at > statement_timestamp()) AS held,
       greatest(0, ceil(extract(epoch FROM expires_at - statement_timestamp()) * 1000))::int8,
       last_outcome::int8, {us_finished}";

/// A pool configured for locking: autocommit connections at READ COMMITTED, statement and lock
/// time-outs and server keepalives (all set at start-up, no extra round trip), no ping before
/// each statement, a bounded wait for a connection.
pub(crate) async fn connect(
    url: &str,
    table: &str,
    opts: &ConnectOptions,
) -> Result<Pg, LockError> {
    let statement_ms = opts.statement_timeout.as_millis().to_string();
    let options = PgConnectOptions::from_str(url)
        .map_err(|e| super::bad_url(url, e))?
        .options([
            ("default_transaction_isolation", "read committed"),
            ("statement_timeout", statement_ms.as_str()),
            ("lock_timeout", statement_ms.as_str()),
            ("tcp_keepalives_idle", KEEPALIVE_IDLE),
            ("tcp_keepalives_interval", KEEPALIVE_INTERVAL),
            ("tcp_keepalives_count", KEEPALIVE_COUNT),
        ]);
    let pool = PgPoolOptions::new()
        .max_connections(opts.max_connections.unwrap_or(10))
        .test_before_acquire(false)
        .acquire_timeout(opts.acquire_timeout.unwrap_or(ACQUIRE_TIMEOUT))
        .connect_with(options)
        .await?;
    Ok(Pg::new(pool, table).listening(opts.listen))
}

impl Pg {
    /// Locks in `table` through `pool`, with LISTEN/NOTIFY wake-ups.
    pub(crate) fn new(pool: PgPool, table: &str) -> Self {
        let t = quote_ident(table, '"');
        let statements = Statements {
            table: t.clone(),
            ddl: sql(DDL, &t),
            outcomes: sql(OUTCOMES, &t),

            // Acquire, re-entry and takeover in one statement, update-first:
            // - `upd` is a single-row UPDATE by primary key. Its WHERE is the "may I take it"
            //   test; under READ COMMITTED a concurrent writer makes it wait for the row and
            //   re-check the WHERE against the committed version, so two owners can never both
            //   pass. All CASE arms read the OLD row (PostgreSQL evaluates SET against it).
            // - `ins` creates the row only when the statement's snapshot has none. Two racing
            //   inserters meet on the primary key: ON CONFLICT DO NOTHING makes the loser see
            //   "busy" (no row) instead of an error, so nothing is inserted-then-caught.
            // - A busy attempt (row held by someone else) updates nothing and inserts nothing:
            //   no row lock kept, no WAL written, just the final SELECT of the holder's state.
            // - {same}: a live hold of ours in the tenure this process holds ($7, with $8 holds)
            //   or written by this very attempt ($5). `attempt_id = $5` means this attempt
            //   already succeeded (its reply was lost): the row is returned as it is. Re-entry
            //   counts from the process's holds ($8 + 1), never from the row alone: a live row of
            //   ours that the process does not track (an acquire whose reply never came) is
            //   taken over as a new tenure instead of being built upon.
            // - "Free" is `expires_at <= now`: a released row keeps the key unavailable until
            //   `available_at` (min_hold, $9 µs) by leaving expires_at there. The lease is at
            //   least min_hold long, so a crashed holder's key waits for min_hold too.
            // - `once` ($10): a key whose last hold succeeded (last_outcome 1) is not taken; the
            //   busy row then says so.
            acquire: sql(
                "WITH upd AS (
    UPDATE {table} AS l SET
        hold_count = CASE WHEN {same}
                          THEN CASE WHEN l.attempt_id = $5 THEN l.hold_count ELSE $8 + 1 END
                          ELSE 1 END,
        fencing_token = CASE WHEN {same} THEN l.fencing_token ELSE l.fencing_token + 1 END,
        acquired_at = CASE WHEN {same} THEN l.acquired_at ELSE statement_timestamp() END,
        holder = CASE WHEN {same} THEN l.holder ELSE $4 END,
        expires_at = greatest(CASE WHEN {same} THEN l.expires_at END,
                              statement_timestamp() + greatest($3, $9)::float8 * interval '1 microsecond'),
        available_at = CASE WHEN {same} THEN l.available_at
                            WHEN $9 > 0 THEN statement_timestamp() + $9::float8 * interval '1 microsecond' END,
        -- The hold being taken over ran out without a release: it ended in failure.
        last_outcome = CASE WHEN NOT {same} AND l.owner IS NOT NULL AND l.expires_at <= statement_timestamp()
                            THEN 2 ELSE l.last_outcome END,
        finished_at = CASE WHEN NOT {same} AND l.owner IS NOT NULL AND l.expires_at <= statement_timestamp()
                           THEN l.expires_at ELSE l.finished_at END,
        attempt_id = $5,
        contended = (l.contended AND {same}),
        owner = $2
    WHERE l.lock_key = $1
      AND (l.expires_at <= statement_timestamp() OR l.owner = $2)
      AND NOT ($10 AND l.last_outcome IS NOT DISTINCT FROM 1)
    RETURNING l.hold_count, l.fencing_token, l.expires_at, l.last_outcome, l.finished_at
), flag AS (
    -- A waiter ($6) whose LISTEN is in place asks the holder's release to NOTIFY. Written once
    -- per contention episode: when the flag is already set this updates nothing.
    UPDATE {table} SET contended = true
    WHERE $6 AND lock_key = $1 AND NOT contended AND NOT EXISTS (SELECT 1 FROM upd)
      AND owner IS NOT NULL AND owner <> $2 AND expires_at > statement_timestamp()
    RETURNING 1
), ins AS (
    INSERT INTO {table} (lock_key, owner, hold_count, fencing_token, expires_at, acquired_at,
                         holder, attempt_id, available_at)
    SELECT $1, $2, 1, (extract(epoch FROM statement_timestamp()) * 1000000)::int8,
           statement_timestamp() + greatest($3, $9)::float8 * interval '1 microsecond',
           statement_timestamp(), $4, $5,
           CASE WHEN $9 > 0 THEN statement_timestamp() + $9::float8 * interval '1 microsecond' END
    WHERE NOT EXISTS (SELECT 1 FROM {table} WHERE lock_key = $1)
    ON CONFLICT (lock_key) DO NOTHING
    RETURNING hold_count, fencing_token, expires_at, last_outcome, finished_at
), res AS (
    SELECT true AS acquired, hold_count, fencing_token, expires_at, last_outcome, finished_at FROM upd
    UNION ALL
    SELECT true, hold_count, fencing_token, expires_at, last_outcome, finished_at FROM ins
    UNION ALL
    SELECT false, hold_count, fencing_token, expires_at, last_outcome, finished_at FROM {table}
     WHERE lock_key = $1 AND NOT EXISTS (SELECT 1 FROM upd) AND NOT EXISTS (SELECT 1 FROM ins)
)
SELECT acquired, hold_count, fencing_token, {us_expires},
       greatest(0, ceil(extract(epoch FROM expires_at - statement_timestamp()) * 1000))::int8,
       NOT acquired AND $10 AND last_outcome IS NOT DISTINCT FROM 1,
       {us_finished}
FROM res",
                &t,
            ),

            // One single-row UPDATE by primary key: the WHERE (owner, tenure, live lease) and the
            // new count are applied to the same row version under its row lock, so a release
            // can neither race another release nor touch a lease that has run out. The count
            // left ($6) is the process's (its holds of this tenure, less this one): absolute,
            // so a stray resend cannot count down twice; the release id ($4) recognises one.
            // A full release of a key someone waits for (`contended`) also NOTIFYs the key on
            // the locker's channel ($5); NOTIFY is delivered at commit, i.e. once it is free.
            // The last release of a tenure records how it ended ($7) and when.
            release: sql(
                "WITH r AS (
    UPDATE {table} SET
        hold_count   = $6,
        owner        = CASE WHEN $6 > 0 THEN owner END,
        -- Free once released, or once min_hold has passed (available_at), whichever is later.
        expires_at   = CASE WHEN $6 > 0 THEN expires_at
                            ELSE greatest(statement_timestamp(), available_at) END,
        last_outcome = CASE WHEN $6 > 0 THEN last_outcome ELSE $7 END,
        finished_at  = CASE WHEN $6 > 0 THEN finished_at ELSE statement_timestamp() END,
        attempt_id   = $4
    WHERE lock_key = $1 AND owner = $2 AND fencing_token = $3 AND attempt_id IS DISTINCT FROM $4
      AND expires_at > statement_timestamp()
    RETURNING hold_count, contended, lock_key
)
SELECT hold_count, CASE WHEN hold_count = 0 AND contended THEN pg_notify($5, lock_key)::text END
FROM r",
                &t,
            ),


            // Single-row UPDATE, owner- and tenure-checked in its WHERE; never shortens a lease.
            extend: sql(
                "UPDATE {table}
SET expires_at = greatest(expires_at, statement_timestamp() + $4::float8 * interval '1 microsecond')
WHERE lock_key = $1 AND owner = $2 AND fencing_token = $3 AND expires_at > statement_timestamp()
RETURNING {us_expires}",
                &t,
            ),

            // Renewal of many leases: one UPDATE joined to the arrays of (key, owner, token, ttl).
            // Each row is updated under its row lock with the same owner/tenure/live check as
            // `extend`; RETURNING names exactly the holds that were extended.
            extend_many: sql(
                "UPDATE {table} AS l
SET expires_at = greatest(l.expires_at, statement_timestamp() + r.ttl_us * interval '1 microsecond')
FROM unnest($1::text[], $2::text[], $3::int8[], $4::float8[]) AS r(k, o, tok, ttl_us)
WHERE l.lock_key = r.k AND l.owner = r.o AND l.fencing_token = r.tok
  AND l.expires_at > statement_timestamp()
RETURNING l.lock_key, l.owner, l.fencing_token",
                &t,
            ),
            admin: AdminSql {
                last_write: sql(
                    "SELECT attempt_id, fencing_token FROM {table} WHERE lock_key = $1",
                    &t,
                ),
                inspect: sql(
                    &format!("SELECT {INFO_COLUMNS} FROM {{table}} WHERE lock_key = $1"),
                    &t,
                ),
                held: sql(
                    &format!(
                        "SELECT {INFO_COLUMNS} FROM {{table}}
WHERE owner IS NOT NULL AND expires_at > statement_timestamp() ORDER BY lock_key"
                    ),
                    &t,
                ),

                // Single-row UPDATE: frees a live lease whoever holds it; the token is kept so
                // the next owner still gets a larger one.
                force_release: sql(
                    "UPDATE {table} SET owner = NULL, hold_count = 0, expires_at = statement_timestamp(),
    last_outcome = 2, finished_at = statement_timestamp()
WHERE lock_key = $1 AND owner IS NOT NULL AND expires_at > statement_timestamp()",
                    &t,
                ),

                // A key not held: its outcome forgotten (a `once` key runs again), its min_hold
                // wait ended.
                reset: sql(
                    "UPDATE {table} SET last_outcome = NULL, finished_at = NULL,
    expires_at = least(expires_at, statement_timestamp())
WHERE lock_key = $1 AND NOT (owner IS NOT NULL AND expires_at > statement_timestamp())",
                    &t,
                ),

                // Deletes free rows (expires_at = when freed) and expired ones, older than $1 µs.
                // A held row has expires_at in the future, so it never matches.
                purge: sql(
                    "DELETE FROM {table}
WHERE expires_at <= statement_timestamp() - $1::int8 * interval '1 microsecond'",
                    &t,
                ),
            },
        };
        let channel: Arc<str> = notify_channel(table).into();
        Pg {
            notifier: Some(notify::Notifier::new(pool.clone(), channel.to_string())),
            pool,
            channel,
            sql: Arc::new(statements),
        }
    }

    /// With (`true`) or without LISTEN/NOTIFY wake-ups.
    pub(crate) fn listening(self, on: bool) -> Self {
        Pg {
            notifier: if on {
                self.notifier.or_else(|| {
                    Some(notify::Notifier::new(
                        self.pool.clone(),
                        self.channel.to_string(),
                    ))
                })
            } else {
                None
            },
            ..self
        }
    }

    /// Stops the LISTEN connection for good.
    pub(crate) fn stop_listening(&self) {
        if let Some(n) = &self.notifier {
            n.stop();
        }
    }

    /// Interest in a release of `key` (LISTEN set up on first use); `None` when LISTEN is off
    /// or failed.
    pub(crate) async fn interest(&self, key: &str) -> Option<notify::Interest> {
        self.notifier.as_ref()?.interest(key).await
    }
}

impl Dialect for Pg {
    const NAME: &'static str = "postgres";
    type Db = Postgres;

    fn with_table(&self, table: &str) -> Self {
        Pg::new(self.pool.clone(), table).listening(self.notifier.is_some())
    }

    fn classify(e: &dyn sqlx::error::DatabaseError) -> Failure {
        match e.code().as_deref() {
            Some(sqlstate::SERIALIZATION_FAILURE)
            | Some(sqlstate::DEADLOCK_DETECTED)
            | Some(sqlstate::QUERY_CANCELED) => Failure::NotCommitted,
            Some(c)
                if c.starts_with(sqlstate::CONNECTION_EXCEPTION)
                    || c.starts_with(sqlstate::OPERATOR_SHUTDOWN) =>
            {
                Failure::Unknown
            }
            _ => Failure::Fatal,
        }
    }

    fn pool(&self) -> &Pool<Postgres> {
        &self.pool
    }

    fn admin(&self) -> &AdminSql {
        &self.sql.admin
    }

    async fn migrate(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        // The usual case at every start: the table is there, with the newest migration's
        // columns. One read, no lock, and none of the "already exists, skipping" NOTICEs that
        // sqlx would log at INFO.
        let exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_attribute
             WHERE attrelid = to_regclass($1) AND attname = 'available_at' AND NOT attisdropped)",
        )
        .bind(&self.sql.table)
        .fetch_one(&mut *conn)
        .await?;
        if exists {
            return Ok(());
        }
        // `CREATE TABLE IF NOT EXISTS` is not safe against itself: two sessions can both pass the
        // "exists?" check and one dies on pg_type's unique index. A transaction-scoped advisory
        // lock makes concurrent migrations queue instead; the ones that queued then find the
        // table made, quietly.
        let mut tx = conn.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(7170034453421551936)")
            .execute(&mut *tx)
            .await?;
        sqlx::query("SET LOCAL client_min_messages = warning")
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql(self.sql.ddl.clone())
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql(self.sql.outcomes.clone())
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    }

    async fn acquire(
        &self,
        conn: &mut PgConnection,
        p: &Acquire<'_>,
    ) -> Result<Attempt, sqlx::Error> {
        let row = sqlx::query(self.sql.acquire.clone())
            .bind(p.key)
            .bind(p.owner)
            .bind(p.ttl_us as f64)
            .bind(p.holder)
            .bind(p.attempt)
            .bind(p.waiting)
            .bind(p.tenure)
            .bind(p.held as i32)
            .bind(p.min_hold_us as f64)
            .bind(p.once)
            .fetch_optional(&mut *conn)
            .await?;
        let Some(row) = row else {
            // The key was inserted by someone else during this statement.
            return Ok(Attempt::Busy { retry_after: None });
        };
        if row.try_get::<bool, _>(0)? {
            Ok(Attempt::Acquired(Grant {
                hold_count: row.try_get::<i32, _>(1)?.max(0) as u32,
                fencing_token: row.try_get::<i64, _>(2)? as u64,
                expires_at_us: row.try_get(3)?,
            }))
        } else if row.try_get::<bool, _>(5)? {
            Ok(Attempt::Done {
                finished_at_us: row.try_get(6)?,
            })
        } else {
            Ok(Attempt::Busy {
                retry_after: Some(crate::info::millis(row.try_get(4)?)),
            })
        }
    }

    async fn release(
        &self,
        conn: &mut PgConnection,
        h: &HoldRef<'_>,
        remaining: u32,
        outcome: Outcome,
        release_id: i64,
    ) -> Result<Released, sqlx::Error> {
        let left: Option<i32> = sqlx::query_scalar(self.sql.release.clone())
            .bind(h.key)
            .bind(h.owner)
            .bind(h.fencing_token as i64)
            .bind(release_id)
            .bind(&*self.channel)
            .bind(remaining as i32)
            .bind(outcome.code())
            .fetch_optional(&mut *conn)
            .await?;
        Ok(match left {
            None => Released::NotHeld,
            Some(0) => Released::Free,
            Some(n) => Released::StillHeld(n as u32),
        })
    }

    async fn extend(
        &self,
        conn: &mut PgConnection,
        h: &HoldRef<'_>,
        ttl_us: i64,
    ) -> Result<Option<i64>, sqlx::Error> {
        sqlx::query_scalar(self.sql.extend.clone())
            .bind(h.key)
            .bind(h.owner)
            .bind(h.fencing_token as i64)
            .bind(ttl_us as f64)
            .fetch_optional(&mut *conn)
            .await
    }

    async fn extend_many(
        &self,
        conn: &mut PgConnection,
        items: &[RenewItem<'_>],
    ) -> Result<Extended, sqlx::Error> {
        let keys: Vec<&str> = items.iter().map(|i| i.key).collect();
        let owners: Vec<&str> = items.iter().map(|i| i.owner).collect();
        let tokens: Vec<i64> = items.iter().map(|i| i.fencing_token as i64).collect();
        let ttls: Vec<f64> = items.iter().map(|i| i.ttl_us as f64).collect();
        let rows: Vec<(String, String, i64)> = sqlx::query_as(self.sql.extend_many.clone())
            .bind(keys)
            .bind(owners)
            .bind(tokens)
            .bind(ttls)
            .fetch_all(&mut *conn)
            .await?;
        Ok(rows.into_iter().map(|(k, o, t)| (k, o, t as u64)).collect())
    }
}

/// The LISTEN/NOTIFY channel of a table: `dblock_` and a 64-bit FNV-1a hash of its name, so any
/// valid table name (up to 127 bytes with a schema) gives a channel within PostgreSQL's 63 bytes.
pub(crate) fn notify_channel(table: &str) -> String {
    let hash = table.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("dblock_{hash:016x}")
}

#[cfg(feature = "_test-util")]
impl Pg {
    /// The same backend without LISTEN/NOTIFY wake-ups (waiters only poll).
    pub(crate) fn without_notify(&self) -> Self {
        self.clone().listening(false)
    }

    /// The channel releases of this table are announced on.
    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }
}
