//! Shared (read) locks on SQLite: the readers' statements and the writer's intent (the model is
//! in `backend/read.rs`). Each is one statement, run under the database's write lock: nothing
//! else writes between its read of the row and its write. Times in ms, as the lock's (the
//! values come in µs, [`ReadAcquire::args`], and are rounded up in the texts).

use sqlx::sqlite::{Sqlite, SqliteConnection};
use sqlx::{AssertSqlSafe, Row, SqlSafeStr, SqlStr};

use super::{Lite, NOW};
use crate::backend::bound;
use crate::backend::kind_sql::KindSql;
use crate::backend::read::{
    Intent, ReadAcquire, ReadAttempt, ReadRelease, ReadReleased, Withdraw, READERS,
};
use crate::backend::Grant;

/// The statements of one table.
#[derive(Debug)]
pub(crate) struct Sql {
    acquire: SqlStr,
    release: SqlStr,
    gone: SqlStr,
    intent: SqlStr,
    withdraw: SqlStr,
}

const JOINING: &str = "(l.owner = '(readers)' AND l.expires_at > {now})";
const SEEN: &str = "(instr(coalesce(l.readers, ''), ',' || $4 || ',') > 0)";
const INTENT: &str = "coalesce(l.intent_until > {now} AND l.intent_token = l.fencing_token, 0)";

/// A reader's acquire: `$1` key, `$2` holder, `$3` ttl µs (rounded up to the table's ms), `$4`
/// the hold's id, `$5` the read tenure the owner already reads in (or NULL). Inserts the row, or on
/// conflict joins the live read phase (unless a writer's intent holds new readers back) or starts a
/// new one on a row whose lease ended; `WHERE` false (busy) returns no row. All `SET` expressions
/// read the old row.
const ACQUIRE: &str = "INSERT INTO {table} AS l
    (lock_key, owner, hold_count, fencing_token, expires_at, acquired_at, holder, attempt_id,
     readers)
VALUES ($1, '(readers)', 1, {now} * 1000, {now} + ($3 + 999) / 1000, {now}, $2, $4, ',' || $4 || ',')
ON CONFLICT (lock_key) DO UPDATE SET
    hold_count    = CASE WHEN {joining} THEN l.hold_count + CASE WHEN {seen} THEN 0 ELSE 1 END
                         ELSE 1 END,
    fencing_token = CASE WHEN {joining} THEN l.fencing_token
                         ELSE max(l.fencing_token + 1, excluded.fencing_token) END,
    acquired_at   = CASE WHEN {joining} THEN l.acquired_at ELSE {now} END,
    holder        = CASE WHEN {joining} THEN l.holder ELSE excluded.holder END,
    expires_at    = CASE WHEN {joining} THEN max(l.expires_at, {now} + ($3 + 999) / 1000) ELSE {now} + ($3 + 999) / 1000 END,
    last_outcome  = CASE WHEN NOT {joining} AND {ran_out_l} THEN 2 ELSE l.last_outcome END,
    finished_at   = CASE WHEN NOT {joining} AND {ran_out_l} THEN l.expires_at ELSE l.finished_at END,
    available_at  = CASE WHEN {joining} THEN l.available_at END,
    readers       = CASE WHEN {joining}
                         THEN CASE WHEN {seen} THEN l.readers ELSE l.readers || $4 || ',' END
                         ELSE ',' || $4 || ',' END,
    attempt_id    = excluded.attempt_id,
    owner         = '(readers)'
WHERE CASE WHEN {joining} THEN {seen} OR $5 IS l.fencing_token OR NOT {intent}
           ELSE l.expires_at <= {now} AND NOT {intent} END
RETURNING hold_count, fencing_token, expires_at * 1000";

/// A reader's release: `$1` key, `$2` read tenure, `$3` the hold's id, `$4` outcome (when it
/// ends the phase). The last reader frees the row.
const RELEASE: &str = "UPDATE {table} SET
    hold_count   = hold_count - 1,
    owner        = CASE WHEN hold_count > 1 THEN owner END,
    expires_at   = CASE WHEN hold_count > 1 THEN expires_at ELSE {now} END,
    readers      = replace(readers, ',' || $3 || ',', ','),
    last_outcome = CASE WHEN hold_count > 1 THEN last_outcome ELSE coalesce($4, last_outcome) END,
    finished_at  = CASE WHEN hold_count > 1 OR $4 IS NULL THEN finished_at ELSE {now} END,
    release_id   = $3,
    release_token = fencing_token
WHERE lock_key = $1 AND owner = '(readers)' AND fencing_token = $2 AND expires_at > {now}
  AND instr(readers, ',' || $3 || ',') > 0
RETURNING hold_count";

/// After a release that matched nothing: is the read tenure live without this id (released
/// before, by a send whose reply was lost)?
const GONE: &str = "SELECT 1 FROM {table} AS l WHERE l.lock_key = $1 AND l.owner = '(readers)'
   AND l.fencing_token = $2 AND l.expires_at > {now}
   AND instr(coalesce(l.readers, ''), ',' || $3 || ',') = 0";

const INTENT_SQL: &str = "UPDATE {table} AS l SET
    intent_until = {now} + ($3 + 999) / 1000, intent_token = l.fencing_token, intent_owner = $2
WHERE l.lock_key = $1 AND {joining} AND (l.intent_owner IS $2 OR NOT {intent})";

const WITHDRAW: &str =
    "UPDATE {table} SET intent_until = NULL WHERE lock_key = $1 AND intent_owner = $2";

fn sql(template: &str, table: &str) -> SqlStr {
    let text = template
        .replace("{joining}", JOINING)
        .replace("{seen}", SEEN)
        .replace("{intent}", INTENT)
        .replace("{ran_out_l}", &super::ran_out("l."))
        .replace("{now}", NOW)
        .replace("{table}", table);
    AssertSqlSafe(text).into_sql_str()
}

impl KindSql for Sql {
    fn build(table: &str) -> Sql {
        debug_assert!(ACQUIRE.contains(READERS));
        Sql {
            acquire: sql(ACQUIRE, table),
            release: sql(RELEASE, table),
            gone: sql(GONE, table),
            intent: sql(INTENT_SQL, table),
            withdraw: sql(WITHDRAW, table),
        }
    }
}

async fn acquire(
    lite: &Lite,
    conn: &mut SqliteConnection,
    a: &ReadAcquire<'_>,
) -> sqlx::Result<ReadAttempt> {
    let texts = lite.kind_sql.get::<Sql>();
    let q = bound::<Sqlite>(texts.acquire.clone(), &a.args())?;
    let row = q.fetch_optional(&mut *conn).await?;
    Ok(match row {
        Some(row) => ReadAttempt::Granted(Grant::at(&row, 0)?),
        None => ReadAttempt::Busy { retry_after: None },
    })
}

async fn release(
    lite: &Lite,
    conn: &mut SqliteConnection,
    r: &ReadRelease<'_>,
) -> sqlx::Result<ReadReleased> {
    let texts = lite.kind_sql.get::<Sql>();
    let args = r.args();
    let row = bound::<Sqlite>(texts.release.clone(), &args)?
        .fetch_optional(&mut *conn)
        .await?;
    let left: Option<i64> = row.map(|r| r.try_get(0)).transpose()?;
    Ok(match left {
        Some(0) => ReadReleased::Free,
        Some(n) => ReadReleased::StillHeld(n.max(0) as u32),
        None => {
            // The same values; the text reads `$1`-`$3`.
            let gone = bound::<Sqlite>(texts.gone.clone(), &args[..3])?
                .fetch_optional(&mut *conn)
                .await?;
            if gone.is_some() {
                ReadReleased::Gone
            } else {
                ReadReleased::NotHeld
            }
        }
    })
}

async fn intent(lite: &Lite, conn: &mut SqliteConnection, i: &Intent<'_>) -> sqlx::Result<bool> {
    let texts = lite.kind_sql.get::<Sql>();
    let done = bound::<Sqlite>(texts.intent.clone(), &i.args())?
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected() > 0)
}

async fn withdraw(lite: &Lite, conn: &mut SqliteConnection, w: &Withdraw<'_>) -> sqlx::Result<()> {
    let texts = lite.kind_sql.get::<Sql>();
    bound::<Sqlite>(texts.withdraw.clone(), &w.args())?
        .execute(&mut *conn)
        .await?;
    Ok(())
}

crate::backend::runs! {
    super::OnSqlite, sqlite, super::Lite, sqlx::SqliteConnection;
    ReadAcquire<'_> => acquire,
    ReadRelease<'_> => release,
    Intent<'_> => intent,
    Withdraw<'_> => withdraw,
}
