//! MySQL's and MariaDB's statements of one lock table: their texts, each with the argument for
//! its atomicity, named parameters turned positional, built once per table ([`My::new`]).

#[allow(unused_imports)]
use super::*;
use crate::backend::QueueSql;

#[derive(Debug)]
pub(super) struct Statements {
    pub(super) schema: crate::backend::migrations::Schema,
    pub(super) acquire_returning: Numbered,
    pub(super) acquire_last_insert_id: Numbered,
    pub(super) done: SqlStr,
    pub(super) has_queue: SqlStr,
    pub(super) queue_steps: QueueSql<Numbered>,
    pub(super) release: Numbered,
    pub(super) extend: Numbered,
    pub(super) admin: AdminSql,
}

/// The rows a purge deletes, but for their fencing token: free or expired for longer than `?`
/// µs, and not the record of a `once` key whose last hold succeeded.
const PURGEABLE: &str = "expires_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
  AND NOT (once_key AND last_outcome <=> 1 AND NOT {ran_out})";

/// The acquire statement, positional, with the order of its parameters.
pub(super) fn acquire_sql(template: &str, table: &str) -> (SqlStr, Vec<Param>) {
    let text = sql(template, table);
    let (text, order) = positional(text.as_str());
    (AssertSqlSafe(Arc::<str>::from(text)).into_sql_str(), order)
}

pub(super) fn sql(template: &str, table: &str) -> SqlStr {
    let text = expand(template).replace("{table}", table);
    AssertSqlSafe(Arc::<str>::from(text)).into_sql_str()
}

/// `template` with the shared pieces in place (all but the table).
pub(super) fn expand(template: &str) -> String {
    template
        .replace("{take}", TAKE)
        .replace("{acquirable}", ACQUIRABLE)
        .replace("{same}", SAME)
        .replace("{info}", INFO_COLUMNS)
        .replace("{ran_out}", RAN_OUT)
        .replace("{us_now}", US_NOW)
        .replace("{renewed}", &renewed(""))
}

/// The `SET` items of an extension that count it (migration 0007), the table's columns prefixed
/// by `t`: the count of the tenure `renewals_token` names, started again at 1 by a tenure's first
/// extension. MySQL assigns a `SET`'s items from left to right, each seeing the ones before it, so
/// the count is written before the token it compares.
pub(super) fn renewed(t: &str) -> String {
    format!(
        "{t}renewals = IF({t}renewals_token <=> {t}fencing_token, {t}renewals + 1, 1),
    {t}renewals_token = {t}fencing_token"
    )
}

/// The columns `admin::decode` reads, in its order and types (the binary key is valid UTF-8:
/// dblock only ever writes keys that came from a Rust `&str`).
pub(super) const INFO_COLUMNS: &str = "CONVERT(lock_key USING utf8mb4), owner, holder,
       CAST(hold_count AS SIGNED), fencing_token,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01', expires_at),
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01', acquired_at),
       (owner IS NOT NULL AND expires_at > UTC_TIMESTAMP(6)),
       GREATEST(0, (TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) + 999) DIV 1000),
       CAST(IF({ran_out}, 2, last_outcome) AS SIGNED),
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01', IF({ran_out}, expires_at, finished_at)),
       COALESCE(intent_until > UTC_TIMESTAMP(6) AND intent_token <=> fencing_token, 0) <> 0,
       CAST(IF(renewals_token <=> fencing_token, renewals, 0) AS SIGNED)";

/// Acquire, re-entry and takeover as one INSERT ... ON DUPLICATE KEY UPDATE on the primary key.
///
/// Atomic because InnoDB takes the row's exclusive lock for the duplicate check and holds it
/// while the UPDATE part runs, so the "may I take it" decision and the write see one row version.
/// A busy attempt assigns every column its own value (nothing changes).
///
/// Parameters are named (`:key`, `:tenure`, ...) and become `?` in the order they appear (see
/// [`Param`]). `VALUES(col)` is the value this statement would have inserted. Conditions:
/// - {acquirable}: the lease ran out (or was released: "free" is `expires_at <= now`, a release
///   leaves it at the end of min_hold) or the row is ours, and not (`once` and the last hold
///   succeeded; a hold that ran out without a release since is a failure, {ran_out});
/// - {same}: a live hold of ours in the tenure this process holds, or written by this very
///   attempt (its earlier send succeeded, the reply was lost: returned as it is). Re-entry
///   counts from the process's holds; a live row of ours that the process does not track is
///   taken over as a new tenure ({take}: acquirable and not same), never built upon;
/// - {ran_out}: the hold being taken over ended without a release (and without a success
///   committed with its work, `success_token`): recorded as failed.
///
/// Order of assignments (left to right, each sees those before it; all conditions must read old
/// values or values whose change cannot flip them):
/// 1. `hold_count`, `holder`, `acquired_at`, `available_at`, `finished_at`, `once_key`: read only
///    old columns.
/// 2. `last_outcome`: reads its own old value; a change (to "failed") cannot flip {acquirable}.
/// 3. `fencing_token`: reads its own old value and the old `attempt_id`. From here on {ran_out}
///    (which compares `success_token` with the token) may read the new token: only where
///    `{take}` held, and then it can only turn from false to true (the new token is above any
///    `success_token`), which cannot turn {acquirable} false: the later assignments agree.
/// 4. `attempt_id`, `owner`: read the old owner / expires_at.
/// 5. `expires_at` last: reads the NEW owner on purpose (`owner = VALUES(owner)` is then true
///    exactly when this call holds the key).
pub(super) const UPSERT: &str = "INSERT INTO {table}
    (lock_key, owner, hold_count, fencing_token, expires_at, acquired_at, holder, attempt_id,
     available_at, once_key)
{rows}
ON DUPLICATE KEY UPDATE
    hold_count    = IF({same}, IF(attempt_id <=> VALUES(attempt_id), hold_count, :held + 1),
                       IF({acquirable}, 1, hold_count)),
    holder        = IF({take}, VALUES(holder), holder),
    acquired_at   = IF({take}, UTC_TIMESTAMP(6), acquired_at),
    available_at  = IF({take}, VALUES(available_at), available_at),
    finished_at   = IF({take} AND {ran_out}, expires_at, finished_at),
    once_key      = IF({acquirable} AND :once, 1, once_key),
    last_outcome  = IF({take} AND {ran_out}, 2, last_outcome),
    fencing_token = IF({take}, GREATEST(fencing_token + 1, {us_now}), fencing_token),
    attempt_id    = IF({acquirable}, VALUES(attempt_id), attempt_id),
    owner         = IF({acquirable}, VALUES(owner), owner),
    expires_at    = {expires}";

/// The new row's values after its key: `{attempt}` is the attempt id.
pub(super) const NEW_ROW: &str =
    ":owner, 1, {token}, UTC_TIMESTAMP(6) + INTERVAL GREATEST(:ttl, :min_hold) MICROSECOND,
        UTC_TIMESTAMP(6),
        :holder, {attempt},
        IF(:min_hold > 0, UTC_TIMESTAMP(6) + INTERVAL :min_hold MICROSECOND, NULL), :once";

/// [`UPSERT`] for one key.
pub(super) fn upsert_one() -> String {
    UPSERT.replace(
        "{rows}",
        &format!("VALUES (:key, {NEW_ROW})").replace("{attempt}", ":attempt"),
    )
}

/// [`UPSERT`] for `n` keys at once (MariaDB, with RETURNING): an `INSERT ... SELECT` from the
/// keys (with each one's attempt id, tenure and holds), which selects nothing — so writes
/// nothing — if any key is held by another owner or done for `once` in its view (InnoDB reads
/// it as a consistent read at READ COMMITTED: no locks). Rows are inserted or updated in key
/// order (bytes); every existing row then goes through the one-key statement's `ON DUPLICATE
/// KEY UPDATE` under its exclusive lock, reading that key's values from the derived table.
pub(super) fn upsert_many(n: usize) -> String {
    let rows = (0..n)
        .map(|_| "SELECT :row_key AS k, :row_attempt AS attempt, :row_tenure AS tenure, :row_held AS held")
        .collect::<Vec<_>>()
        .join(" UNION ALL ");
    let gate = vec![":gate_key"; n].join(", ");
    let select = format!(
        "SELECT r.k, {NEW_ROW}
FROM ({rows}) AS r
WHERE NOT EXISTS (
    SELECT 1 FROM {{table}} AS b WHERE b.lock_key IN ({gate})
      AND ((b.expires_at > UTC_TIMESTAMP(6) AND NOT (b.owner <=> :owner))
           OR (:once AND b.last_outcome <=> 1
               AND NOT (b.owner IS NOT NULL AND b.expires_at <= UTC_TIMESTAMP(6)
                        AND NOT (b.success_token <=> b.fencing_token)))))
ORDER BY CAST(r.k AS BINARY)"
    )
    .replace("{attempt}", "r.attempt");
    expand(&UPSERT.replace("{rows}", &select))
        .replace(":held", "r.held")
        .replace(":tenure", "r.tenure")
}

pub(super) const TAKE: &str = "({acquirable} AND NOT {same})";
pub(super) const SAME: &str = "(owner <=> VALUES(owner) AND expires_at > UTC_TIMESTAMP(6)
           AND (attempt_id <=> VALUES(attempt_id) OR fencing_token <=> :tenure))";
pub(super) const ACQUIRABLE: &str = "((expires_at <= UTC_TIMESTAMP(6) OR owner <=> VALUES(owner))
           AND NOT (:once AND last_outcome <=> 1 AND NOT {ran_out}))";
pub(super) const RAN_OUT: &str = "(owner IS NOT NULL AND expires_at <= UTC_TIMESTAMP(6)
           AND NOT (success_token <=> fencing_token))";

/// A named parameter of the several-keys acquire statement ([`upsert_many`]; the one-key
/// statements are [`Numbered::named`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Param {
    Key,
    Owner,
    Ttl,
    Holder,
    Attempt,
    MinHold,
    Held,
    Tenure,
    Once,
    /// Several keys: the next key's key, attempt id, tenure, holds; the next key of the gate.
    RowKey,
    RowAttempt,
    RowTenure,
    RowHeld,
    GateKey,
}

pub(super) const PARAMS: [(&str, Param); 14] = [
    (":row_key", Param::RowKey),
    (":row_attempt", Param::RowAttempt),
    (":row_tenure", Param::RowTenure),
    (":row_held", Param::RowHeld),
    (":gate_key", Param::GateKey),
    (":key", Param::Key),
    (":owner", Param::Owner),
    (":ttl", Param::Ttl),
    (":holder", Param::Holder),
    (":attempt", Param::Attempt),
    (":min_hold", Param::MinHold),
    (":held", Param::Held),
    (":tenure", Param::Tenure),
    (":once", Param::Once),
];

/// The acquire statement `text` with its parameters bound in `order`: for one key `p`, or for
/// the keys of `all` row after row (`p`, the first of them, gives what they share: owner,
/// lease, holder, min_hold, once).
pub(super) fn bind<'q>(
    text: &SqlStr,
    order: &[Param],
    p: &'q Acquire<'q>,
    all: &'q [Acquire<'q>],
) -> sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments> {
    let (mut row, mut gate) = (all.iter(), all.iter());
    let mut current = p;
    let mut q = sqlx::query(text.clone());
    for param in order {
        q = match param {
            Param::Key => q.bind(p.key),
            Param::Owner => q.bind(p.owner),
            Param::Ttl => q.bind(p.ttl_us),
            Param::Holder => q.bind(p.holder),
            Param::Attempt => q.bind(p.attempt),
            Param::MinHold => q.bind(p.min_hold_us),
            Param::Held => q.bind(i64::from(p.held)),
            Param::Tenure => q.bind(p.tenure),
            Param::Once => q.bind(p.once),
            Param::RowKey => {
                current = row.next().unwrap_or(p);
                q.bind(current.key)
            }
            Param::RowAttempt => q.bind(current.attempt),
            Param::RowTenure => q.bind(current.tenure),
            Param::RowHeld => q.bind(i64::from(current.held)),
            Param::GateKey => q.bind(gate.next().unwrap_or(p).key),
        };
    }
    q
}

/// A statement written with numbered placeholders (`$1` to `$9`, as on the other backends, in
/// the order its [`Arg`] list gives), sent with MySQL's `?`s: each `$n` becomes a `?` and
/// the list is bound in the order the `?`s stand in.
#[derive(Debug)]
pub(super) struct Numbered {
    sql: SqlStr,
    /// For each `?` in turn, the index of its value in the list.
    order: Vec<usize>,
}

impl Numbered {
    pub(super) fn new(template: &str, table: &str) -> Self {
        const NUMBERS: [(&str, usize); 9] = [
            ("$1", 0),
            ("$2", 1),
            ("$3", 2),
            ("$4", 3),
            ("$5", 4),
            ("$6", 5),
            ("$7", 6),
            ("$8", 7),
            ("$9", 8),
        ];
        let (text, order) =
            placeholders(&expand(template).replace("{table}", table), '$', &NUMBERS);
        Numbered {
            sql: AssertSqlSafe(Arc::<str>::from(text)).into_sql_str(),
            order,
        }
    }

    /// A statement written with the acquire's named parameters, which stand for the values of
    /// [`Acquire::args`](crate::backend::Acquire::args) (`:key`, `:owner`, `:ttl`, `:holder`,
    /// `:attempt`, `:tenure`, `:held`, `:min_hold`, `:once`: `$1` to `$9`).
    pub(super) fn named(template: &str, table: &str) -> Self {
        const NAMES: [(&str, usize); 9] = [
            (":key", 0),
            (":owner", 1),
            (":ttl", 2),
            (":holder", 3),
            (":attempt", 4),
            (":tenure", 5),
            (":held", 6),
            (":min_hold", 7),
            (":once", 8),
        ];
        let (text, order) = placeholders(&expand(template).replace("{table}", table), ':', &NAMES);
        Numbered {
            sql: AssertSqlSafe(Arc::<str>::from(text)).into_sql_str(),
            order,
        }
    }

    /// The statement with `args` bound where its placeholders stand; a placeholder past the
    /// list is an encoding error.
    pub(super) fn bound<'q>(
        &self,
        args: &[crate::backend::Arg<'q>],
    ) -> sqlx::Result<sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments>> {
        let ordered = self
            .order
            .iter()
            .map(|&i| args.get(i).copied())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                sqlx::Error::Encode("a placeholder past the statement's values".into())
            })?;
        crate::backend::bound(self.sql.clone(), &ordered)
    }
}

/// `text` with its named parameters replaced by `?`, and their order.
pub(super) fn positional(text: &str) -> (String, Vec<Param>) {
    placeholders(text, ':', &PARAMS)
}

/// `text` with each placeholder of `names` (each begins with `mark`, and is not followed by a
/// letter, digit or `_`) replaced by MySQL's `?`, and what each `?` stands for, in order. Text
/// in single quotes and `--` comments (to the end of the line) is copied as written: a `$6` in
/// a comment is no placeholder (one was, once, and the statement's binds went wrong).
pub(super) fn placeholders<P: Copy>(
    text: &str,
    mark: char,
    names: &[(&str, P)],
) -> (String, Vec<P>) {
    let mut out = String::with_capacity(text.len());
    let mut order = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find([mark, '\'', '-']) {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        // What is copied as it is: a quoted string, a comment, or one character.
        let verbatim = if let Some(quoted) = tail.strip_prefix('\'') {
            1 + quoted.find('\'').map_or(quoted.len(), |end| end + 1)
        } else if tail.starts_with("--") {
            tail.find('\n').unwrap_or(tail.len())
        } else if let Some((name, p)) = names.iter().find(|(name, _)| {
            tail.starts_with(name)
                && !tail[name.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
        }) {
            out.push('?');
            order.push(*p);
            rest = &tail[name.len()..];
            continue;
        } else {
            tail.chars().next().map_or(0, char::len_utf8)
        };
        out.push_str(&tail[..verbatim]);
        rest = &tail[verbatim..];
    }
    out.push_str(rest);
    (out, order)
}

impl My {
    pub(crate) fn new(pool: Conns<MySql>, table: &str) -> Self {
        use crate::backend::migrations::{self, Schema};
        let t = quote_ident(table, '`');
        let q = quote_ident(&crate::backend::queue_table(table), '`');
        let statements = Statements {
            schema: Schema::new(&migrations::MYSQL, '`', sql, &t, &q),
            // Both tables with their newest columns (a lock table dropped by hand beside its
            // queue is made again).
            has_queue: sql(
                &format!(
                    "SELECT t.renewals_token, q.ticket FROM {{table}} AS t, {q} AS q LIMIT 0"
                ),
                &t,
            ),
            // The fair waiters' queue: one statement each on one key's rows (primary key
            // (lock_key, ticket)). Tickets are the AUTO_INCREMENT's, in the order the inserts
            // ran (on Galera, each node's own series interleaved: arrival order per node, only
            // roughly across nodes). The queue orders attempts only: exclusion stays the
            // acquire's alone. sqlx sets CLIENT_FOUND_ROWS: a touch counts the matched row.
            queue_steps: QueueSql {
                join: Numbered::new(
                "INSERT INTO {table} (lock_key, owner, expires_at)
VALUES ($1, $2, UTC_TIMESTAMP(6) + INTERVAL $3 MICROSECOND)",
                    &q,
                ),
                ahead: Numbered::new(
                "SELECT CAST(COUNT(*) AS SIGNED) FROM (SELECT 1 FROM {table}
WHERE lock_key = $1 AND ticket < $2 AND expires_at > UTC_TIMESTAMP(6) LIMIT 8) AS ahead",
                    &q,
                ),
                touch: Numbered::new(
                "UPDATE {table} SET expires_at = UTC_TIMESTAMP(6) + INTERVAL $4 MICROSECOND
WHERE lock_key = $1 AND owner = $2 AND ticket = $3",
                    &q,
                ),
                leave: Numbered::new(
                "DELETE FROM {table}
WHERE lock_key = $1 AND (owner = $2 AND ticket = $3 OR expires_at <= UTC_TIMESTAMP(6))",
                    &q,
                ),
            },
            // MariaDB: the row as it is after the statement comes back with RETURNING.
            acquire_returning: Numbered::named(
                &(upsert_one()
                    .replace("{token}", "{us_now}")
                    .replace(
                        "{expires}",
                        "IF(owner = VALUES(owner), GREATEST(expires_at, VALUES(expires_at)), expires_at)",
                    )
                    + "
RETURNING owner <=> :owner, hold_count, fencing_token,
          TIMESTAMPDIFF(MICROSECOND, '1970-01-01', expires_at),
          GREATEST(0, (TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) + 999) DIV 1000),
          (:once AND last_outcome <=> 1 AND NOT (owner <=> :owner)),
          TIMESTAMPDIFF(MICROSECOND, '1970-01-01', finished_at)"),
                &t,
            ),
            // MySQL 8 (no RETURNING): the outcome travels in the OK packet's last_insert_id.
            // sqlx sets CLIENT_FOUND_ROWS, so rows_affected cannot tell busy from inserted.
            // Inserted: LAST_INSERT_ID(token + 1 << 52) inside VALUES (the column keeps the token).
            // Updated: the last assignment sets it to count << 52 | token when acquired, and to 0
            // when busy (the VALUES call ran before the duplicate check and must be overwritten).
            acquire_last_insert_id: Numbered::named(
                &upsert_one()
                    .replace(
                        "{token}",
                        "LAST_INSERT_ID({us_now} + 4503599627370496) - 4503599627370496",
                    )
                    .replace(
                        "{expires}",
                        "IF(owner = VALUES(owner),
                       IF(LAST_INSERT_ID(hold_count * 4503599627370496 + fencing_token) > 0,
                          GREATEST(expires_at, VALUES(expires_at)), NULL),
                       IF(LAST_INSERT_ID(0) = 0, expires_at, NULL))",
                    ),
                &t,
            ),
            // After a busy `once` attempt on the MySQL 8 path (which learns nothing else): done?
            done: sql(
                "SELECT last_outcome <=> 1 AND NOT {ran_out},
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01', finished_at)
FROM {table} WHERE lock_key = ?",
                &t,
            ),
            // Single-row UPDATE by primary key under the row's exclusive lock. hold_count is
            // assigned first, to the count the process has left (absolute: a stray resend cannot
            // count down twice); owner, the outcome and expires_at then read its NEW value on
            // purpose. The count comes back as last_insert_id; rows_affected = 0: not held.
            release: Numbered::new(
                "UPDATE {table} SET
    hold_count   = LAST_INSERT_ID($5),
    owner        = IF(hold_count = 0, NULL, owner),
    -- A success committed with the work (`success_token`) stands, whatever the release says.
    last_outcome = IF(hold_count = 0,
                      IF(success_token <=> fencing_token, 1, COALESCE($6, last_outcome)),
                      last_outcome),
    finished_at  = IF(hold_count = 0 AND $6 IS NOT NULL, UTC_TIMESTAMP(6), finished_at),
    -- Free once released, or once min_hold has passed (available_at), whichever is later; a
    -- hold given back unused (no outcome) kept nothing for a body: free at once.
    expires_at   = IF(hold_count = 0,
                      IF($6 IS NULL, UTC_TIMESTAMP(6),
                         GREATEST(UTC_TIMESTAMP(6), COALESCE(available_at, UTC_TIMESTAMP(6)))),
                      expires_at),
    attempt_id   = $4,
    -- The release id just assigned, and this tenure: kept by every acquire (see `last_write`).
    release_id   = attempt_id,
    release_token = fencing_token
WHERE lock_key = $1 AND owner = $2 AND fencing_token = $3 AND NOT (attempt_id <=> $4)
  AND expires_at > UTC_TIMESTAMP(6)",
                &t,
            ),
            // Single-row UPDATE, owner- and tenure-checked; the new lease end (read after it was
            // assigned) comes back as last_insert_id. Never shortens a lease.
            extend: Numbered::new(
                "UPDATE {table} SET
    expires_at    = GREATEST(expires_at, LEAST(UTC_TIMESTAMP(6) + INTERVAL $4 MICROSECOND,
                                           acquired_at + INTERVAL $5 MICROSECOND)),
    fencing_token = IF(LAST_INSERT_ID(TIMESTAMPDIFF(MICROSECOND, '1970-01-01', expires_at)) > 0,
                       fencing_token, fencing_token),
    {renewed}
WHERE lock_key = $1 AND owner = $2 AND fencing_token = $3 AND expires_at > UTC_TIMESTAMP(6)",
                &t,
            ),
            admin: AdminSql {
                last_write: sql(
                    "SELECT attempt_id, fencing_token, release_id, release_token FROM {table}
WHERE lock_key = ?",
                    &t,
                ),
                inspect: sql("SELECT {info} FROM {table} WHERE lock_key = ?", &t),
                held: sql(
                    "SELECT {info} FROM {table}
WHERE owner IS NOT NULL AND expires_at > UTC_TIMESTAMP(6) ORDER BY lock_key",
                    &t,
                ),
                rows_in: sql(
                    "SELECT {info} FROM {table}
WHERE lock_key >= ? AND lock_key < ?
  AND (owner IS NOT NULL AND expires_at > UTC_TIMESTAMP(6)
       OR acquired_at > UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND)
ORDER BY lock_key",
                    &t,
                ),
                force_release: sql(
                    "UPDATE {table} SET hold_count = 0, owner = NULL, expires_at = UTC_TIMESTAMP(6),
    last_outcome = IF(success_token <=> fencing_token, 1, 2), finished_at = UTC_TIMESTAMP(6)
WHERE lock_key = ? AND owner IS NOT NULL AND expires_at > UTC_TIMESTAMP(6)
  AND owner = COALESCE(NULLIF(?, ''), owner)",
                    &t,
                ),
                reset: sql(
                    "UPDATE {table} SET last_outcome = NULL, finished_at = NULL,
    success_token = NULL, once_key = 0, expires_at = LEAST(expires_at, UTC_TIMESTAMP(6))
WHERE lock_key = ? AND NOT (owner IS NOT NULL AND expires_at > UTC_TIMESTAMP(6))",
                    &t,
                ),
                // In batches (admin::PURGE_BATCH), so a big purge never holds many row locks. A
                // `once` key whose last hold succeeded is kept (`reset` forgets it on purpose).
                // A row is deleted only once a new row of its key would start above its fencing
                // token (a new row's token is the insert's time in µs): tokens never go back.
                purge: sql(
                    &format!(
                        "DELETE FROM {{table}} WHERE {PURGEABLE} AND fencing_token < {{us_now}} LIMIT 1000"
                    ),
                    &t,
                ),
                // As PostgreSQL's: rows the DELETE would take now count too (0 or less).
                held_back: sql(
                    &format!(
                        "SELECT CAST(MAX(fencing_token) - {{us_now}} + 1 AS SIGNED) FROM {{table}}
WHERE {PURGEABLE} AND fencing_token < {{us_now}} + {}",
                        crate::timing::PURGE_HELD_BACK.as_micros()
                    ),
                    &t,
                ),
            },
        };
        My {
            pool,
            kind_sql: KindSqls::new(&t),
            table: t.into(),
            sql: Arc::new(statements),
            returning: Arc::new(OnceCell::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbered_placeholders_become_question_marks_in_their_order() {
        let n = Numbered::new(
            "SELECT $2, ':x', $1 FROM {table} WHERE a = $2 AND b = $10",
            "t",
        );
        // `$10` is no placeholder of $1..$9: left as written, as any other text.
        assert_eq!(
            n.sql.as_str(),
            "SELECT ?, ':x', ? FROM t WHERE a = ? AND b = $10"
        );
        assert_eq!(n.order, [1, 0, 1]);
        let (text, order) = placeholders("a = :key AND b = :keys AND c = :owner", ':', &PARAMS);
        assert_eq!(text, "a = ? AND b = :keys AND c = ?");
        assert_eq!(order, [Param::Key, Param::Owner]);
    }

    #[test]
    fn placeholders_in_quotes_and_comments_are_text() {
        let n = Numbered::new(
            "SET a = $1, -- ($6 NULL: as written)\n b = '$2 it''s', c = 5 - $3 -- $4",
            "t",
        );
        assert_eq!(
            n.sql.as_str(),
            "SET a = ?, -- ($6 NULL: as written)\n b = '$2 it''s', c = 5 - ? -- $4"
        );
        assert_eq!(n.order, [0, 2]);
    }

    #[test]
    fn the_one_key_acquire_reads_each_of_its_nine_values_and_no_other_name() {
        let n = Numbered::named(
            &upsert_one()
                .replace("{token}", "{us_now}")
                .replace("{expires}", "expires_at"),
            "t",
        );
        let mut seen = n.order.clone();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen, (0..9).collect::<Vec<_>>(), "{}", n.sql.as_str());
        assert_eq!(n.sql.as_str().matches('?').count(), n.order.len());
        let text = n.sql.as_str();
        for (at, _) in text.match_indices(':') {
            let next = text[at + 1..].chars().next();
            assert!(
                !next.is_some_and(|c| c.is_ascii_alphabetic() || c == '_'),
                "a name left at {at}: {text}"
            );
        }
    }

    #[test]
    fn a_placeholder_past_the_values_is_an_error_not_a_panic() {
        let n = Numbered::new("SELECT $3", "t");
        let args = [crate::backend::Arg::Int8(1)];
        assert!(matches!(n.bound(&args), Err(sqlx::Error::Encode(_))));
    }
}
