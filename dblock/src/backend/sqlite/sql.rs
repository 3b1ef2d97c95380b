//! SQLite's statements of one lock table: their texts, built once per table ([`Lite::new`]),
//! each with the argument for its atomicity where it is made.

#[allow(unused_imports)]
use super::*;

#[derive(Debug)]
pub(super) struct Statements {
    pub(super) schema: crate::backend::migrations::Schema,
    /// A read that fails unless the columns of the schema's `columns` of the same place are
    /// there.
    pub(super) has_columns: [SqlStr; 4],
    pub(super) queue_steps: QueueSql<SqlStr>,
    pub(super) done: SqlStr,
    pub(super) clock_check: SqlStr,
    pub(super) acquire: SqlStr,
    pub(super) release: SqlStr,
    pub(super) extend: SqlStr,
    pub(super) admin: AdminSql,
}

/// The rows a purge deletes, but for their fencing token: free or expired for longer than `$1`
/// µs (times here are in ms), and not the record of a `once` key whose last hold succeeded.
const PURGEABLE: &str = "expires_at <= {now} - $1 / 1000
  AND NOT (once_key AND last_outcome IS 1 AND NOT {ran_out})";

/// The acquire statement's "a live hold of ours in the tenure this process holds ({tenure}), or
/// one written by this very attempt"; never NULL.
pub(super) const SAME: &str = "coalesce(l.owner = excluded.owner AND l.expires_at > {now}
                   AND (l.attempt_id = excluded.attempt_id OR l.fencing_token = {tenure}), 0)";

/// The `ON CONFLICT` part of the acquire statements (one key, several keys): `{tenure}` and
/// `{held}` are what the process holds of the key.
pub(super) const TAKE_OVER: &str = "ON CONFLICT (lock_key) DO UPDATE SET
    hold_count    = CASE WHEN {same}
                         THEN CASE WHEN l.attempt_id = excluded.attempt_id
                                   THEN l.hold_count ELSE {held} + 1 END
                         ELSE 1 END,
    fencing_token = CASE WHEN {same} THEN l.fencing_token
                         ELSE max(l.fencing_token + 1, excluded.fencing_token) END,
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

pub(super) fn sql(template: &str, table: &str) -> SqlStr {
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

/// The columns `admin::decode` reads, in its order and types.
const INFO_COLUMNS: &str = "lock_key, owner, holder, hold_count, fencing_token,
       expires_at * 1000, acquired_at * 1000,
       (owner IS NOT NULL AND expires_at > {now}),
       max(0, expires_at - {now}),
       CASE WHEN {ran_out} THEN 2 ELSE last_outcome END,
       CASE WHEN {ran_out} THEN expires_at ELSE finished_at END * 1000,
       coalesce(intent_until > {now} AND intent_token = fencing_token, 0),
       CASE WHEN renewals_token = fencing_token THEN renewals ELSE 0 END";

impl Lite {
    pub(crate) fn new(pool: Conns<Sqlite>, table: &str) -> Self {
        let t = quote_ident(table, '"');
        let q = quote_ident(&crate::backend::queue_table(table), '"');
        let statements = Statements {
            schema: crate::backend::migrations::Schema::new(&crate::backend::migrations::SQLITE, '"', sql, &t, &q),
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
            // The values are [`Acquire::args`]'s; the ttl ($3) and min_hold ($8) come in µs and
            // are rounded up to the table's milliseconds here, as the extension's are.
            // "Free" is `expires_at <= now`: a release leaves expires_at at `available_at` (the
            // acquisition + min_hold, $8) when that is later, and the lease is at least
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
VALUES ($1, $2, 1, {now} * 1000, {now} + max(($3 + 999) / 1000, ($8 + 999) / 1000), {now}, $4, $5,
        CASE WHEN $8 > 0 THEN {now} + ($8 + 999) / 1000 END, $9)
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
    expires_at   = CASE WHEN $5 > 0 THEN expires_at WHEN $6 IS NULL THEN {now}
                        ELSE max({now}, coalesce(available_at, 0)) END,
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
WHERE lock_key = $1 AND owner IS NOT NULL AND expires_at > {now}
  AND owner = coalesce(nullif($2, ''), owner)",
                    &t,
                ),
                reset: sql(
                    "UPDATE {table} SET last_outcome = NULL, finished_at = NULL,
    success_token = NULL, once_key = 0, expires_at = min(expires_at, {now})
WHERE lock_key = $1 AND NOT (owner IS NOT NULL AND expires_at > {now})",
                    &t,
                ),
                // $1 is in µs; times here are in ms. A `once` key whose last hold succeeded is
                // kept (`reset` forgets it on purpose). A row is deleted only once a new row of
                // its key would start above its fencing token (a new row's token is the insert's
                // millisecond × 1000): tokens never go back, even when the row was released and
                // purged within one millisecond, or taken over many times within its own.
                purge: sql(
                    &format!("DELETE FROM {{table}} WHERE {PURGEABLE} AND fencing_token < {{now}} * 1000"),
                    &t,
                ),
                // In µs, whole milliseconds: the next millisecond after the newest such token's.
                // Rows the DELETE would take now count too (0 or less: at once): the clock
                // may have turned between the DELETE and this read.
                held_back: sql(
                    &format!(
                        "SELECT (MAX(fencing_token) / 1000 + 1 - {{now}}) * 1000 FROM {{table}}
WHERE {PURGEABLE} AND fencing_token < {{now}} * 1000 + {}",
                        crate::timing::PURGE_HELD_BACK.as_micros()
                    ),
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
