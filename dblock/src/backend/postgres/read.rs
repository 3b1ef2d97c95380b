//! Shared (read) locks on PostgreSQL: the readers' statements and the writer's intent (the
//! model is in `backend/read.rs`). Each is one statement on the key's row, at READ COMMITTED:
//! an UPDATE by primary key takes the row lock and, when it had to wait for another writer of
//! the row, re-checks its WHERE against the committed row version. Every condition below reads
//! only the row's own columns, so that re-check sees everything the decision depends on.

use sqlx::postgres::{PgConnection, PgRow};
use sqlx::Row;

use super::{stmt, Arg, Changed, Pg, Stmt};
use crate::backend::kind_sql::KindSql;
use crate::backend::read::{
    Intent, ReadAcquire, ReadAttempt, ReadRelease, ReadReleased, Withdraw, READERS,
};
use crate::backend::Grant;

/// The statements of one table.
#[derive(Debug)]
pub(crate) struct Sql {
    acquire: Stmt,
    acquire_waiting: Stmt,
    release: Stmt,
    intent: Stmt,
    withdraw: Stmt,
}

/// A live read phase ("join"), else a new one on a free row.
const JOINING: &str = "(l.owner = '(readers)' AND l.expires_at > statement_timestamp())";
/// This hold's id is among the phase's readers: its earlier send took effect.
const SEEN: &str = "(strpos(coalesce(l.readers, ''), ',' || $4::int8 || ',') > 0)";
/// A writer waits behind this read tenure.
const INTENT: &str = "coalesce(l.intent_until > statement_timestamp()
                      AND l.intent_token = l.fencing_token, false)";
const LEASE: &str = "statement_timestamp() + $3::float8 * interval '1 microsecond'";

/// A reader's acquire: `$1` key, `$2` holder, `$3` ttl µs, `$4` the hold's id, `$5` the read
/// tenure the owner already reads in (or NULL), `$6` a waiter whose LISTEN is in place.
///
/// - `upd` joins a live read phase (its id added, its lease end pushed out, the count up) —
///   unless a writer's intent is live and this is no re-entry — or starts a new phase on a row
///   that is free or whose lease ran out (a new read tenure; a writer's hold that ran out
///   without a release is recorded as failed, as the lock's takeover does). A resend whose id
///   is already listed changes nothing and is answered as granted.
/// - `flag`: a waiter asks the writer's release to NOTIFY (as the lock's waiters do).
/// - `ins` makes the row when there is none; two racing inserts meet on the primary key.
const ACQUIRE: &str = "WITH upd AS (
    UPDATE {table} AS l SET
        hold_count    = CASE WHEN {joining} THEN l.hold_count + CASE WHEN {seen} THEN 0 ELSE 1 END
                             ELSE 1 END,
        fencing_token = CASE WHEN {joining} THEN l.fencing_token
                             ELSE greatest(l.fencing_token + 1, (extract(epoch FROM statement_timestamp()) * 1000000)::int8) END,
        acquired_at   = CASE WHEN {joining} THEN l.acquired_at ELSE statement_timestamp() END,
        holder        = CASE WHEN {joining} THEN l.holder ELSE $2 END,
        expires_at    = CASE WHEN {joining} THEN greatest(l.expires_at, {lease}) ELSE {lease} END,
        last_outcome  = CASE WHEN NOT {joining} AND {ran_out_l} THEN 2 ELSE l.last_outcome END,
        finished_at   = CASE WHEN NOT {joining} AND {ran_out_l} THEN l.expires_at ELSE l.finished_at END,
        available_at  = CASE WHEN {joining} THEN l.available_at END,
        readers       = CASE WHEN {joining}
                             THEN CASE WHEN {seen} THEN l.readers ELSE l.readers || $4::int8 || ',' END
                             ELSE ',' || $4::int8 || ',' END,
        contended     = {joining} AND l.contended,
        attempt_id    = $4,
        owner         = '(readers)'
    WHERE l.lock_key = $1
      AND CASE WHEN {joining} THEN {seen} OR $5::int8 IS NOT DISTINCT FROM l.fencing_token OR NOT {intent}
               ELSE l.expires_at <= statement_timestamp() AND NOT {intent} END
    RETURNING l.hold_count, l.fencing_token, l.expires_at
){flag}, ins AS (
    INSERT INTO {table} (lock_key, owner, hold_count, fencing_token, expires_at, acquired_at,
                         holder, attempt_id, readers)
    SELECT $1, '(readers)', 1, (extract(epoch FROM statement_timestamp()) * 1000000)::int8,
           {lease}, statement_timestamp(), $2, $4, ',' || $4::int8 || ','
    WHERE NOT EXISTS (SELECT 1 FROM upd) AND NOT EXISTS (SELECT 1 FROM {table} WHERE lock_key = $1)
    ON CONFLICT (lock_key) DO NOTHING
    RETURNING hold_count, fencing_token, expires_at
), res AS (
    SELECT true AS granted, hold_count, fencing_token, expires_at FROM upd
    UNION ALL
    SELECT true, hold_count, fencing_token, expires_at FROM ins
    UNION ALL
    SELECT false, hold_count, fencing_token, expires_at FROM {table}
     WHERE lock_key = $1 AND NOT EXISTS (SELECT 1 FROM upd) AND NOT EXISTS (SELECT 1 FROM ins)
)
SELECT granted, hold_count, fencing_token, {us_expires} AS expires_us,
       greatest(0, ceil(extract(epoch FROM expires_at - statement_timestamp()) * 1000))::int8
FROM res";

/// A reader waiting behind a writer ($6) asks the writer's release to NOTIFY.
const FLAG: &str = ", flag AS (
    UPDATE {table} SET contended = true
    WHERE $6 AND lock_key = $1 AND NOT contended AND NOT EXISTS (SELECT 1 FROM upd)
      AND owner IS NOT NULL AND owner <> '(readers)' AND expires_at > statement_timestamp()
    RETURNING 1
)";

/// A reader's release: `$1` key, `$2` read tenure, `$3` the hold's id, `$4` outcome (when it
/// ends the phase), `$5` NOTIFY channel, `$6` lazily durable. The id leaves the readers of a
/// live phase of that tenure; the last one frees the row (and wakes a waiting writer). Not
/// listed (any more) in a live phase of that tenure: released before (`gone`). Single-row
/// UPDATE by primary key: its conditions are the row's own.
const RELEASE: &str = "WITH r AS (
    UPDATE {table} SET
        hold_count   = hold_count - 1,
        owner        = CASE WHEN hold_count > 1 THEN owner END,
        expires_at   = CASE WHEN hold_count > 1 THEN expires_at ELSE statement_timestamp() END,
        readers      = replace(readers, ',' || $3::int8 || ',', ','),
        last_outcome = CASE WHEN hold_count > 1 THEN last_outcome ELSE coalesce($4, last_outcome) END,
        finished_at  = CASE WHEN hold_count > 1 OR $4 IS NULL THEN finished_at
                            ELSE statement_timestamp() END,
        release_id   = $3,
        release_token = fencing_token
    WHERE lock_key = $1 AND owner = '(readers)' AND fencing_token = $2
      AND expires_at > statement_timestamp()
      AND strpos(readers, ',' || $3::int8 || ',') > 0
    RETURNING hold_count, contended, lock_key
)
SELECT 'released', hold_count,
       CASE WHEN hold_count = 0 AND contended THEN pg_notify($5, lock_key)::text END,
       CASE WHEN $6 THEN set_config('synchronous_commit', 'off', true) END
FROM r
UNION ALL
SELECT 'gone', hold_count, NULL, NULL FROM {table}
 WHERE lock_key = $1 AND NOT EXISTS (SELECT 1 FROM r) AND owner = '(readers)'
   AND fencing_token = $2 AND expires_at > statement_timestamp()
   AND strpos(coalesce(readers, ''), ',' || $3::int8 || ',') = 0";

/// A waiting writer's intent: `$1` key, `$2` the writer's owner, `$3` lease µs. Recorded on a
/// read-held row unless another writer's intent on this tenure is live.
const INTENT_SQL: &str = "UPDATE {table} AS l SET
    intent_until = statement_timestamp() + $3::float8 * interval '1 microsecond',
    intent_token = l.fencing_token,
    intent_owner = $2
WHERE l.lock_key = $1 AND {joining}
  AND (l.intent_owner IS NOT DISTINCT FROM $2 OR NOT {intent})
RETURNING 1";

/// A writer that gave up: `$1` key, `$2` its owner.
const WITHDRAW: &str =
    "UPDATE {table} SET intent_until = NULL WHERE lock_key = $1 AND intent_owner = $2";

impl KindSql for Sql {
    fn build(table: &str) -> Sql {
        let fill = |s: &str| {
            s.replace("{joining}", JOINING)
                .replace("{seen}", SEEN)
                .replace("{intent}", INTENT)
                .replace("{lease}", LEASE)
                .replace("{ran_out_l}", &super::ran_out("l."))
        };
        debug_assert!(ACQUIRE.contains(READERS));
        Sql {
            acquire: stmt(&fill(&ACQUIRE.replace("{flag}", "")), table),
            acquire_waiting: stmt(&fill(&ACQUIRE.replace("{flag}", FLAG)), table),
            release: stmt(RELEASE, table),
            intent: stmt(&fill(INTENT_SQL), table),
            withdraw: stmt(WITHDRAW, table),
        }
    }
}

async fn acquire(
    pg: &Pg,
    conn: &mut PgConnection,
    a: &ReadAcquire<'_>,
) -> sqlx::Result<ReadAttempt> {
    let texts = pg.kind_sql.get::<Sql>();
    let s = if a.waiting {
        &texts.acquire_waiting
    } else {
        &texts.acquire
    };
    let mut args = a.args();
    if a.waiting {
        args.push(Arg::Bool(true));
    }
    let Some(row) = pg.send::<Option<PgRow>>(conn, s, &args).await? else {
        // The row was inserted by someone else during this statement.
        return Ok(ReadAttempt::Busy { retry_after: None });
    };
    if row.try_get::<bool, _>(0)? {
        Ok(ReadAttempt::Granted(Grant::at(&row, 1)?))
    } else {
        // No lease left yet busy: a writer's intent keeps the free row (until the writer takes
        // it, or the intent's lease ends): the usual backoff, not a retry at once.
        let left: i64 = row.try_get(4)?;
        Ok(ReadAttempt::Busy {
            retry_after: (left > 0).then(|| crate::info::millis(left)),
        })
    }
}

async fn release(
    pg: &Pg,
    conn: &mut PgConnection,
    r: &ReadRelease<'_>,
) -> sqlx::Result<ReadReleased> {
    let texts = pg.kind_sql.get::<Sql>();
    let mut args = r.args();
    args.extend([Arg::Text(&pg.channel), Arg::Bool(pg.settings.lazy_release)]);
    let row = pg
        .send::<Option<PgRow>>(conn, &texts.release, &args)
        .await?;
    Ok(match row {
        None => ReadReleased::NotHeld,
        Some(row) => match (
            row.try_get::<String, _>(0)?.as_str(),
            row.try_get::<i32, _>(1)?,
        ) {
            ("gone", _) => ReadReleased::Gone,
            (_, 0) => ReadReleased::Free,
            (_, n) => ReadReleased::StillHeld(n.max(0) as u32),
        },
    })
}

async fn intent(pg: &Pg, conn: &mut PgConnection, i: &Intent<'_>) -> sqlx::Result<bool> {
    let texts = pg.kind_sql.get::<Sql>();
    Ok(pg.send::<Changed>(conn, &texts.intent, &i.args()).await?.0 > 0)
}

async fn withdraw(pg: &Pg, conn: &mut PgConnection, w: &Withdraw<'_>) -> sqlx::Result<()> {
    let texts = pg.kind_sql.get::<Sql>();
    pg.send::<Changed>(conn, &texts.withdraw, &w.args()).await?;
    Ok(())
}

crate::backend::runs! {
    super::OnPostgres, postgres, super::Pg, sqlx::PgConnection;
    ReadAcquire<'_> => acquire,
    ReadRelease<'_> => release,
    Intent<'_> => intent,
    Withdraw<'_> => withdraw,
}
