//! PostgreSQL's statements of one lock table: their texts, each with the argument for its
//! atomicity, built once per table ([`Pg::build`]).

#[allow(unused_imports)]
use super::*;
use crate::backend::migrations::RENEWED;
use crate::backend::QueueSql;

/// One statement of the dialect: its text with `$n` placeholders (prepared on the default path),
/// and the same text cut at them (inlined behind a pooler).
#[derive(Debug)]
pub(crate) struct Stmt {
    pub(super) sql: SqlStr,
    pub(super) template: Template,
}

#[derive(Debug)]
pub(super) struct Statements {
    /// The quoted names of the table and of its queue (migration 0004, the newest), for
    /// `to_regclass`.
    pub(super) table: String,
    pub(super) queue_table: String,
    pub(super) schema: crate::backend::migrations::Schema,
    /// `$1`, `$2` = the quoted queue and lock tables: are both there, with the newest columns?
    pub(super) exists: Stmt,
    pub(super) acquire: Stmt,
    pub(super) acquire_waiting: Stmt,
    pub(super) acquire_many: Stmt,
    pub(super) release: Stmt,
    pub(super) extend: Stmt,
    pub(super) extend_many: Stmt,
    pub(super) last_write: Stmt,
    pub(super) inspect: Stmt,
    pub(super) held: Stmt,
    pub(super) rows_in: Stmt,
    pub(super) force_release: Stmt,
    pub(super) reset: Stmt,
    pub(super) purge: Stmt,
    pub(super) held_back: Stmt,
    pub(super) queue_steps: QueueSql<Stmt>,
}

/// The rows a purge deletes, but for their fencing token: free or expired for longer than `$1`
/// µs, and not the record of a `once` key whose last hold succeeded.
const PURGEABLE: &str = "expires_at <= statement_timestamp() - $1::int8 * interval '1 microsecond'
  AND NOT (once_key AND last_outcome IS NOT DISTINCT FROM 1 AND NOT {ran_out})";

/// How far ahead of the clock a held-back row's token may be for `purge` to wait for it, µs.
const HELD_BACK_US: u128 = crate::timing::PURGE_HELD_BACK.as_micros();

/// A new row's first fencing token: the statement's time in µs.
const SEED: &str = "(extract(epoch FROM statement_timestamp()) * 1000000)::int8";

/// The acquire statement's "a live hold of ours in the tenure this process holds ($6), or one
/// written by this very attempt ($5)"; never NULL.
pub(crate) const SAME: &str = "coalesce(l.owner = {owner} AND l.expires_at > statement_timestamp()
                   AND (l.attempt_id = {attempt} OR l.fencing_token = {tenure}), false)";

/// The `SET` of the acquire statements' UPDATE (one key, several keys): re-entry, or a new
/// tenure. `{owner}`, `{attempt}`, `{tenure}`, `{held}`, `{holder}`, `{ttl}`, `{min_hold}` are
/// the statement's values for the key.
pub(crate) const TAKE: &str = "hold_count = CASE WHEN {same}
                          THEN CASE WHEN l.attempt_id = {attempt} THEN l.hold_count ELSE {held} + 1 END
                          ELSE 1 END,
        fencing_token = CASE WHEN {same} THEN l.fencing_token
                             ELSE greatest(l.fencing_token + 1, (extract(epoch FROM statement_timestamp()) * 1000000)::int8) END,
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
pub(super) fn acquire_one(flag: &str) -> String {
    ACQUIRE
        .replace("{flag}", flag)
        .replace("{ran_out_res}", &ran_out(""))
        .replace("{ran_out}", &ran_out("l."))
}

/// A waiter ($10) whose LISTEN is in place asks the holder's release to NOTIFY. Written once per
/// contention episode: when the flag is already set this updates nothing.
pub(super) const FLAG: &str = ", flag AS (
    UPDATE {table} SET contended = true
    WHERE $10 AND lock_key = $1 AND NOT contended AND NOT EXISTS (SELECT 1 FROM upd)
      AND owner IS NOT NULL AND owner <> $2 AND expires_at > statement_timestamp()
    RETURNING 1
)";

/// Acquire, re-entry and takeover of one key (see the statement's comment in `Pg::build`).
pub(super) const ACQUIRE: &str = "WITH upd AS (
    UPDATE {table} AS l SET
        {take}
    WHERE l.lock_key = $1
      AND (l.expires_at <= statement_timestamp() OR l.owner = $2)
      AND NOT ($9 AND l.last_outcome IS NOT DISTINCT FROM 1 AND NOT {ran_out})
    RETURNING l.hold_count, l.fencing_token, l.expires_at, l.last_outcome, l.finished_at,
              l.success_token, l.owner
){flag}, ins AS (
    INSERT INTO {table} (lock_key, owner, hold_count, fencing_token, expires_at, acquired_at,
                         holder, attempt_id, available_at, once_key)
    SELECT $1, $2, 1, (extract(epoch FROM statement_timestamp()) * 1000000)::int8,
           statement_timestamp() + greatest($3, $8)::float8 * interval '1 microsecond',
           statement_timestamp(), $4, $5,
           CASE WHEN $8 > 0 THEN statement_timestamp() + $8::float8 * interval '1 microsecond' END,
           $9
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
       NOT acquired AND $9 AND last_outcome IS NOT DISTINCT FROM 1 AND NOT {ran_out_res} AS done,
       {us_finished} AS finished_us
FROM res";

/// [`TAKE`] with the one-key statement's parameters.
pub(super) fn take_one() -> String {
    TAKE.replace("{same}", SAME)
        .replace("{owner}", "$2")
        .replace("{attempt}", "$5")
        .replace("{tenure}", "$6")
        .replace("{held}", "$7")
        .replace("{holder}", "$4")
        .replace("{ttl}", "$3")
        .replace("{min_hold}", "$8")
        .replace("{once}", "$9")
        .replace("{ran_out}", &ran_out("l."))
}

pub(super) fn sql(template: &str, table: &str) -> SqlStr {
    let text = template
        .replace("{us_expires}", &US.replace("{c}", "expires_at"))
        .replace("{us_acquired}", &US.replace("{c}", "acquired_at"))
        .replace("{us_finished}", &US.replace("{c}", "finished_at"))
        .replace("{ran_out}", &ran_out(""))
        .replace("{renewed}", RENEWED)
        .replace("{table}", table);
    AssertSqlSafe(Arc::<str>::from(text)).into_sql_str()
}

pub(super) fn stmt(template: &str, table: &str) -> Stmt {
    let sql = sql(template, table);
    Stmt {
        template: Template::parse(sql.as_str()),
        sql,
    }
}

/// The columns `admin::decode` reads, in its order and types.
pub(super) const INFO_COLUMNS: &str =
    "lock_key, owner, holder, hold_count::int8, fencing_token, {us_expires}, {us_acquired},
       (owner IS NOT NULL AND expires_at > statement_timestamp()) AS held,
       greatest(0, ceil(extract(epoch FROM expires_at - statement_timestamp()) * 1000))::int8,
       CASE WHEN {ran_out} THEN 2 ELSE last_outcome END::int8,
       CASE WHEN {ran_out} THEN {us_expires} ELSE {us_finished} END,
       coalesce(intent_until > statement_timestamp() AND intent_token = fencing_token, false),
       CASE WHEN renewals_token = fencing_token THEN renewals ELSE 0 END::int8";

impl Pg {
    pub(super) fn build(pool: Conns<Postgres>, table: &str, settings: Settings) -> Self {
        use crate::backend::migrations::{self, Schema};
        let t = quote_ident(table, '"');
        let q = quote_ident(&crate::backend::queue_table(table), '"');
        let statements = Statements {
            table: t.clone(),
            queue_table: q.clone(),
            schema: Schema::new(&migrations::POSTGRES, '"', sql, &t, &q),
            // Both tables with their newest columns (a lock table dropped by hand beside its
            // queue is made again).
            exists: stmt(
                "SELECT to_regclass($1) IS NOT NULL AND EXISTS (SELECT 1 FROM pg_attribute
             WHERE attrelid = to_regclass($2) AND attname = 'renewals_token' AND NOT attisdropped)",
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
            // - The values are [`Acquire::args`]'s ($1-$9), then $10 (a waiter, for `flag`).
            // - {same}: a live hold of ours in the tenure this process holds ($6, with $7 holds)
            //   or written by this very attempt ($5). `attempt_id = $5` means this attempt
            //   already succeeded (its reply was lost): the row is returned as it is. Re-entry
            //   counts from the process's holds ($7 + 1), never from the row alone: a live row of
            //   ours that the process does not track (an acquire whose reply never came) is
            //   taken over as a new tenure instead of being built upon.
            // - "Free" is `expires_at <= now`: a released row keeps the key unavailable until
            //   `available_at` (min_hold, $8 µs) by leaving expires_at there. The lease is at
            //   least min_hold long, so a crashed holder's key waits for min_hold too.
            // - `once` ($9): a key whose last hold succeeded (last_outcome 1) is not taken; the
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
            // $1-$6 as [`Release::args`] lists them; $7 the NOTIFY channel, $8 lazily durable.
            release: stmt(
                "WITH r AS (
    UPDATE {table} SET
        hold_count   = $5,
        owner        = CASE WHEN $5 > 0 THEN owner END,
        -- Free once released, or once min_hold has passed (available_at), whichever is later;
        -- a hold given back unused (no outcome) kept nothing for a body: free at once.
        expires_at   = CASE WHEN $5 > 0 THEN expires_at
                            WHEN $6 IS NULL THEN statement_timestamp()
                            ELSE greatest(statement_timestamp(), available_at) END,
        last_outcome = CASE WHEN $5 > 0 THEN last_outcome
                            WHEN success_token = fencing_token THEN 1
                            ELSE coalesce($6, last_outcome) END,
        finished_at  = CASE WHEN $5 > 0 OR $6 IS NULL THEN finished_at
                            ELSE statement_timestamp() END,
        attempt_id   = $4,
        release_id   = $4,
        release_token = fencing_token
    WHERE lock_key = $1 AND owner = $2 AND fencing_token = $3 AND attempt_id IS DISTINCT FROM $4
      AND expires_at > statement_timestamp()
    RETURNING hold_count, contended, lock_key
)
SELECT hold_count, CASE WHEN hold_count = 0 AND contended THEN pg_notify($7, lock_key)::text END,
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
SET expires_at = greatest(expires_at, least(
        statement_timestamp() + $4::float8 * interval '1 microsecond',
        acquired_at + $5::float8 * interval '1 microsecond')),
    {renewed}
WHERE lock_key = $1 AND owner = $2 AND fencing_token = $3 AND expires_at > statement_timestamp()
RETURNING {us_expires}",
                &t,
            ),

            // Renewal of many leases: one UPDATE joined to the arrays of (key, owner, token, ttl).
            // Each row is updated under its row lock with the same owner/tenure/live check as
            // `extend`; RETURNING names exactly the holds that were extended.
            extend_many: stmt(
                "UPDATE {table} AS l
SET expires_at = greatest(l.expires_at, least(
        statement_timestamp() + r.ttl_us * interval '1 microsecond',
        l.acquired_at + r.cap_us * interval '1 microsecond')),
    {renewed}
FROM unnest($1::text[], $2::text[], $3::int8[], $4::float8[], $5::float8[])
    AS r(k, o, tok, ttl_us, cap_us)
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
            rows_in: stmt(
                &format!(
                    "SELECT {INFO_COLUMNS} FROM {{table}}
WHERE lock_key >= $1 AND lock_key < $2
  AND (owner IS NOT NULL AND expires_at > statement_timestamp()
       OR acquired_at > statement_timestamp() - $3::int8 * interval '1 microsecond')
ORDER BY lock_key"
                ),
                &t,
            ),

            // Single-row UPDATE: frees a live lease whoever holds it; the token is kept so
            // the next owner still gets a larger one.
            force_release: stmt(
                "UPDATE {table} SET owner = NULL, hold_count = 0, expires_at = statement_timestamp(),
    last_outcome = CASE WHEN success_token = fencing_token THEN 1 ELSE 2 END,
    finished_at = statement_timestamp()
WHERE lock_key = $1 AND owner IS NOT NULL AND expires_at > statement_timestamp()
  AND owner = coalesce(nullif($2::text, ''), owner)",
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
            // it on purpose). A row is deleted only once a new row of its key would start above
            // its fencing token (a new row's token is the insert's time in µs): tokens never go
            // back, even for a row taken over many times within its microseconds, or after the
            // server's clock stepped back.
            purge: stmt(
                &format!("DELETE FROM {{table}} WHERE {PURGEABLE} AND fencing_token < {SEED}")
                    .replace("{ran_out}", &ran_out("")),
                &t,
            ),
            // The rows `purge` keeps for their fencing token alone, those a new row of their
            // key would start above within `PURGE_HELD_BACK`: how many µs until it would for
            // every one of them (NULL: none). `Locker::purge` waits that long and purges again.
            // Rows the DELETE would take now count too (0 or less: at once), as the clock may
            // have moved between the DELETE and this read.
            held_back: stmt(
                &format!(
                    "SELECT max(fencing_token) - {SEED} + 1 FROM {{table}}
WHERE {PURGEABLE} AND fencing_token < {SEED} + {HELD_BACK_US}"
                )
                .replace("{ran_out}", &ran_out("")),
                &t,
            ),

            // The fair waiters' queue ($1 key, then the step's values). Each is one statement
            // on one key's rows (primary key (lock_key, ticket)); tickets come from the
            // identity's sequence, so they rise in the order the joins ran and are never
            // reused. The queue orders attempts only: exclusion stays the acquire's alone.
            queue_steps: QueueSql {
                join: stmt(
                "INSERT INTO {table} (lock_key, owner, expires_at)
VALUES ($1, $2, statement_timestamp() + $3::float8 * interval '1 microsecond')
RETURNING ticket",
                    &q,
                ),
                ahead: stmt(
                "SELECT COUNT(*) FROM (SELECT 1 FROM {table}
WHERE lock_key = $1 AND ticket < $2 AND expires_at > statement_timestamp() LIMIT 8) AS ahead",
                    &q,
                ),
                touch: stmt(
                "UPDATE {table} SET expires_at = statement_timestamp() + $4::float8 * interval '1 microsecond'
WHERE lock_key = $1 AND owner = $2 AND ticket = $3",
                    &q,
                ),
                leave: stmt(
                "DELETE FROM {table}
WHERE lock_key = $1 AND (owner = $2 AND ticket = $3 OR expires_at <= statement_timestamp())",
                    &q,
                ),
            },
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
            kind_sql: KindSqls::new(&t),
            batch_sql: Arc::new(batch::Sql::new(&t)),
            settings,
        }
    }
}
