//! Shared (read) locks on MySQL 8 and MariaDB: the readers' statements and the writer's intent
//! (the model is in `backend/read.rs`). One statement each on the key's row; the acquire is
//! an `INSERT ... ON DUPLICATE KEY UPDATE`, atomic because InnoDB holds the row's exclusive lock
//! from the duplicate check through the update. Its answer travels in `LAST_INSERT_ID`, as on
//! the lock's MySQL 8 path, so one statement serves MySQL 8 and MariaDB alike.

use sqlx::mysql::MySqlConnection;

use super::sql::Numbered;
use super::{packed_grant, My, US_NOW};
use crate::backend::kind_sql::KindSql;
use crate::backend::read::{
    Intent, ReadAcquire, ReadAttempt, ReadRelease, ReadReleased, Withdraw, READERS,
};

/// The statements of one table, numbered as the statement values list their binds
/// ([`ReadAcquire::args`] and the others; `$n` is the n-th).
#[derive(Debug)]
pub(crate) struct Sql {
    acquire: Numbered,
    release: Numbered,
    gone: Numbered,
    intent: Numbered,
    withdraw: Numbered,
}

const JOINING: &str = "(owner <=> '(readers)' AND expires_at > UTC_TIMESTAMP(6))";
const SEEN: &str = "(LOCATE(CONCAT(',', VALUES(attempt_id), ','), IFNULL(readers, '')) > 0)";
const INTENT: &str =
    "COALESCE(intent_until > UTC_TIMESTAMP(6) AND intent_token <=> fencing_token, 0)";
/// May this reader have the row: join a live phase (its own id already there, a re-entry, or
/// no writer waiting), or start a new one on a row whose lease ended (no writer waiting).
const MAY: &str = "IF({joining}, {seen} OR $5 <=> fencing_token OR NOT {intent},
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
VALUES ($1, '(readers)', 1, LAST_INSERT_ID({us_now} + 4503599627370496) - 4503599627370496,
        UTC_TIMESTAMP(6) + INTERVAL $3 MICROSECOND, UTC_TIMESTAMP(6), $2, $4,
        CONCAT(',', $4, ','))
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
    fencing_token = IF({may} AND NOT {joining},
                       GREATEST(fencing_token + 1, {us_now}), fencing_token),
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
    readers       = REPLACE(readers, CONCAT(',', $3, ','), ','),
    last_outcome  = IF(hold_count = 0, COALESCE($4, last_outcome), last_outcome),
    finished_at   = IF(hold_count = 0 AND last_outcome IS NOT NULL, UTC_TIMESTAMP(6), finished_at),
    release_id    = $3,
    release_token = fencing_token + 0 * LAST_INSERT_ID(hold_count + 1),
    owner         = IF(hold_count = 0, NULL, owner),
    expires_at    = IF(hold_count = 0, UTC_TIMESTAMP(6), expires_at)
WHERE lock_key = $1 AND owner = '(readers)' AND fencing_token = $2
  AND expires_at > UTC_TIMESTAMP(6) AND LOCATE(CONCAT(',', $3, ','), readers) > 0";

const GONE: &str = "SELECT 1 FROM {table} WHERE lock_key = $1 AND owner = '(readers)'
   AND fencing_token = $2 AND expires_at > UTC_TIMESTAMP(6)
   AND LOCATE(CONCAT(',', $3, ','), IFNULL(readers, '')) = 0";

/// The WHERE is evaluated before the SET: the conditions read the old row.
const INTENT_SQL: &str = "UPDATE {table} SET
    intent_until = UTC_TIMESTAMP(6) + INTERVAL $3 MICROSECOND,
    intent_token = fencing_token,
    intent_owner = $2
WHERE lock_key = $1 AND {joining} AND (intent_owner <=> $2 OR NOT {intent})";

const WITHDRAW: &str =
    "UPDATE {table} SET intent_until = NULL WHERE lock_key = $1 AND intent_owner = $2";

fn numbered(template: &str, table: &str) -> Numbered {
    let text = template
        .replace("{may}", MAY)
        .replace("{joining}", JOINING)
        .replace("{seen}", SEEN)
        .replace("{intent}", INTENT)
        .replace("{ran_out}", RAN_OUT)
        .replace("{us_now}", US_NOW);
    Numbered::new(&text, table)
}

impl KindSql for Sql {
    fn build(table: &str) -> Sql {
        debug_assert!(ACQUIRE.contains(READERS));
        Sql {
            acquire: numbered(ACQUIRE, table),
            release: numbered(RELEASE, table),
            gone: numbered(GONE, table),
            intent: numbered(INTENT_SQL, table),
            withdraw: numbered(WITHDRAW, table),
        }
    }
}

async fn acquire(
    my: &My,
    conn: &mut MySqlConnection,
    a: &ReadAcquire<'_>,
) -> sqlx::Result<ReadAttempt> {
    let texts = my.kind_sql.get::<Sql>();
    let sent_at = std::time::SystemTime::now();
    let done = texts.acquire.bound(&a.args())?.execute(&mut *conn).await?;
    let packed = done.last_insert_id();
    if packed == 0 {
        return Ok(ReadAttempt::Busy { retry_after: None });
    }
    Ok(ReadAttempt::Granted(packed_grant(
        packed, sent_at, a.ttl_us,
    )))
}

async fn release(
    my: &My,
    conn: &mut MySqlConnection,
    r: &ReadRelease<'_>,
) -> sqlx::Result<ReadReleased> {
    let texts = my.kind_sql.get::<Sql>();
    let args = r.args();
    let done = texts.release.bound(&args)?.execute(&mut *conn).await?;
    Ok(match done.last_insert_id() {
        0 => {
            let gone = texts.gone.bound(&args)?.fetch_optional(&mut *conn).await?;
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

async fn intent(my: &My, conn: &mut MySqlConnection, i: &Intent<'_>) -> sqlx::Result<bool> {
    let texts = my.kind_sql.get::<Sql>();
    let done = texts.intent.bound(&i.args())?.execute(&mut *conn).await?;
    Ok(done.rows_affected() > 0)
}

async fn withdraw(my: &My, conn: &mut MySqlConnection, w: &Withdraw<'_>) -> sqlx::Result<()> {
    let texts = my.kind_sql.get::<Sql>();
    texts.withdraw.bound(&w.args())?.execute(&mut *conn).await?;
    Ok(())
}

crate::backend::runs! {
    super::OnMySql, mysql, super::My, sqlx::MySqlConnection;
    ReadAcquire<'_> => acquire,
    ReadRelease<'_> => release,
    Intent<'_> => intent,
    Withdraw<'_> => withdraw,
}
