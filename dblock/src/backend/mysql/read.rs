//! Shared (read) locks on MySQL 8 and MariaDB: the readers' statements and the writer's intent
//! (the model is in `backend/read.rs`). One statement each on the key's row; the acquire is
//! an `INSERT ... ON DUPLICATE KEY UPDATE`, atomic because InnoDB holds the row's exclusive lock
//! from the duplicate check through the update. Its answer travels in `LAST_INSERT_ID`, as on
//! the lock's MySQL 8 path, so one statement serves MySQL 8 and MariaDB alike.

use sqlx::mysql::MySqlConnection;
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use super::{My, US_NOW};
use crate::backend::kind_sql::KindSql;
use crate::backend::read::{
    Intent, ReadAcquire, ReadAttempt, ReadRelease, ReadReleased, Withdraw, READERS,
};
use crate::backend::Grant;

/// The statements of one table, positional, with the order of their parameters.
#[derive(Debug)]
pub(crate) struct Sql {
    acquire: (SqlStr, Vec<P>),
    release: (SqlStr, Vec<P>),
    gone: (SqlStr, Vec<P>),
    intent: (SqlStr, Vec<P>),
    withdraw: (SqlStr, Vec<P>),
}

/// A named parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum P {
    Key,
    Holder,
    Lease,
    Id,
    Reentry,
    Token,
    Outcome,
    Owner,
}

const NAMES: [(&str, P); 8] = [
    (":key", P::Key),
    (":holder", P::Holder),
    (":lease", P::Lease),
    (":id", P::Id),
    (":reentry", P::Reentry),
    (":token", P::Token),
    (":outcome", P::Outcome),
    (":owner", P::Owner),
];

const JOINING: &str = "(owner <=> '(readers)' AND expires_at > UTC_TIMESTAMP(6))";
const SEEN: &str = "(LOCATE(CONCAT(',', VALUES(attempt_id), ','), IFNULL(readers, '')) > 0)";
const INTENT: &str =
    "COALESCE(intent_until > UTC_TIMESTAMP(6) AND intent_token <=> fencing_token, 0)";
/// May this reader have the row: join a live phase (its own id already there, a re-entry, or
/// no writer waiting), or start a new one on a row whose lease ended (no writer waiting).
const MAY: &str = "IF({joining}, {seen} OR :reentry <=> fencing_token OR NOT {intent},
                   expires_at <= UTC_TIMESTAMP(6) AND NOT {intent})";
const RAN_OUT: &str = "(owner IS NOT NULL AND expires_at <= UTC_TIMESTAMP(6)
           AND NOT (success_token <=> fencing_token))";

/// A reader's acquire. Assignments run left to right, each seeing those before it; the ones
/// the conditions read come last, in an order that keeps every later condition's answer:
/// - `hold_count` ... `attempt_id` change no column a condition reads;
/// - `readers`: after a join, {seen} turns true, and {may} of a join stays true; a new phase
///   does not read {seen};
/// - `fencing_token`: a new phase's new tenure voids an intent of the old one, so {may} of a
///   new phase stays true; a join keeps the tenure;
/// - `owner`: a new phase's row becomes the readers', but its old lease end keeps {joining}
///   false;
/// - `expires_at` last, and with it the answer: `LAST_INSERT_ID(count << 52 | tenure)` when
///   taken, 0 when busy (the insert's own `LAST_INSERT_ID`, set before the duplicate check, is
///   overwritten). A new row answers through the insert's value: its tenure, count 1.
const ACQUIRE: &str = "INSERT INTO {table}
    (lock_key, owner, hold_count, fencing_token, expires_at, acquired_at, holder, attempt_id,
     readers)
VALUES (:key, '(readers)', 1, LAST_INSERT_ID({us_now} + 4503599627370496) - 4503599627370496,
        UTC_TIMESTAMP(6) + INTERVAL :lease MICROSECOND, UTC_TIMESTAMP(6), :holder, :id,
        CONCAT(',', :id, ','))
ON DUPLICATE KEY UPDATE
    hold_count    = IF({may}, IF({joining}, hold_count + IF({seen}, 0, 1), 1), hold_count),
    holder        = IF({may} AND NOT {joining}, VALUES(holder), holder),
    acquired_at   = IF({may} AND NOT {joining}, UTC_TIMESTAMP(6), acquired_at),
    finished_at   = IF({may} AND NOT {joining} AND {ran_out}, expires_at, finished_at),
    last_outcome  = IF({may} AND NOT {joining} AND {ran_out}, 2, last_outcome),
    available_at  = IF({may} AND NOT {joining}, NULL, available_at),
    attempt_id    = IF({may}, VALUES(attempt_id), attempt_id),
    readers       = IF({may}, IF({joining}, IF({seen}, readers,
                                                 CONCAT(readers, VALUES(attempt_id), ',')),
                                 CONCAT(',', VALUES(attempt_id), ',')),
                       readers),
    fencing_token = IF({may} AND NOT {joining}, fencing_token + 1, fencing_token),
    owner         = IF({may}, '(readers)', owner),
    expires_at    = IF({may},
                       IF(LAST_INSERT_ID(hold_count * 4503599627370496 + fencing_token) > 0,
                          IF({joining}, GREATEST(expires_at, VALUES(expires_at)), VALUES(expires_at)),
                          NULL),
                       IF(LAST_INSERT_ID(0) = 0, expires_at, NULL))";

/// A reader's release. Left to right: `hold_count` first, so the later assignments read the
/// count after this release (0: the last reader left, the row is freed); the count + 1 travels
/// back in `LAST_INSERT_ID` (0: nothing matched).
const RELEASE: &str = "UPDATE {table} SET
    hold_count    = hold_count - 1,
    readers       = REPLACE(readers, CONCAT(',', :id, ','), ','),
    last_outcome  = IF(hold_count = 0, COALESCE(:outcome, last_outcome), last_outcome),
    finished_at   = IF(hold_count = 0 AND last_outcome IS NOT NULL, UTC_TIMESTAMP(6), finished_at),
    release_id    = :id,
    release_token = fencing_token + 0 * LAST_INSERT_ID(hold_count + 1),
    owner         = IF(hold_count = 0, NULL, owner),
    expires_at    = IF(hold_count = 0, UTC_TIMESTAMP(6), expires_at)
WHERE lock_key = :key AND owner = '(readers)' AND fencing_token = :token
  AND expires_at > UTC_TIMESTAMP(6) AND LOCATE(CONCAT(',', :id, ','), readers) > 0";

const GONE: &str = "SELECT 1 FROM {table} WHERE lock_key = :key AND owner = '(readers)'
   AND fencing_token = :token AND expires_at > UTC_TIMESTAMP(6)
   AND LOCATE(CONCAT(',', :id, ','), IFNULL(readers, '')) = 0";

/// The WHERE is evaluated before the SET: the conditions read the old row.
const INTENT_SQL: &str = "UPDATE {table} SET
    intent_until = UTC_TIMESTAMP(6) + INTERVAL :lease MICROSECOND,
    intent_token = fencing_token,
    intent_owner = :owner
WHERE lock_key = :key AND {joining} AND (intent_owner <=> :owner OR NOT {intent})";

const WITHDRAW: &str =
    "UPDATE {table} SET intent_until = NULL WHERE lock_key = :key AND intent_owner = :owner";

fn positional(template: &str, table: &str) -> (SqlStr, Vec<P>) {
    let text = template
        .replace("{may}", MAY)
        .replace("{joining}", JOINING)
        .replace("{seen}", SEEN)
        .replace("{intent}", INTENT)
        .replace("{ran_out}", RAN_OUT)
        .replace("{us_now}", US_NOW)
        .replace("{table}", table);
    let (text, order) = super::sql::placeholders(&text, ':', &NAMES);
    (AssertSqlSafe(text).into_sql_str(), order)
}

impl KindSql for Sql {
    fn build(table: &str) -> Sql {
        debug_assert!(ACQUIRE.contains(READERS));
        Sql {
            acquire: positional(ACQUIRE, table),
            release: positional(RELEASE, table),
            gone: positional(GONE, table),
            intent: positional(INTENT_SQL, table),
            withdraw: positional(WITHDRAW, table),
        }
    }
}

/// The values of one call, by name.
#[derive(Default)]
struct Values<'a> {
    key: &'a str,
    holder: &'a str,
    lease_us: i64,
    id: i64,
    reentry: Option<i64>,
    token: i64,
    outcome: Option<i16>,
    owner: &'a str,
}

fn bind<'q>(
    (text, order): &(SqlStr, Vec<P>),
    v: &Values<'q>,
) -> sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments> {
    let mut q = sqlx::query(text.clone());
    for p in order {
        q = match p {
            P::Key => q.bind(v.key),
            P::Holder => q.bind(v.holder),
            P::Lease => q.bind(v.lease_us),
            P::Id => q.bind(v.id),
            P::Reentry => q.bind(v.reentry),
            P::Token => q.bind(v.token),
            P::Outcome => q.bind(v.outcome),
            P::Owner => q.bind(v.owner),
        };
    }
    q
}

/// `hold_count` travels above these bits (see the lock's MySQL 8 path).
const COUNT_SHIFT: u32 = 52;

pub(crate) async fn acquire(
    my: &My,
    conn: &mut MySqlConnection,
    a: &ReadAcquire<'_>,
) -> Result<ReadAttempt, sqlx::Error> {
    let texts = my.kind_sql.get::<Sql>();
    let sent_at = std::time::SystemTime::now();
    let v = Values {
        key: a.key,
        holder: a.holder,
        lease_us: a.ttl_us,
        id: a.id,
        reentry: a.reentry,
        ..Values::default()
    };
    let done = bind(&texts.acquire, &v).execute(&mut *conn).await?;
    let packed = done.last_insert_id();
    if packed == 0 {
        return Ok(ReadAttempt::Busy { retry_after: None });
    }
    // The lease end is not read back: the send time plus the ttl, on the client's clock, for
    // display only (expiry is the database's; the hold's local deadline is taken at the send).
    let local_us = sent_at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64);
    Ok(ReadAttempt::Granted(Grant {
        hold_count: (packed >> COUNT_SHIFT) as u32,
        fencing_token: packed & ((1u64 << COUNT_SHIFT) - 1),
        expires_at_us: local_us.saturating_add(a.ttl_us),
    }))
}

pub(crate) async fn release(
    my: &My,
    conn: &mut MySqlConnection,
    r: &ReadRelease<'_>,
) -> Result<ReadReleased, sqlx::Error> {
    let texts = my.kind_sql.get::<Sql>();
    let v = Values {
        key: r.key,
        id: r.id,
        token: r.token,
        outcome: r.outcome.map(|o| o.code()),
        ..Values::default()
    };
    let done = bind(&texts.release, &v).execute(&mut *conn).await?;
    Ok(match done.last_insert_id() {
        0 => {
            let gone = bind(&texts.gone, &v).fetch_optional(&mut *conn).await?;
            if gone.is_some() {
                ReadReleased::Gone
            } else {
                ReadReleased::NotHeld
            }
        }
        1 => ReadReleased::Free,
        n => ReadReleased::StillHeld((n - 1) as u32),
    })
}

pub(crate) async fn intent(
    my: &My,
    conn: &mut MySqlConnection,
    i: &Intent<'_>,
) -> Result<bool, sqlx::Error> {
    let texts = my.kind_sql.get::<Sql>();
    let v = Values {
        key: i.key,
        owner: i.owner,
        lease_us: i.lease_us,
        ..Values::default()
    };
    let done = bind(&texts.intent, &v).execute(&mut *conn).await?;
    Ok(done.rows_affected() > 0)
}

pub(crate) async fn withdraw(
    my: &My,
    conn: &mut MySqlConnection,
    w: &Withdraw<'_>,
) -> Result<(), sqlx::Error> {
    let texts = my.kind_sql.get::<Sql>();
    let v = Values {
        key: w.key,
        owner: w.owner,
        ..Values::default()
    };
    bind(&texts.withdraw, &v).execute(&mut *conn).await?;
    Ok(())
}

crate::backend::runs! {
    super::OnMySql, mysql, super::My, sqlx::MySqlConnection;
    ReadAcquire<'_> => acquire,
    ReadRelease<'_> => release,
    Intent<'_> => intent,
    Withdraw<'_> => withdraw,
}
