//! Fenced writes: inside the caller's transaction on the lock's own database, check that a lease
//! is still ours and live, and lock its row until that transaction ends; and the success that
//! commits with the work (`succeed_in`).
//!
//! The statement is the same on every backend: an `UPDATE` of the lease row, owner-, tenure- and
//! lease-checked in its `WHERE`. An `UPDATE` takes the row's write lock (PostgreSQL, InnoDB) or
//! the database's write lock (SQLite) and keeps it until the caller's transaction commits or
//! rolls back; every takeover of the key is an `UPDATE` of that row, so it waits. The fence
//! changes nothing (`lock_key = lock_key`); `succeed_in` also writes the hold's outcome,
//! `Succeeded`, and marks the tenure's success as committed (`success_token`): it becomes
//! visible, and binding, exactly when the caller's transaction commits, and is undone with it.
//! A release that follows (whatever outcome it brings) and a takeover after the lease ran out
//! both keep a success whose `success_token` is the row's tenure.
//!
//! Behind a transaction pooler (a PostgreSQL locker with `ConnectOptions::pooler`) it goes as a
//! simple query with its values inlined: a prepared statement would outlive the caller's
//! transaction on a server connection that other clients get next.

use std::future::Future;

use sqlx::SqlStr;

use super::quote_ident;

/// A connection (or, through `&mut *tx`, a transaction) of a database whose writes can be fenced:
/// `PgConnection`, `MySqlConnection`, `SqliteConnection` (with the matching cargo feature).
/// Sealed: implemented by dblock only.
pub trait FenceConnection: Send + sealed::Sealed {
    /// Locks the row of `key` if `owner` holds it live in tenure `token` (and with `succeed`,
    /// records the hold's success); how many rows matched. `simple`: as a simple-protocol query
    /// with the values inlined (PostgreSQL behind a pooler; other backends ignore it).
    #[doc(hidden)]
    fn fence_row(
        &mut self,
        table: &str,
        key: &str,
        owner: &str,
        token: u64,
        simple: bool,
        succeed: bool,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;
}

mod sealed {
    pub trait Sealed {}
}

/// The fence's `SET`: nothing changes, the row is locked.
const FENCE_ONLY: &str = "lock_key = lock_key";

fn sql(text: String) -> SqlStr {
    sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(text))
}

/// The fence statement's text, per backend (placeholders and clock, `{table}` and the `{set}` of
/// the fence or of a success), and for PostgreSQL the function that sends a `simple` fence
/// (other backends ignore the flag).
macro_rules! fence_impl {
    ($conn:ty, $quote:expr, $text:expr, succeed: $succeed:expr $(, simple: $simple:path)?) => {
        impl sealed::Sealed for $conn {}

        impl FenceConnection for $conn {
            async fn fence_row(
                &mut self,
                table: &str,
                key: &str,
                owner: &str,
                token: u64,
                simple: bool,
                succeed: bool,
            ) -> Result<u64, sqlx::Error> {
                let set = if succeed { $succeed } else { FENCE_ONLY };
                let text = format!($text, table = quote_ident(table, $quote), set = set);
                $(
                    if simple {
                        return $simple(self, &text, key, owner, token).await;
                    }
                )?
                let _ = simple;
                let done = sqlx::query(sql(text))
                    .bind(key)
                    .bind(owner)
                    .bind(token as i64)
                    .execute(&mut *self)
                    .await?;
                Ok(done.rows_affected())
            }
        }
    };
}

/// The PostgreSQL fence as one simple query, its values inlined. No settings before it: it runs
/// inside the caller's transaction, with the caller's.
#[cfg(feature = "postgres")]
async fn pg_simple(
    conn: &mut sqlx::PgConnection,
    text: &str,
    key: &str,
    owner: &str,
    token: u64,
) -> Result<u64, sqlx::Error> {
    use super::postgres::{pooler, Arg};
    let inlined = pooler::inline(
        text,
        &[Arg::Text(key), Arg::Text(owner), Arg::Int8(token as i64)],
    )?;
    let done = sqlx::raw_sql(sqlx::AssertSqlSafe(inlined))
        .execute(conn)
        .await?;
    Ok(done.rows_affected())
}

#[cfg(feature = "postgres")]
fence_impl!(
    sqlx::PgConnection,
    '"',
    "UPDATE {table} SET {set}
WHERE lock_key = $1 AND owner = $2 AND fencing_token = $3 AND expires_at > statement_timestamp()",
    succeed: "success_token = fencing_token, last_outcome = 1, finished_at = statement_timestamp()",
    simple: pg_simple
);

// sqlx sets CLIENT_FOUND_ROWS: rows_affected counts the matched row, changed or not.
#[cfg(feature = "mysql")]
fence_impl!(
    sqlx::MySqlConnection,
    '`',
    "UPDATE {table} SET {set}
WHERE lock_key = ? AND owner = ? AND fencing_token = ? AND expires_at > UTC_TIMESTAMP(6)",
    succeed: "success_token = fencing_token, last_outcome = 1, finished_at = UTC_TIMESTAMP(6)"
);

#[cfg(feature = "sqlite")]
fence_impl!(
    sqlx::SqliteConnection,
    '"',
    "UPDATE {table} SET {set}
WHERE lock_key = $1 AND owner = $2 AND fencing_token = $3
  AND expires_at > CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)",
    succeed: "success_token = fencing_token, last_outcome = 1,
    finished_at = CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"
);
