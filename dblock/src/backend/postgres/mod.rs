//! PostgreSQL: statements on `statement_timestamp()`, the one clock that is fixed for the statement
//! and not frozen for a caller's whole transaction (as `now()` is). Also the pool set-up, the
//! SQLSTATE codes that decide retries, the LISTEN connection (`notify.rs`) and the statements'
//! form behind a transaction pooler such as PgBouncer (`pooler.rs`).
//!
//! Every statement runs through one place, [`Pg::ready`]: prepared with its values bound (the
//! default), or behind a pooler as one simple-protocol query with the values inlined. A new
//! statement is a [`Stmt`] in [`Statements`] and a list of [`Arg`]s, nothing more.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use sqlx::postgres::{PgArguments, PgConnectOptions, PgConnection, PgPool, PgRow, Postgres};
use sqlx::query::Query;
use sqlx::RawSql;
use sqlx::{AssertSqlSafe, Connection, Row, SqlSafeStr, SqlStr};

use super::admin::{self, PURGE_BATCH};
use super::{
    quote_ident, Acquire, Attempt, Dialect, Extended, Grant, HoldRef, LastWrite, Outcome,
    QueueStep, Released, RenewItem,
};
use crate::backend::Conns;
use crate::connect::ConnectOptions;
use crate::error::LockError;
use crate::info::LockInfo;
use crate::retry::{Failed, Failure};

pub(crate) mod batch;
mod connect;
use connect::keepalives;
pub(crate) use connect::{connect, state_shared};
pub(crate) mod notify;
pub(crate) mod pooler;
pub(crate) mod semaphore;
pub(crate) mod shared;

pub(crate) use pooler::Arg;
use pooler::{Mode, Template};

/// SQLSTATE codes (PostgreSQL manual, appendix A) that decide how a failed statement is retried.
mod sqlstate {
    /// Rolled back: the transaction could not be serialised.
    pub(super) const SERIALIZATION_FAILURE: &str = "40001";
    /// Rolled back: chosen as a deadlock victim.
    pub(super) const DEADLOCK_DETECTED: &str = "40P01";
    /// Rolled back: cancelled (statement_timeout, pg_cancel_backend).
    pub(super) const QUERY_CANCELED: &str = "57014";
    /// Rolled back: `lock_timeout` ran out waiting for a row lock (e.g. a long fenced
    /// transaction holding the lease row).
    pub(super) const LOCK_NOT_AVAILABLE: &str = "55P03";
    /// A prepared statement that is not on this server connection, or one of its name that is
    /// already there: sqlx's named statements meeting a server connection shared with other
    /// clients (a transaction pooler). Nothing ran.
    pub(super) const INVALID_SQL_STATEMENT_NAME: &str = "26000";
    pub(super) const DUPLICATE_PREPARED_STATEMENT: &str = "42P05";
    /// Class 08, connection exception: the outcome is unknown.
    pub(super) const CONNECTION_EXCEPTION: &str = "08";
    /// 57P01-57P05: administrator or crash shutdown, cannot connect now, idle session timeout.
    pub(super) const OPERATOR_SHUTDOWN: &str = "57P";

    pub(super) fn is_shared_connection(code: Option<&str>) -> bool {
        matches!(
            code,
            Some(INVALID_SQL_STATEMENT_NAME | DUPLICATE_PREPARED_STATEMENT)
        )
    }
}

/// How long `Locker::connect`'s pool waits for a connection before failing.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);
/// Server-side TCP keepalives (s): a vanished client's connection is dropped within ~25 s.
const KEEPALIVE_IDLE: &str = "10";
const KEEPALIVE_INTERVAL: &str = "5";
const KEEPALIVE_COUNT: &str = "3";

/// Lease end as microseconds since the epoch.
const US: &str = "(extract(epoch FROM {c}) * 1000000)::int8";

/// A hold that ran out without a release: it ended in failure, unless its success committed
/// with the work (`succeed_in`: `success_token` is its tenure). `{l}` is the row's alias.
const RAN_OUT: &str = "({l}owner IS NOT NULL AND {l}expires_at <= statement_timestamp()
                AND {l}success_token IS DISTINCT FROM {l}fencing_token)";

/// [`RAN_OUT`] for the row aliased `l`, and unaliased.
fn ran_out(alias: &str) -> String {
    RAN_OUT.replace("{l}", alias)
}

#[derive(Clone, Debug)]
pub(crate) struct Pg {
    pool: Conns<Postgres>,
    /// NOTIFY channel for releases of this table (see [`notify_channel`]).
    channel: Arc<str>,
    sql: Arc<Statements>,
    /// The statements of shared (read) locks (`shared.rs`).
    shared_sql: Arc<shared::Sql>,
    batch_sql: Arc<batch::Sql>,
    /// A semaphore's waiters ask for a NOTIFY (`semaphore.rs`).
    flag_slots: Arc<Stmt>,
    /// The LISTEN connection that wakes this locker's waiters; `None` when turned off.
    notifier: Option<Arc<notify::Notifier>>,
    settings: Settings,
}

/// How a [`Pg`] talks to its server, apart from the pool and the table: kept by `with_table`.
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    /// Releases commit without waiting for their WAL flush (`ConnectOptions::durable_release`).
    lazy_release: bool,
    /// Where the LISTEN connection goes; `None`: no LISTEN, waiters only poll.
    listen: Option<notify::Source>,
    /// Behind a transaction pooler or not (`ConnectOptions::pooler`, or found out): behind one,
    /// every statement goes as one simple-protocol query with its values inlined, never a
    /// prepared statement. Shared by the lockers of every table made from this one.
    pooler: Arc<Mode>,
}

impl Settings {
    /// `Locker::postgres(pool)`: LISTEN through the pool's connect options (unless they lead
    /// to a transaction pooler), lazily durable releases, prepared statements unless a pooler
    /// is found before the first one.
    fn defaults(pool: &PgPool) -> Settings {
        Settings {
            lazy_release: true,
            listen: Some(notify::Source::Pool(pool.clone())),
            pooler: Arc::new(Mode::unknown(ConnectOptions::new().statement_timeout)),
        }
    }

    /// As `opts` say. Behind a pooler LISTEN is off unless `listen_url` names a direct
    /// connection for it.
    fn from_options(pool: &PgPool, opts: &ConnectOptions) -> Result<Settings, LockError> {
        let listen = match (&opts.listen_url, opts.listen) {
            (_, false) => None,
            (Some(url), true) => Some(notify::Source::Direct(Arc::new(
                PgConnectOptions::from_str(url)
                    .map_err(|e| super::bad_url(url, e))?
                    .options(keepalives()),
            ))),
            (None, true) if opts.pooler == Some(true) => None,
            (None, true) => Some(notify::Source::Pool(pool.clone())),
        };
        let mode = match opts.pooler {
            Some(pooler) => Mode::known(pooler, opts.statement_timeout),
            None => Mode::unknown(opts.statement_timeout),
        };
        Ok(Settings {
            lazy_release: !opts.durable_release,
            listen,
            pooler: Arc::new(mode),
        })
    }
}

/// One statement of the dialect: its text with `$n` placeholders (prepared on the default path),
/// and the same text cut at them (inlined behind a pooler).
#[derive(Debug)]
pub(crate) struct Stmt {
    sql: SqlStr,
    template: Template,
}

#[derive(Debug)]
struct Statements {
    /// The quoted names of the table and of its queue (migration 0004, the newest), for
    /// `to_regclass`.
    table: String,
    queue_table: String,
    ddl: SqlStr,
    outcomes: SqlStr,
    exactly_once: SqlStr,
    queue: SqlStr,
    shared: SqlStr,
    /// `$1`, `$2` = the quoted queue and lock tables: are both there, with the newest columns?
    exists: Stmt,
    acquire: Stmt,
    acquire_waiting: Stmt,
    acquire_many: Stmt,
    release: Stmt,
    extend: Stmt,
    extend_many: Stmt,
    last_write: Stmt,
    inspect: Stmt,
    held: Stmt,
    held_in: Stmt,
    force_release: Stmt,
    reset: Stmt,
    purge: Stmt,
    queue_join: Stmt,
    queue_ahead: Stmt,
    queue_touch: Stmt,
    queue_leave: Stmt,
}

/// The acquire statement's "a live hold of ours in the tenure this process holds ($7), or one
/// written by this very attempt ($5)"; never NULL.
pub(crate) const SAME: &str = "coalesce(l.owner = {owner} AND l.expires_at > statement_timestamp()
                   AND (l.attempt_id = {attempt} OR l.fencing_token = {tenure}), false)";

/// The `SET` of the acquire statements' UPDATE (one key, several keys): re-entry, or a new
/// tenure. `{owner}`, `{attempt}`, `{tenure}`, `{held}`, `{holder}`, `{ttl}`, `{min_hold}` are
/// the statement's values for the key.
pub(crate) const TAKE: &str = "hold_count = CASE WHEN {same}
                          THEN CASE WHEN l.attempt_id = {attempt} THEN l.hold_count ELSE {held} + 1 END
                          ELSE 1 END,
        fencing_token = CASE WHEN {same} THEN l.fencing_token ELSE l.fencing_token + 1 END,
        acquired_at = CASE WHEN {same} THEN l.acquired_at ELSE statement_timestamp() END,
        holder = CASE WHEN {same} THEN l.holder ELSE {holder} END,
        expires_at = greatest(CASE WHEN {same} THEN l.expires_at END,
                              statement_timestamp() + greatest({ttl}, {min_hold})::float8 * interval '1 microsecond'),
        available_at = CASE WHEN {same} THEN l.available_at
                            WHEN {min_hold} > 0 THEN statement_timestamp() + {min_hold}::float8 * interval '1 microsecond' END,
        -- The hold being taken over ran out without a release (and without a success committed
        -- with its work): it ended in failure.
        last_outcome = CASE WHEN NOT {same} AND {ran_out} THEN 2 ELSE l.last_outcome END,
        finished_at = CASE WHEN NOT {same} AND {ran_out} THEN l.expires_at ELSE l.finished_at END,
        -- A key once taken with `once` stays one (purge keeps its success).
        once_key = l.once_key OR {once},
        attempt_id = {attempt},
        contended = (l.contended AND {same}),
        owner = {owner}";

/// The one-key acquire statement; `{flag}` is [`FLAG`] for a waiter whose LISTEN is in place,
/// nothing otherwise (the usual first attempt: one CTE less to plan and run).
fn acquire_one(flag: &str) -> String {
    ACQUIRE
        .replace("{flag}", flag)
        .replace("{ran_out_res}", &ran_out(""))
        .replace("{ran_out}", &ran_out("l."))
}

/// A waiter ($6) whose LISTEN is in place asks the holder's release to NOTIFY. Written once per
/// contention episode: when the flag is already set this updates nothing.
const FLAG: &str = ", flag AS (
    UPDATE {table} SET contended = true
    WHERE $6 AND lock_key = $1 AND NOT contended AND NOT EXISTS (SELECT 1 FROM upd)
      AND owner IS NOT NULL AND owner <> $2 AND expires_at > statement_timestamp()
    RETURNING 1
)";

/// Acquire, re-entry and takeover of one key (see the statement's comment in `Pg::build`).
const ACQUIRE: &str = "WITH upd AS (
    UPDATE {table} AS l SET
        {take}
    WHERE l.lock_key = $1
      AND (l.expires_at <= statement_timestamp() OR l.owner = $2)
      AND NOT ($10 AND l.last_outcome IS NOT DISTINCT FROM 1 AND NOT {ran_out})
    RETURNING l.hold_count, l.fencing_token, l.expires_at, l.last_outcome, l.finished_at,
              l.success_token, l.owner
){flag}, ins AS (
    INSERT INTO {table} (lock_key, owner, hold_count, fencing_token, expires_at, acquired_at,
                         holder, attempt_id, available_at, once_key)
    SELECT $1, $2, 1, (extract(epoch FROM statement_timestamp()) * 1000000)::int8,
           statement_timestamp() + greatest($3, $9)::float8 * interval '1 microsecond',
           statement_timestamp(), $4, $5,
           CASE WHEN $9 > 0 THEN statement_timestamp() + $9::float8 * interval '1 microsecond' END,
           $10
    WHERE NOT EXISTS (SELECT 1 FROM upd) AND NOT EXISTS (SELECT 1 FROM {table} WHERE lock_key = $1)
    ON CONFLICT (lock_key) DO NOTHING
    RETURNING hold_count, fencing_token, expires_at, last_outcome, finished_at, success_token,
              owner
), res AS (
    SELECT true AS acquired, hold_count, fencing_token, expires_at, last_outcome, finished_at,
           success_token, owner FROM upd
    UNION ALL
    SELECT true, hold_count, fencing_token, expires_at, last_outcome, finished_at, success_token,
           owner FROM ins
    UNION ALL
    SELECT false, hold_count, fencing_token, expires_at, last_outcome, finished_at, success_token,
           owner FROM {table}
     WHERE lock_key = $1 AND NOT EXISTS (SELECT 1 FROM upd) AND NOT EXISTS (SELECT 1 FROM ins)
)
SELECT acquired, hold_count, fencing_token, {us_expires} AS expires_us,
       greatest(0, ceil(extract(epoch FROM expires_at - statement_timestamp()) * 1000))::int8 AS left_ms,
       NOT acquired AND $10 AND last_outcome IS NOT DISTINCT FROM 1 AND NOT {ran_out_res} AS done,
       {us_finished} AS finished_us
FROM res";

/// [`TAKE`] with the one-key statement's parameters.
fn take_one() -> String {
    TAKE.replace("{same}", SAME)
        .replace("{owner}", "$2")
        .replace("{attempt}", "$5")
        .replace("{tenure}", "$7")
        .replace("{held}", "$8")
        .replace("{holder}", "$4")
        .replace("{ttl}", "$3")
        .replace("{min_hold}", "$9")
        .replace("{once}", "$10")
        .replace("{ran_out}", &ran_out("l."))
}

fn sql(template: &str, table: &str) -> SqlStr {
    let text = template
        .replace("{us_expires}", &US.replace("{c}", "expires_at"))
        .replace("{us_acquired}", &US.replace("{c}", "acquired_at"))
        .replace("{us_finished}", &US.replace("{c}", "finished_at"))
        .replace("{ran_out}", &ran_out(""))
        .replace("{table}", table);
    AssertSqlSafe(Arc::<str>::from(text)).into_sql_str()
}

fn stmt(template: &str, table: &str) -> Stmt {
    let sql = sql(template, table);
    Stmt {
        template: Template::parse(sql.as_str()),
        sql,
    }
}

/// The columns of `LockRow`, in its order and types.
const INFO_COLUMNS: &str =
    "lock_key, owner, holder, hold_count::int8, fencing_token, {us_expires}, {us_acquired},
       (owner IS NOT NULL AND expires_at > statement_timestamp()) AS held,
       greatest(0, ceil(extract(epoch FROM expires_at - statement_timestamp()) * 1000))::int8,
       CASE WHEN {ran_out} THEN 2 ELSE last_outcome END::int8,
       CASE WHEN {ran_out} THEN {us_expires} ELSE {us_finished} END,
       coalesce(intent_until > statement_timestamp() AND intent_token = fencing_token, false)";

impl Pg {
    /// Locks in `table` through `pool`, with LISTEN/NOTIFY wake-ups.
    pub(crate) fn new(pool: Conns<Postgres>, table: &str) -> Self {
        let settings = Settings::defaults(&pool);
        Pg::build(pool, table, settings)
    }

    /// Locks in `table` through `pool`, set up as `opts` say (those options that are not about
    /// building the pool).
    pub(crate) fn configured(
        pool: Conns<Postgres>,
        table: &str,
        opts: &ConnectOptions,
    ) -> Result<Self, LockError> {
        let settings = Settings::from_options(&pool, opts)?;
        Ok(Pg::build(pool, table, settings))
    }

    fn build(pool: Conns<Postgres>, table: &str, settings: Settings) -> Self {
        let t = quote_ident(table, '"');
        let q = quote_ident(&super::queue_table(table), '"');
        let files = super::migrations::POSTGRES;
        let statements = Statements {
            table: t.clone(),
            queue_table: q.clone(),
            ddl: sql(&super::migrations::statements(files[0], "\"dblock_locks\""), &t),
            outcomes: sql(&super::migrations::statements(files[1], "\"dblock_locks\""), &t),
            exactly_once: sql(&super::migrations::statements(files[2], "\"dblock_locks\""), &t),
            queue: sql(&super::migrations::statements(files[3], "\"dblock_locks_queue\""), &q),
            shared: sql(&super::migrations::statements(files[5], "\"dblock_locks\""), &t),
            // Both tables with their newest columns (a lock table dropped by hand beside its
            // queue is made again).
            exists: stmt(
                "SELECT to_regclass($1) IS NOT NULL AND EXISTS (SELECT 1 FROM pg_attribute
             WHERE attrelid = to_regclass($2) AND attname = 'intent_owner' AND NOT attisdropped)",
                &t,
            ),

            // Acquire, re-entry and takeover in one statement, update-first:
            // - `upd` is a single-row UPDATE by primary key. Its WHERE is the "may I take it"
            //   test; under READ COMMITTED a concurrent writer makes it wait for the row and
            //   re-check the WHERE against the committed version, so two owners can never both
            //   pass. All CASE arms read the OLD row (PostgreSQL evaluates SET against it).
            // - `ins` creates the row only when `upd` took nothing and the statement's snapshot
            //   has no row (the first test spares the usual path an index probe and the insert's
            //   set-up: 1.35x the cycles with pgbench on these statements). Two racing inserters
            //   meet on the primary key: ON CONFLICT DO NOTHING makes the loser see "busy" (no
            //   row) instead of an error, so nothing is inserted-then-caught.
            // - `flag` ([`FLAG`]) only in `acquire_waiting`, the statement of a waiter whose
            //   LISTEN is in place.
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
            //   busy row then says so. A hold that ran out without a release since (a crashed
            //   holder) ended in failure, whatever the hold before it did: the key is taken.
            acquire: stmt(&acquire_one("").replace("{take}", &take_one()), &t),
            acquire_waiting: stmt(&acquire_one(FLAG).replace("{take}", &take_one()), &t),
            // Several keys of one owner ($1, sorted, with per-key attempt ids $2, tenures $3 and
            // holds $4) at once, all or nothing in this statement's view:
            // (tenure -1: none tracked; tokens are positive, so it matches no row.)
            // - `go`: no key is held by another owner, or done for `once` ($9), in the
            //   snapshot. If one is, nothing is locked, updated or inserted: a busy set writes
            //   nothing.
            // - `locked` row-locks the existing rows in key order before anything is updated,
            //   so two such statements on overlapping keys queue instead of deadlocking. `upd`
            //   reads `locked` as an array (an init plan run to its end first, then an index
            //   condition), not as a semi-join that would scan the CTE again per row.
            // - `upd` is the one-key UPDATE for every existing key (same SET, per-key values from
            //   `req`), each row re-checked under its lock against its latest version (READ
            //   COMMITTED); `ins` creates the missing rows in key order, ON CONFLICT DO NOTHING.
            // - A race the snapshot could not see (a row taken or inserted by someone else after
            //   it) leaves that key untaken: the answer lists the keys taken, and the caller gives
            //   back whatever is out of order.
            acquire_many: stmt(
                &"WITH req AS (
    SELECT * FROM unnest($1::text[], $2::int8[], $3::int8[], $4::int8[]) AS r(k, attempt, tenure, held)
), go AS (
    SELECT NOT EXISTS (
        SELECT 1 FROM {table} AS b JOIN req ON b.lock_key = req.k
        WHERE (b.expires_at > statement_timestamp() AND b.owner IS DISTINCT FROM $5)
           OR ($9 AND b.last_outcome IS NOT DISTINCT FROM 1 AND NOT {ran_out_b})) AS ok
), locked AS MATERIALIZED (
    SELECT b.lock_key FROM {table} AS b
    WHERE b.lock_key = ANY($1) AND (SELECT ok FROM go)
    ORDER BY b.lock_key
    FOR UPDATE
), upd AS (
    UPDATE {table} AS l SET
        {take}
    FROM req AS r
    WHERE l.lock_key = r.k AND l.lock_key = ANY(ARRAY(SELECT lock_key FROM locked))
      AND (l.expires_at <= statement_timestamp() OR l.owner = $5)
      AND NOT ($9 AND l.last_outcome IS NOT DISTINCT FROM 1 AND NOT {ran_out})
    RETURNING l.lock_key, l.hold_count, l.fencing_token, l.expires_at
), ins AS (
    INSERT INTO {table} (lock_key, owner, hold_count, fencing_token, expires_at, acquired_at,
                         holder, attempt_id, available_at, once_key)
    SELECT r.k, $5, 1, (extract(epoch FROM statement_timestamp()) * 1000000)::int8,
           statement_timestamp() + greatest($6, $8)::float8 * interval '1 microsecond',
           statement_timestamp(), $7, r.attempt,
           CASE WHEN $8 > 0 THEN statement_timestamp() + $8::float8 * interval '1 microsecond' END,
           $9
    FROM req AS r
    WHERE (SELECT ok FROM go) AND r.k NOT IN (SELECT lock_key FROM upd)
      AND NOT EXISTS (SELECT 1 FROM {table} WHERE lock_key = r.k)
    ORDER BY r.k COLLATE \"C\"
    ON CONFLICT (lock_key) DO NOTHING
    RETURNING lock_key, hold_count, fencing_token, expires_at
)
SELECT lock_key, hold_count, fencing_token, {us_expires} FROM upd
UNION ALL
SELECT lock_key, hold_count, fencing_token, {us_expires} FROM ins"
                    .replace("{ran_out_b}", &ran_out("b."))
                    .replace("{ran_out}", &ran_out("l."))
                    .replace(
                        "{take}",
                        &TAKE
                            .replace("{same}", SAME)
                            .replace("{owner}", "$5")
                            .replace("{attempt}", "r.attempt")
                            .replace("{tenure}", "r.tenure")
                            .replace("{held}", "r.held")
                            .replace("{holder}", "$7")
                            .replace("{ttl}", "$6")
                            .replace("{min_hold}", "$8")
                            .replace("{once}", "$9")
                            .replace("{ran_out}", &ran_out("l.")),
                    ),
                &t,
            ),


            // One single-row UPDATE by primary key: the WHERE (owner, tenure, live lease) and the
            // new count are applied to the same row version under its row lock, so a release
            // can neither race another release nor touch a lease that has run out. The count
            // left ($6) is the process's (its holds of this tenure, less this one): absolute,
            // so a stray resend cannot count down twice; the release id ($4) recognises one.
            // A full release of a key someone waits for (`contended`) also NOTIFYs the key on
            // the locker's channel ($5); NOTIFY is delivered at commit, i.e. once it is free.
            // The last release of a tenure records how it ended ($7) and when; a hold given
            // back unused ($7 NULL: a grant too late, a partial multi-key take) records nothing.
            // A success committed with the work (`success_token`, see `succeed`) stands,
            // whatever this release says. Every release leaves its id and tenure in
            // `release_id` / `release_token`, which no acquire overwrites: a resend after a lost
            // reply can tell its own earlier effect from a lease that ran out (`last_write`).
            release: stmt(
                "WITH r AS (
    UPDATE {table} SET
        hold_count   = $6,
        owner        = CASE WHEN $6 > 0 THEN owner END,
        -- Free once released, or once min_hold has passed (available_at), whichever is later.
        expires_at   = CASE WHEN $6 > 0 THEN expires_at
                            ELSE greatest(statement_timestamp(), available_at) END,
        last_outcome = CASE WHEN $6 > 0 THEN last_outcome
                            WHEN success_token = fencing_token THEN 1
                            ELSE coalesce($7, last_outcome) END,
        finished_at  = CASE WHEN $6 > 0 OR $7 IS NULL THEN finished_at
                            ELSE statement_timestamp() END,
        attempt_id   = $4,
        release_id   = $4,
        release_token = fencing_token
    WHERE lock_key = $1 AND owner = $2 AND fencing_token = $3 AND attempt_id IS DISTINCT FROM $4
      AND expires_at > statement_timestamp()
    RETURNING hold_count, contended, lock_key
)
SELECT hold_count, CASE WHEN hold_count = 0 AND contended THEN pg_notify($5, lock_key)::text END,
       -- A lazily durable release ($8): this statement's transaction commits without waiting
       -- for its WAL flush (only this transaction: is_local). The next durable commit, e.g.
       -- the grant that takes the key, flushes the log up to and including it.
       CASE WHEN $8 THEN set_config('synchronous_commit', 'off', true) END
FROM r",
                &t,
            ),


            // Single-row UPDATE, owner- and tenure-checked in its WHERE; never shortens a lease.
            extend: stmt(
                "UPDATE {table}
SET expires_at = greatest(expires_at, statement_timestamp() + $4::float8 * interval '1 microsecond')
WHERE lock_key = $1 AND owner = $2 AND fencing_token = $3 AND expires_at > statement_timestamp()
RETURNING {us_expires}",
                &t,
            ),

            // Renewal of many leases: one UPDATE joined to the arrays of (key, owner, token, ttl).
            // Each row is updated under its row lock with the same owner/tenure/live check as
            // `extend`; RETURNING names exactly the holds that were extended.
            extend_many: stmt(
                "UPDATE {table} AS l
SET expires_at = greatest(l.expires_at, statement_timestamp() + r.ttl_us * interval '1 microsecond')
FROM unnest($1::text[], $2::text[], $3::int8[], $4::float8[]) AS r(k, o, tok, ttl_us)
WHERE l.lock_key = r.k AND l.owner = r.o AND l.fencing_token = r.tok
  AND l.expires_at > statement_timestamp()
RETURNING l.lock_key, l.owner, l.fencing_token",
                &t,
            ),
            last_write: stmt(
                "SELECT attempt_id, fencing_token, release_id, release_token FROM {table}
WHERE lock_key = $1",
                &t,
            ),
            inspect: stmt(
                &format!("SELECT {INFO_COLUMNS} FROM {{table}} WHERE lock_key = $1"),
                &t,
            ),
            held: stmt(
                &format!(
                    "SELECT {INFO_COLUMNS} FROM {{table}}
WHERE owner IS NOT NULL AND expires_at > statement_timestamp() ORDER BY lock_key"
                ),
                &t,
            ),
            held_in: stmt(
                &format!(
                    "SELECT {INFO_COLUMNS} FROM {{table}}
WHERE lock_key >= $1 AND lock_key < $2
  AND owner IS NOT NULL AND expires_at > statement_timestamp() ORDER BY lock_key"
                ),
                &t,
            ),

            // Single-row UPDATE: frees a live lease whoever holds it; the token is kept so
            // the next owner still gets a larger one.
            force_release: stmt(
                "UPDATE {table} SET owner = NULL, hold_count = 0, expires_at = statement_timestamp(),
    last_outcome = CASE WHEN success_token = fencing_token THEN 1 ELSE 2 END,
    finished_at = statement_timestamp()
WHERE lock_key = $1 AND owner IS NOT NULL AND expires_at > statement_timestamp()",
                &t,
            ),

            // A key not held: its outcome forgotten (a `once` key runs again, and `purge` may
            // delete it), its min_hold wait ended.
            reset: stmt(
                "UPDATE {table} SET last_outcome = NULL, finished_at = NULL, success_token = NULL,
    once_key = false, expires_at = least(expires_at, statement_timestamp())
WHERE lock_key = $1 AND NOT (owner IS NOT NULL AND expires_at > statement_timestamp())",
                &t,
            ),

            // Deletes free rows (expires_at = when freed) and expired ones, older than $1 µs.
            // A held row has expires_at in the future, so it never matches. A `once` key whose
            // last hold succeeded is kept: deleting it would run the work again (`reset` forgets
            // it on purpose).
            purge: stmt(
                &"DELETE FROM {table}
WHERE expires_at <= statement_timestamp() - $1::int8 * interval '1 microsecond'
  AND NOT (once_key AND last_outcome IS NOT DISTINCT FROM 1 AND NOT {ran_out})"
                    .replace("{ran_out}", &ran_out("")),
                &t,
            ),

            // The fair waiters' queue ($1 key, then the step's values). Each is one statement
            // on one key's rows (primary key (lock_key, ticket)); tickets come from the
            // identity's sequence, so they rise in the order the joins ran and are never
            // reused. The queue orders attempts only: exclusion stays the acquire's alone.
            queue_join: stmt(
                "INSERT INTO {table} (lock_key, owner, expires_at)
VALUES ($1, $2, statement_timestamp() + $3::float8 * interval '1 microsecond')
RETURNING ticket",
                &q,
            ),
            queue_ahead: stmt(
                "SELECT COUNT(*) FROM (SELECT 1 FROM {table}
WHERE lock_key = $1 AND ticket < $2 AND expires_at > statement_timestamp() LIMIT 8) AS ahead",
                &q,
            ),
            queue_touch: stmt(
                "UPDATE {table} SET expires_at = statement_timestamp() + $4::float8 * interval '1 microsecond'
WHERE lock_key = $1 AND owner = $2 AND ticket = $3",
                &q,
            ),
            queue_leave: stmt(
                "DELETE FROM {table}
WHERE lock_key = $1 AND (owner = $2 AND ticket = $3 OR expires_at <= statement_timestamp())",
                &q,
            ),
        };
        let channel: Arc<str> = notify_channel(table).into();
        Pg {
            notifier: settings
                .listen
                .clone()
                .map(|source| notify::Notifier::new(source, channel.to_string())),
            pool,
            channel,
            sql: Arc::new(statements),
            shared_sql: Arc::new(shared::Sql::new(&t)),
            batch_sql: Arc::new(batch::Sql::new(&t)),
            flag_slots: Arc::new(semaphore::flag_stmt(&t)),
            settings,
        }
    }

    /// Whether statements go as simple queries with inlined values (behind a pooler).
    pub(crate) fn pooler(&self) -> bool {
        self.settings.pooler.pooler().is_some()
    }

    /// The one place a statement is made ready to send: prepared, with `args` bound in order
    /// (the default: sqlx keeps it prepared on the connection, one round trip from the second
    /// use on); or, behind a pooler, one simple-protocol query with the transaction's settings
    /// first and `args` written in as literals (`pooler.rs` says why).
    fn ready(&self, s: &Stmt, args: &[Arg<'_>]) -> Result<Ready, sqlx::Error> {
        match self.settings.pooler.pooler() {
            None => Ok(Ready::Prepared(
                args.iter()
                    .fold(sqlx::query(s.sql.clone()), |q, a| a.bind(q)),
            )),
            Some(p) => Ok(Ready::Simple(sqlx::raw_sql(AssertSqlSafe(
                s.template.render(p.prefix(), args)?,
            )))),
        }
    }

    /// The statement's first row, if any.
    async fn fetch_optional(
        &self,
        conn: &mut PgConnection,
        s: &Stmt,
        args: &[Arg<'_>],
    ) -> Result<Option<PgRow>, sqlx::Error> {
        match self.ready(s, args)? {
            Ready::Prepared(q) => self.seen(q.fetch_optional(conn).await),
            Ready::Simple(q) => q.fetch_optional(conn).await,
        }
    }

    /// Every row of the statement.
    async fn fetch_all(
        &self,
        conn: &mut PgConnection,
        s: &Stmt,
        args: &[Arg<'_>],
    ) -> Result<Vec<PgRow>, sqlx::Error> {
        match self.ready(s, args)? {
            Ready::Prepared(q) => self.seen(q.fetch_all(conn).await),
            Ready::Simple(q) => q.fetch_all(conn).await,
        }
    }

    /// How many rows the statement changed (the settings before it change none).
    async fn execute(
        &self,
        conn: &mut PgConnection,
        s: &Stmt,
        args: &[Arg<'_>],
    ) -> Result<u64, sqlx::Error> {
        Ok(match self.ready(s, args)? {
            Ready::Prepared(q) => self.seen(q.execute(conn).await)?.rows_affected(),
            Ready::Simple(q) => q.execute(conn).await?.rows_affected(),
        })
    }

    /// A prepared statement's result, seen for the sign of a transaction pooler that finding
    /// out missed: the statement met another client's server connection
    /// ([`sqlstate::is_shared_connection`]), so nothing ran; pooler mode from now on, and the
    /// error is retried ([`Dialect::classify`]).
    ///
    /// With `pooler(false)` (the direct path forced) it is a configuration error naming
    /// `pooler(true)`, not retried: a retry could land on another client's statement of the
    /// same name.
    fn seen<T>(&self, result: Result<T, sqlx::Error>) -> Result<T, sqlx::Error> {
        match result {
            Err(sqlx::Error::Database(e))
                if sqlstate::is_shared_connection(e.code().as_deref())
                    && !self.settings.pooler.shared_connection_seen() =>
            {
                Err(sqlx::Error::Configuration(
                    format!(
                        "PostgreSQL server connections are shared between clients (a transaction \
                         pooler): {e}; `pooler(false)` forces prepared statements, use \
                         ConnectOptions::pooler(true) (or leave it unset) to lock through it"
                    )
                    .into(),
                ))
            }
            other => other,
        }
    }

    /// Stops the LISTEN connection for good.
    pub(crate) fn stop_listening(&self) {
        if let Some(n) = &self.notifier {
            n.stop();
        }
    }

    /// The benchmark's `pgbench` script for one lock cycle with this locker's own acquire and
    /// release statements (prepared, one parameter per bind, as the library sends them): each
    /// `$n` becomes a pgbench variable of the bind's type, in the order `acquire` and `release`
    /// bind them. Keys are per client (`:client_id`) and `:k`, like the benchmark's owners.
    #[cfg(feature = "_test-util")]
    pub(crate) fn pgbench_script(&self) -> String {
        let key = "('pgbench:' || :client_id || ':' || :k)";
        let owner = "('pgb:' || :client_id)";
        // The binds of `acquire`, in order (non-waiting: `$6` false, no tracked tenure).
        let acquire_binds = [
            key.to_owned(),
            owner.to_owned(),
            "(:ttl_us)::float8".into(),
            "('bench/' || :client_id)".into(),
            "(:attempt)::int8".into(),
            "(:waiting = 1)".into(),
            "nullif(:tenure, -1)::int8".into(),
            "(:held)::int4".into(),
            "(:min_hold_us)::float8".into(),
            "(:once = 1)".into(),
        ];
        // The binds of `release`, in order; the token from the acquire's row (`\gset a_`).
        let release_binds = [
            key.to_owned(),
            owner.to_owned(),
            "(:a_fencing_token)::int8".into(),
            "(:release_id)::int8".into(),
            format!("'{}'", self.channel),
            "(:remaining)::int4".into(),
            "(:outcome)::int2".into(),
            format!("({})", self.settings.lazy_release),
        ];
        let with_binds = |sql: &str, binds: &[String]| {
            // From the highest number down, so `$1` never eats the start of `$10`.
            (1..=binds.len()).rev().fold(sql.to_owned(), |text, n| {
                text.replace(&format!("${n}"), &binds[n - 1])
            })
        };
        format!(
            "\\set k random(0, 63)\n\\set ttl_us 30000000\n\\set attempt random(1, 9000000000000000000)\n\
             \\set release_id random(1, 9000000000000000000)\n\\set waiting 0\n\\set tenure -1\n\
             \\set held 0\n\\set min_hold_us 0\n\\set once 0\n\\set remaining 0\n\\set outcome 1\n\
             {};\n\\gset a_\n{};\n",
            with_binds(self.sql.acquire.sql.as_str(), &acquire_binds),
            with_binds(self.sql.release.sql.as_str(), &release_binds),
        )
    }

    /// Interest in a release of `key` (LISTEN set up on first use); `None` when LISTEN is off
    /// or failed.
    pub(crate) async fn interest(&self, key: &str) -> Option<notify::Interest> {
        self.notifier.as_ref()?.interest(key).await
    }
}

/// A statement as this backend sends it and reads its answer: implemented for each statement
/// value of the contract (`backend/contract.rs`) in this backend's file for its kind.
pub(crate) trait OnPostgres: super::Statement {
    fn postgres(
        &self,
        pg: &Pg,
        conn: &mut sqlx::PgConnection,
    ) -> impl std::future::Future<Output = Result<Self::Output, sqlx::Error>> + Send;
}

/// `impl OnPostgres` for statement values by functions of this backend: `$ty => f` with
/// `f(&Pg, &mut sqlx::PgConnection, &$ty) -> Result<Output, sqlx::Error>`.
macro_rules! postgres_runs {
    ($($ty:ty => $f:path),+ $(,)?) => {
        $(
            impl $crate::backend::postgres::OnPostgres for $ty {
                async fn postgres(
                    &self,
                    pg: &$crate::backend::postgres::Pg,
                    conn: &mut sqlx::PgConnection,
                ) -> Result<<$ty as $crate::backend::Statement>::Output, sqlx::Error> {
                    $f(pg, conn, self).await
                }
            }
        )+
    };
}
pub(crate) use postgres_runs;

impl Dialect for Pg {
    const NAME: &'static str = "postgres";
    type Db = Postgres;

    /// Makes sure the locker knows whether its pool goes through a transaction pooler before
    /// its first statement (`Locker::postgres(pool)`: the application's pool, which no connect
    /// of ours looked at). Once known, free.
    async fn settle(&self, deadline: Instant) -> Result<(), Failed> {
        if self.settings.pooler.is_known() {
            return Ok(());
        }
        let options = self.pool.connect_options();
        let probe = async {
            match tokio::time::timeout_at(deadline, state_shared(&options)).await {
                Ok(answer) => answer,
                Err(_) => Err(super::exec::connect_timed_out()),
            }
        };
        Box::pin(self.settings.pooler.find_out(probe))
            .await
            .map_err(|error| Failed {
                error,
                sent: false,
                class: None,
            })
    }

    fn with_table(&self, table: &str) -> Self {
        Pg::build(self.pool.clone(), table, self.settings.clone())
    }

    fn classify(e: &dyn sqlx::error::DatabaseError) -> Failure {
        match e.code().as_deref() {
            Some(sqlstate::SERIALIZATION_FAILURE)
            | Some(sqlstate::DEADLOCK_DETECTED)
            | Some(sqlstate::QUERY_CANCELED)
            | Some(sqlstate::LOCK_NOT_AVAILABLE) => Failure::NotCommitted,
            code if sqlstate::is_shared_connection(code) => Failure::NotCommitted,
            // A standby (the primary this connection reached was demoted by a failover):
            // nothing was written, and the connection is closed (`exec::run`), so the send is
            // tried again, as when no connection could be had, on a new one.
            Some(super::exec::READ_ONLY) => Failure::NotSent,
            Some(c)
                if c.starts_with(sqlstate::CONNECTION_EXCEPTION)
                    || c.starts_with(sqlstate::OPERATOR_SHUTDOWN) =>
            {
                Failure::Unknown
            }
            _ => Failure::Fatal,
        }
    }

    fn pool(&self) -> &Conns<Postgres> {
        &self.pool
    }

    fn database(&self) -> String {
        let o = self.pool.connect_options();
        let host = match o.get_socket() {
            Some(socket) => socket.display().to_string(),
            None => o.get_host().to_owned(),
        };
        let db = o.get_database().unwrap_or(o.get_username());
        format!("{host}:{}/{db}", o.get_port())
    }

    async fn migrate(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        // The usual case at every start: the table is there, with the newest migration's
        // columns. One read, no lock, and none of the "already exists, skipping" NOTICEs that
        // sqlx would log at INFO.
        let exists: bool = match self
            .fetch_optional(
                conn,
                &self.sql.exists,
                &[Arg::Text(&self.sql.queue_table), Arg::Text(&self.sql.table)],
            )
            .await?
        {
            Some(row) => row.try_get(0)?,
            None => false,
        };
        if exists {
            return Ok(());
        }
        // `CREATE TABLE IF NOT EXISTS` is not safe against itself: two sessions can both pass the
        // "exists?" check and one dies on pg_type's unique index. A transaction-scoped advisory
        // lock makes concurrent migrations queue instead; the ones that queued then find the
        // table made, quietly.
        if let Some(p) = self.settings.pooler.pooler() {
            // Behind a pooler: the same steps as one simple query, which is one implicit
            // transaction (no explicit one to leave open on a shared server connection, and
            // fine in statement pooling mode too).
            let script = format!(
                "{}{MIGRATE_LOCK};\nSET LOCAL client_min_messages = warning;\n{}{}{}{}{}",
                p.prefix(),
                self.sql.ddl.as_str(),
                self.sql.outcomes.as_str(),
                self.sql.exactly_once.as_str(),
                self.sql.queue.as_str(),
                self.sql.shared.as_str()
            );
            sqlx::raw_sql(AssertSqlSafe(script)).execute(conn).await?;
            return Ok(());
        }
        let mut tx = conn.begin().await?;
        sqlx::query(MIGRATE_LOCK).execute(&mut *tx).await?;
        sqlx::query("SET LOCAL client_min_messages = warning")
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql(self.sql.ddl.clone())
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql(self.sql.outcomes.clone())
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql(self.sql.exactly_once.clone())
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql(self.sql.queue.clone())
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql(self.sql.shared.clone())
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    }

    async fn acquire(
        &self,
        conn: &mut PgConnection,
        p: &Acquire<'_>,
    ) -> Result<Attempt, sqlx::Error> {
        let row = self
            .fetch_optional(
                conn,
                if p.waiting {
                    &self.sql.acquire_waiting
                } else {
                    &self.sql.acquire
                },
                &[
                    Arg::Text(p.key),
                    Arg::Text(p.owner),
                    Arg::Float8(p.ttl_us as f64),
                    Arg::Text(p.holder),
                    Arg::Int8(p.attempt),
                    Arg::Bool(p.waiting),
                    Arg::OptInt8(p.tenure),
                    Arg::Int4(p.held as i32),
                    Arg::Float8(p.min_hold_us as f64),
                    Arg::Bool(p.once),
                ],
            )
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

    async fn acquire_batch(
        &self,
        conn: &mut PgConnection,
        rows: &[Acquire<'_>],
    ) -> Result<Vec<Attempt>, sqlx::Error> {
        batch::acquire(self, conn, rows).await
    }

    async fn release_batch(
        &self,
        conn: &mut PgConnection,
        rows: &[crate::backend::coalesce::ReleaseRow],
    ) -> Result<Vec<Released>, sqlx::Error> {
        batch::release(self, conn, rows).await
    }

    async fn acquire_many(
        &self,
        conn: &mut PgConnection,
        all: &[Acquire<'_>],
    ) -> Result<Option<Vec<Attempt>>, sqlx::Error> {
        let Some(first) = all.first() else {
            return Ok(Some(Vec::new()));
        };
        let keys: Vec<&str> = all.iter().map(|a| a.key).collect();
        let attempts: Vec<i64> = all.iter().map(|a| a.attempt).collect();
        let tenures: Vec<i64> = all.iter().map(|a| a.tenure.unwrap_or(-1)).collect();
        let held: Vec<i64> = all.iter().map(|a| i64::from(a.held)).collect();
        let rows = self
            .fetch_all(
                conn,
                &self.sql.acquire_many,
                &[
                    Arg::TextArray(&keys),
                    Arg::Int8Array(&attempts),
                    Arg::Int8Array(&tenures),
                    Arg::Int8Array(&held),
                    Arg::Text(first.owner),
                    Arg::Float8(first.ttl_us as f64),
                    Arg::Text(first.holder),
                    Arg::Float8(first.min_hold_us as f64),
                    Arg::Bool(first.once),
                ],
            )
            .await?;
        let mut grants = Vec::with_capacity(rows.len());
        for row in rows {
            grants.push((
                row.try_get::<String, _>(0)?,
                Grant {
                    hold_count: row.try_get::<i32, _>(1)?.max(0) as u32,
                    fencing_token: row.try_get::<i64, _>(2)? as u64,
                    expires_at_us: row.try_get(3)?,
                },
            ));
        }
        Ok(Some(super::per_key(all, grants)))
    }

    async fn release(
        &self,
        conn: &mut PgConnection,
        h: &HoldRef<'_>,
        remaining: u32,
        outcome: Option<Outcome>,
        release_id: i64,
    ) -> Result<Released, sqlx::Error> {
        let row = self
            .fetch_optional(
                conn,
                &self.sql.release,
                &[
                    Arg::Text(h.key),
                    Arg::Text(h.owner),
                    Arg::Int8(h.fencing_token as i64),
                    Arg::Int8(release_id),
                    Arg::Text(&self.channel),
                    Arg::Int4(remaining as i32),
                    Arg::OptInt2(outcome.map(Outcome::code)),
                    Arg::Bool(self.settings.lazy_release),
                ],
            )
            .await?;
        let left: Option<i32> = row.map(|r| r.try_get(0)).transpose()?;
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
        let row = self
            .fetch_optional(
                conn,
                &self.sql.extend,
                &[
                    Arg::Text(h.key),
                    Arg::Text(h.owner),
                    Arg::Int8(h.fencing_token as i64),
                    Arg::Float8(ttl_us as f64),
                ],
            )
            .await?;
        row.map(|r| r.try_get(0)).transpose()
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
        let rows = self
            .fetch_all(
                conn,
                &self.sql.extend_many,
                &[
                    Arg::TextArray(&keys),
                    Arg::TextArray(&owners),
                    Arg::Int8Array(&tokens),
                    Arg::Float8Array(&ttls),
                ],
            )
            .await?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get::<i64, _>(2)? as u64)))
            .collect()
    }

    async fn last_write(
        &self,
        conn: &mut PgConnection,
        key: &str,
    ) -> Result<Option<LastWrite>, sqlx::Error> {
        let row = self
            .fetch_optional(conn, &self.sql.last_write, &[Arg::Text(key)])
            .await?;
        row.map(|r| {
            Ok(LastWrite {
                writer: r.try_get(0)?,
                fencing_token: r.try_get(1)?,
                release_id: r.try_get(2)?,
                release_token: r.try_get(3)?,
            })
        })
        .transpose()
    }

    async fn inspect(
        &self,
        conn: &mut PgConnection,
        key: &str,
    ) -> Result<Option<LockInfo>, sqlx::Error> {
        let row = self
            .fetch_optional(conn, &self.sql.inspect, &[Arg::Text(key)])
            .await?;
        row.map(|r| admin::decode(&r).map(LockInfo::from))
            .transpose()
    }

    async fn held(&self, conn: &mut PgConnection) -> Result<Vec<LockInfo>, sqlx::Error> {
        let rows = self.fetch_all(conn, &self.sql.held, &[]).await?;
        rows.iter()
            .map(|r| admin::decode(r).map(LockInfo::from))
            .collect()
    }

    async fn held_in(
        &self,
        conn: &mut PgConnection,
        from: &str,
        to: &str,
    ) -> Result<Vec<LockInfo>, sqlx::Error> {
        let rows = self
            .fetch_all(conn, &self.sql.held_in, &[Arg::Text(from), Arg::Text(to)])
            .await?;
        rows.iter()
            .map(|r| admin::decode(r).map(LockInfo::from))
            .collect()
    }

    async fn force_release(&self, conn: &mut PgConnection, key: &str) -> Result<bool, sqlx::Error> {
        Ok(self
            .execute(conn, &self.sql.force_release, &[Arg::Text(key)])
            .await?
            > 0)
    }

    async fn reset(&self, conn: &mut PgConnection, key: &str) -> Result<bool, sqlx::Error> {
        Ok(self
            .execute(conn, &self.sql.reset, &[Arg::Text(key)])
            .await?
            > 0)
    }

    async fn purge(&self, conn: &mut PgConnection, older_than_us: i64) -> Result<u64, sqlx::Error> {
        let mut total = 0;
        loop {
            let n = self
                .execute(conn, &self.sql.purge, &[Arg::Int8(older_than_us)])
                .await?;
            total += n;
            if n < PURGE_BATCH {
                return Ok(total);
            }
        }
    }

    async fn queue(
        &self,
        conn: &mut PgConnection,
        step: QueueStep<'_>,
    ) -> Result<i64, sqlx::Error> {
        let s = &self.sql;
        match step {
            QueueStep::Join {
                key,
                owner,
                lease_us,
            } => {
                let row = self
                    .fetch_optional(
                        conn,
                        &s.queue_join,
                        &[Arg::Text(key), Arg::Text(owner), Arg::Int8(lease_us)],
                    )
                    .await?
                    .ok_or(sqlx::Error::RowNotFound)?;
                row.try_get(0)
            }
            QueueStep::Ahead { key, ticket } => {
                let row = self
                    .fetch_optional(conn, &s.queue_ahead, &[Arg::Text(key), Arg::Int8(ticket)])
                    .await?
                    .ok_or(sqlx::Error::RowNotFound)?;
                row.try_get(0)
            }
            QueueStep::Touch {
                key,
                owner,
                ticket,
                lease_us,
            } => {
                let args = [
                    Arg::Text(key),
                    Arg::Text(owner),
                    Arg::Int8(ticket),
                    Arg::Int8(lease_us),
                ];
                Ok(self.execute(conn, &s.queue_touch, &args).await? as i64)
            }
            QueueStep::Leave { key, owner, ticket } => {
                let args = [Arg::Text(key), Arg::Text(owner), Arg::Int8(ticket)];
                Ok(self.execute(conn, &s.queue_leave, &args).await? as i64)
            }
        }
    }
}

/// A statement ready to send, in one of its two forms ([`Pg::ready`]).
enum Ready {
    Prepared(Query<'static, Postgres, PgArguments>),
    Simple(RawSql),
}

/// Takes the advisory lock that serialises concurrent migrations (transaction-scoped).
const MIGRATE_LOCK: &str = "SELECT pg_advisory_xact_lock(7170034453421551936)";

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
        Pg {
            notifier: None,
            settings: Settings {
                listen: None,
                ..self.settings.clone()
            },
            ..self.clone()
        }
    }

    /// The channel releases of this table are announced on.
    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::postgres::PgPoolOptions;

    fn lazy_pool() -> PgPool {
        PgPoolOptions::new()
            .connect_lazy("postgres://postgres@127.0.0.1:5432/test")
            .unwrap()
    }

    /// Each statement's template finds exactly the placeholders its binds fill (comments with
    /// `($n)` in them are not placeholders).
    #[tokio::test]
    async fn every_statement_has_the_placeholders_its_values_fill() {
        let sql = &Pg::new(lazy_pool().into(), "some.t").sql;
        for (name, s, n) in [
            ("exists", &sql.exists, 2),
            ("acquire", &sql.acquire, 10),
            ("release", &sql.release, 8),
            ("extend", &sql.extend, 4),
            ("extend_many", &sql.extend_many, 4),
            ("last_write", &sql.last_write, 1),
            ("inspect", &sql.inspect, 1),
            ("held", &sql.held, 0),
            ("held_in", &sql.held_in, 2),
            ("force_release", &sql.force_release, 1),
            ("reset", &sql.reset, 1),
            ("purge", &sql.purge, 1),
            ("queue_join", &sql.queue_join, 3),
            ("queue_ahead", &sql.queue_ahead, 2),
            ("queue_touch", &sql.queue_touch, 4),
            ("queue_leave", &sql.queue_leave, 3),
        ] {
            assert_eq!(s.template.params(), n, "{name}");
            let args: Vec<Arg<'_>> = (0..n).map(|_| Arg::Int8(0)).collect();
            let text = s.template.render("", &args).unwrap();
            assert!(!text.contains("--"), "{name}: a comment went out: {text}");
        }
    }

    /// The session-state sign of a transaction pooler ([`state_shared`]): PgBouncer in
    /// transaction mode shares it, the server itself does not. (Found through the start-up
    /// signs first in `connect`, this one is what a pooler that took and applied the settings
    /// would still show.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shared_session_state_tells_a_transaction_pooler_from_a_server() {
        let require = std::env::var("DBLOCK_REQUIRE_SERVERS").is_ok_and(|v| v == "1");
        let options = |url: &str| {
            PgConnectOptions::from_str(url)
                .unwrap()
                .extra_float_digits(None)
        };
        let server = options("postgres://postgres@127.0.0.1:5432/test");
        let bouncer = options("postgres://postgres@127.0.0.1:6432/test");
        match (state_shared(&server).await, state_shared(&bouncer).await) {
            (Ok(s), Ok(b)) => {
                assert!(!s, "the server taken for a pooler");
                assert!(b, "PgBouncer in transaction mode not found");
            }
            (s, b) => {
                assert!(!require, "servers unreachable: {s:?} {b:?}");
                return;
            }
        }
        // Under load: other clients keep taking the pooler's server connections between the
        // probe's statements (the case a single look got wrong: it then saw no sharing, and
        // LISTEN went through the pooler).
        let busy = PgPoolOptions::new()
            .max_connections(6)
            .connect_lazy_with(bouncer.clone());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let load: Vec<_> = (0..6)
            .map(|_| {
                let (busy, stop) = (busy.clone(), stop.clone());
                tokio::spawn(async move {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let _ = sqlx::raw_sql(AssertSqlSafe("SELECT pg_sleep(0.0005)"))
                            .execute(&busy)
                            .await;
                    }
                })
            })
            .collect();
        for round in 0..20 {
            assert!(
                state_shared(&bouncer).await.unwrap(),
                "PgBouncer under load not found (look {round})"
            );
            assert!(
                !state_shared(&server).await.unwrap(),
                "the server taken for a pooler"
            );
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for task in load {
            task.await.unwrap();
        }
    }

    #[tokio::test]
    async fn settings_follow_the_options() {
        let pool = lazy_pool();
        let direct = Settings::from_options(&pool, &ConnectOptions::new()).unwrap();
        assert!(!direct.pooler.is_known() && direct.lazy_release);
        assert!(matches!(direct.listen, Some(notify::Source::Pool(_))));

        // Behind a pooler: no LISTEN unless a URL of its own is given for it.
        let pooled = ConnectOptions::new().pooler(true).durable_release(true);
        let s = Settings::from_options(&pool, &pooled).unwrap();
        assert!(s.pooler.pooler().is_some() && s.listen.is_none() && !s.lazy_release);
        let s = Settings::from_options(
            &pool,
            &pooled.clone().listen_url("postgres://app@db:5432/app"),
        )
        .unwrap();
        assert!(matches!(s.listen, Some(notify::Source::Direct(_))));
        let s = Settings::from_options(
            &pool,
            &pooled
                .clone()
                .listen_url("postgres://app@db/app")
                .listen(false),
        )
        .unwrap();
        assert!(s.listen.is_none());

        match Settings::from_options(&pool, &pooled.listen_url("postgres://u:hunter2@[::1:x/db")) {
            Err(LockError::Config(msg)) => assert!(!msg.contains("hunter2"), "{msg}"),
            other => panic!("{other:?}"),
        }
    }

    /// Behind a pooler each statement brings its transaction's settings, whatever the session
    /// says, and leaves the session as it found it. Shown on a direct connection whose session
    /// defaults are the opposite (SERIALIZABLE, one-hour time-outs), the one place this test can
    /// set session defaults without touching connections that others share.
    #[tokio::test]
    async fn pooler_statements_bring_their_own_settings_and_leave_none() {
        let url = std::env::var("DBLOCK_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let options = PgConnectOptions::from_str(&url).unwrap().options([
            ("default_transaction_isolation", "serializable"),
            ("statement_timeout", "1h"),
            ("lock_timeout", "1h"),
        ]);
        let pool = match PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
        {
            Ok(pool) => pool,
            Err(e) if std::env::var("DBLOCK_REQUIRE_SERVERS").is_ok_and(|v| v == "1") => {
                panic!("PostgreSQL unreachable and DBLOCK_REQUIRE_SERVERS=1: {e}")
            }
            Err(e) => {
                eprintln!("!!!!! SKIPPING the pooler settings test: {e}");
                return;
            }
        };
        let opts = ConnectOptions::new()
            .pooler(true)
            .statement_timeout(Duration::from_millis(300));
        let pg = Pg::configured(pool.clone().into(), "unused", &opts).unwrap();
        let probe = stmt(
            "SELECT current_setting('transaction_isolation'), current_setting('statement_timeout'),
       current_setting('lock_timeout'), $1::text",
            "unused",
        );
        let mut conn = pool.acquire().await.unwrap();
        let row = pg
            .fetch_optional(&mut conn, &probe, &[Arg::Text("it's \\ fine")])
            .await
            .unwrap()
            .unwrap();
        let got: (String, String, String, String) = (
            row.try_get(0).unwrap(),
            row.try_get(1).unwrap(),
            row.try_get(2).unwrap(),
            row.try_get(3).unwrap(),
        );
        assert_eq!(
            got,
            (
                "read committed".into(),
                "300ms".into(),
                "300ms".into(),
                "it's \\ fine".into()
            )
        );
        // Nothing stays behind on the (here: only) connection.
        let row = sqlx::raw_sql(
            "SELECT current_setting('transaction_isolation'), current_setting('statement_timeout')",
        )
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        let after: (String, String) = (row.try_get(0).unwrap(), row.try_get(1).unwrap());
        assert_eq!(after, ("serializable".into(), "1h".into()));
    }

    /// The coalesced statements keep reading the table by key after it grows. Their generic
    /// plan (the one PostgreSQL caches after five executions of a prepared statement) is made
    /// while the table is small, and a server that never analyzes it (autovacuum off) keeps
    /// that plan: without `enable_seqscan = off` in the session it scanned the whole table
    /// for every batch (measured: 4.8 ms instead of 0.9 ms for 64 rows of 4,096).
    #[tokio::test]
    async fn coalesced_statements_made_on_a_small_table_read_a_grown_one_by_key() {
        let url = std::env::var("DBLOCK_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let table = format!("t_grow_{}_{}", std::process::id(), fastrand::u32(..));
        // One connection: the statements' executions all build up its plan cache.
        let opts = ConnectOptions::new().max_connections(1);
        let b = match crate::backend::Backend::connect(&url, &table, &opts).await {
            Ok(b) => b,
            Err(e) => {
                let require = std::env::var("DBLOCK_REQUIRE_SERVERS").is_ok_and(|v| v == "1");
                assert!(!require, "PostgreSQL unreachable: {e}");
                return;
            }
        };
        let deadline = || Instant::now() + Duration::from_secs(10);
        b.migrate(deadline()).await.unwrap();
        for i in 0..8 {
            let keys = [format!("small:{i}:a"), format!("small:{i}:b")];
            let rows = keys
                .each_ref()
                .map(|k| crate::backend::statement_tests::one(k, "o", 1));
            b.acquire_batch(&rows, deadline()).await.unwrap();
            let rows = keys.map(|key| {
                let hold = HoldRef {
                    key: &key,
                    owner: "o",
                    fencing_token: 1,
                };
                crate::backend::coalesce::ReleaseRow::new(&hold, 0, None, 2)
            });
            b.release_batch(&rows, deadline()).await.unwrap();
        }
        #[allow(irrefutable_let_patterns)] // with no other backend built
        let crate::backend::Backend::Postgres(pg) = &b
        else {
            unreachable!("a PostgreSQL URL")
        };
        let mut conn = pg.pool().acquire().await.unwrap();
        let run = async |conn: &mut PgConnection, sql: String| {
            let rows: Vec<(String,)> = sqlx::query_as(AssertSqlSafe(sql))
                .fetch_all(conn)
                .await
                .unwrap();
            rows.into_iter().map(|r| r.0).collect::<Vec<_>>().join("\n")
        };
        run(
            &mut conn,
            format!(
                "INSERT INTO {table} (lock_key, hold_count, fencing_token, expires_at, acquired_at)
                 SELECT 'grown:' || g, 0, 1, now(), now() FROM generate_series(0, 4095) AS g
                 RETURNING ''"
            ),
        )
        .await;
        let keys = (0..64)
            .map(|i| format!("'grown:{i}'"))
            .collect::<Vec<_>>()
            .join(",");
        let each = |v: &str| format!("ARRAY[{}]", vec![v; 64].join(","));
        let (o, n, zero) = (each("'o'"), each("7"), each("0"));
        for (start, args) in [
            (
                "WITH r AS (",
                format!(
                    "ARRAY[{keys}], {o}, {}, {o}, {n}, {}, {zero}, {}, {zero}",
                    each("1e6"),
                    each("-1"),
                    each("0.0")
                ),
            ),
            (
                "WITH q AS (",
                format!(
                    "ARRAY[{keys}], {o}, {n}, {n}, {zero}, {}, 'c', false",
                    each("-1")
                ),
            ),
        ] {
            let name = run(
                &mut conn,
                format!(
                    "SELECT name FROM pg_prepared_statements
                     WHERE starts_with(statement, '{start}') AND generic_plans > 0"
                ),
            )
            .await;
            assert!(!name.is_empty(), "{start}: no generic plan was made");
            let plan = run(
                &mut conn,
                format!("EXPLAIN (COSTS false) EXECUTE {name}({args})"),
            )
            .await;
            assert!(plan.contains("Index Cond"), "{start}:\n{plan}");
            assert!(!plan.contains("Seq Scan"), "{start}:\n{plan}");
        }
        sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {table}")))
            .execute(&mut *conn)
            .await
            .unwrap();
    }
}
