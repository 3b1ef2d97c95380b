//! The operator's statements (inspect, live rows, rows in a range, force_release, reset,
//! purge) as values, their runner for MySQL and SQLite, the last-writer read, and the row
//! decoder, written once. MySQL and SQLite supply only their SQL text (`AdminSql`) and run them
//! through here (`shared_admin!`); PostgreSQL runs its own text through its own runner (which
//! knows the form a transaction pooler needs) and shares the decoder. Every dialect's text
//! returns the columns of [`LockRow`] with the same types.

use sqlx::{ColumnIndex, Decode, Row, Type};
#[cfg(any(feature = "mysql", feature = "sqlite"))]
use sqlx::{Database, Encode, Executor, IntoArguments, SqlStr};

use super::contract::{LastWrite, Statement};
use crate::info::{LockInfo, LockRow};

#[cfg(any(feature = "mysql", feature = "sqlite"))]
/// One dialect's operator statements.
#[derive(Debug)]
pub(crate) struct AdminSql {
    /// `$1`/`?` = key; the row's [`LockRow`] columns.
    pub(crate) inspect: SqlStr,
    /// Every row with a live lease, ordered by key.
    pub(crate) held: SqlStr,
    /// `$1`, `$2`, `$3` / `?`, `?`, `?` = from, to, a span in µs: the rows whose key is in
    /// `from..to` with a live lease or taken within the span (0: only the live ones), ordered
    /// by key.
    pub(crate) rows_in: SqlStr,
    /// `$1`/`?` = key; frees a live lease whoever holds it, keeping the fencing token.
    pub(crate) force_release: SqlStr,
    /// `$1`/`?` = age in µs; deletes rows free or expired for longer, at most [`PURGE_BATCH`].
    pub(crate) purge: SqlStr,
    /// `$1`/`?` = age in µs; how long until the rows `purge` keeps for their fencing token
    /// alone, and could delete within `timing::PURGE_HELD_BACK`, could go (µs, NULL: none).
    pub(crate) held_back: SqlStr,
    /// `$1`/`?` = key; a key not held: outcome forgotten, min_hold wait ended.
    pub(crate) reset: SqlStr,
    /// `$1`/`?` = key; the row's last writer id (attempt or release id) and tenure: after a
    /// release whose reply was lost, tells "my release took effect" from "not mine".
    pub(crate) last_write: SqlStr,
}

// The operator's statements, as values (each backend's runner: the macro below for MySQL and
// SQLite, `postgres/admin.rs`).

/// The row of a key.
pub(crate) struct Inspect<'a>(pub &'a str);

impl Statement for Inspect<'_> {
    type Output = Option<LockInfo>;
}

/// Every row with a live lease, ordered by key.
pub(crate) struct LiveRows;

impl Statement for LiveRows {
    type Output = Vec<LockInfo>;
}

/// The rows whose key is in `from..to` (bytes) that have a live lease, or were taken in the last
/// `taken_within_us` on the database clock (the watch: a hold that may have begun and ended
/// since its last read; 0: only the live ones), ordered by key.
pub(crate) struct RowsIn<'a> {
    pub from: &'a str,
    pub to: &'a str,
    pub taken_within_us: i64,
}

impl Statement for RowsIn<'_> {
    type Output = Vec<LockInfo>;
}

/// Frees a live lease whoever holds it; whether there was one.
pub(crate) struct ForceRelease<'a>(pub &'a str);

impl Statement for ForceRelease<'_> {
    type Output = bool;
}

/// A key not held: outcome forgotten, min_hold wait ended; whether a row changed.
pub(crate) struct Reset<'a>(pub &'a str);

impl Statement for Reset<'_> {
    type Output = bool;
}

/// Deletes rows free or expired for longer than `older_than_us`.
pub(crate) struct Purge {
    pub older_than_us: i64,
}

/// What a [`Purge`] did: the rows it deleted, and how long until those it kept for their
/// fencing token alone could go (a new row of their key would start at or below it until then).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Purged {
    pub deleted: u64,
    /// µs; `None` when it kept none.
    pub held_back_us: Option<i64>,
}

impl Statement for Purge {
    type Output = Purged;
}

/// Rows one purge statement deletes at most where the dialect can bound it (MySQL), so a large
/// purge never holds many row locks at once.
pub(crate) const PURGE_BATCH: u64 = 1000;

#[cfg(any(feature = "mysql", feature = "sqlite"))]
/// `rows_affected`, which sqlx has on each backend's query result but in no trait.
pub(crate) trait RowsAffected {
    fn rows(&self) -> u64;
}

#[cfg(feature = "mysql")]
impl RowsAffected for sqlx::mysql::MySqlQueryResult {
    fn rows(&self) -> u64 {
        self.rows_affected()
    }
}

#[cfg(feature = "sqlite")]
impl RowsAffected for sqlx::sqlite::SqliteQueryResult {
    fn rows(&self) -> u64 {
        self.rows_affected()
    }
}

/// Decodes [`LockRow`]'s columns, whatever the backend.
pub(crate) fn decode<'r, R>(r: &'r R) -> sqlx::Result<LockRow>
where
    R: Row,
    usize: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Option<String>: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    Option<i64>: Decode<'r, R::Database> + Type<R::Database>,
    bool: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(LockRow {
        key: r.try_get(0)?,
        owner: r.try_get(1)?,
        holder: r.try_get(2)?,
        hold_count: r.try_get(3)?,
        fencing_token: r.try_get(4)?,
        expires_at_us: r.try_get(5)?,
        acquired_at_us: r.try_get(6)?,
        held: r.try_get(7)?,
        remaining_ms: r.try_get(8)?,
        last_outcome: r.try_get(9)?,
        finished_at_us: r.try_get(10)?,
        writer_waiting: r.try_get(11)?,
        renewals: r.try_get(12)?,
    })
}

/// Runs one of the operator's reads (`sql`, with `texts` then `ints` bound in order) and decodes
/// every row it returns.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) async fn infos<DB>(
    conn: &mut DB::Connection,
    sql: &SqlStr,
    texts: &[&str],
    ints: &[i64],
) -> sqlx::Result<Vec<LockInfo>>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    usize: ColumnIndex<DB::Row>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    for<'r> Option<String>: Decode<'r, DB> + Type<DB>,
    for<'r> i64: Decode<'r, DB> + Type<DB>,
    for<'r> Option<i64>: Decode<'r, DB> + Type<DB>,
    for<'r> bool: Decode<'r, DB> + Type<DB>,
{
    let mut query = sqlx::query(sql.clone());
    for text in texts {
        query = query.bind((*text).to_owned());
    }
    for int in ints {
        query = query.bind(*int);
    }
    let rows = query.fetch_all(&mut *conn).await?;
    rows.iter().map(|r| decode(r).map(LockInfo::from)).collect()
}

/// Runs one of the operator's writes (`sql`, with `value` bound) and says how many rows it
/// changed.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) async fn affected<DB, T>(
    conn: &mut DB::Connection,
    sql: &SqlStr,
    value: T,
) -> sqlx::Result<u64>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    DB::QueryResult: RowsAffected,
    T: for<'q> Encode<'q, DB> + Type<DB> + Send + 'static,
{
    let done = sqlx::query(sql.clone())
        .bind(value)
        .execute(&mut *conn)
        .await?;
    Ok(done.rows())
}

/// A purge: in batches of at most [`PURGE_BATCH`] rows until a batch comes back short, then
/// how long the rows kept for their fencing token alone are held back.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) async fn purge<DB>(
    conn: &mut DB::Connection,
    sql: &AdminSql,
    older_than_us: i64,
) -> sqlx::Result<Purged>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    DB::QueryResult: RowsAffected,
    usize: ColumnIndex<DB::Row>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'r> Option<i64>: Decode<'r, DB> + Type<DB>,
{
    let mut deleted = 0;
    loop {
        let n = affected::<DB, i64>(conn, &sql.purge, older_than_us).await?;
        deleted += n;
        if n < PURGE_BATCH {
            break;
        }
    }
    let row = sqlx::query(sql.held_back.clone())
        .bind(older_than_us)
        .fetch_one(&mut *conn)
        .await?;
    Ok(Purged {
        deleted,
        held_back_us: row.try_get(0)?,
    })
}

#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) async fn last_write<DB>(
    conn: &mut DB::Connection,
    sql: &AdminSql,
    key: &str,
) -> sqlx::Result<Option<LastWrite>>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    usize: ColumnIndex<DB::Row>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'r> Option<i64>: Decode<'r, DB> + Type<DB>,
    for<'r> i64: Decode<'r, DB> + Type<DB>,
{
    let row = sqlx::query(sql.last_write.clone())
        .bind(key.to_owned())
        .fetch_optional(&mut *conn)
        .await?;
    row.as_ref().map(decode_last_write).transpose()
}

/// Decodes the last-writer read's columns (writer, fencing token, release id and token),
/// whatever the backend.
pub(crate) fn decode_last_write<'r, R>(r: &'r R) -> sqlx::Result<LastWrite>
where
    R: Row,
    usize: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    Option<i64>: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(LastWrite {
        writer: r.try_get(0)?,
        fencing_token: r.try_get(1)?,
        release_id: r.try_get(2)?,
        release_token: r.try_get(3)?,
    })
}

/// The operator's statements and the last-writer read through the shared code above, for a
/// backend (`$trait`, its method `$method`, its type `$ty` and sqlx database `$db`) whose
/// [`AdminSql`] is at `<backend>.<path>`: `shared_admin!(OnMySql, mysql, My, sqlx::MySql,
/// sql.admin)` in its folder.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
macro_rules! shared_admin {
    ($trait:ident, $method:ident, $ty:ty, $db:ty, $($field:ident).+) => {
        impl $trait for $crate::backend::contract::LastWriteOf<'_> {
            async fn $method(&self, b: &$ty, conn: &mut <$db as sqlx::Database>::Connection) -> sqlx::Result<Option<$crate::backend::contract::LastWrite>> {
                $crate::backend::admin::last_write::<$db>(conn, &b.$($field).+, self.0).await
            }
        }

        impl $trait for $crate::backend::admin::Inspect<'_> {
            async fn $method(&self, b: &$ty, conn: &mut <$db as sqlx::Database>::Connection) -> sqlx::Result<Option<$crate::info::LockInfo>> {
                let rows = $crate::backend::admin::infos::<$db>(conn, &b.$($field).+.inspect, &[self.0], &[]).await?;
                Ok(rows.into_iter().next())
            }
        }

        impl $trait for $crate::backend::admin::LiveRows {
            async fn $method(&self, b: &$ty, conn: &mut <$db as sqlx::Database>::Connection) -> sqlx::Result<Vec<$crate::info::LockInfo>> {
                $crate::backend::admin::infos::<$db>(conn, &b.$($field).+.held, &[], &[]).await
            }
        }

        impl $trait for $crate::backend::admin::RowsIn<'_> {
            async fn $method(&self, b: &$ty, conn: &mut <$db as sqlx::Database>::Connection) -> sqlx::Result<Vec<$crate::info::LockInfo>> {
                $crate::backend::admin::infos::<$db>(conn, &b.$($field).+.rows_in, &[self.from, self.to], &[self.taken_within_us]).await
            }
        }

        impl $trait for $crate::backend::admin::ForceRelease<'_> {
            async fn $method(&self, b: &$ty, conn: &mut <$db as sqlx::Database>::Connection) -> sqlx::Result<bool> {
                Ok($crate::backend::admin::affected::<$db, String>(conn, &b.$($field).+.force_release, self.0.to_owned()).await? > 0)
            }
        }

        impl $trait for $crate::backend::admin::Reset<'_> {
            async fn $method(&self, b: &$ty, conn: &mut <$db as sqlx::Database>::Connection) -> sqlx::Result<bool> {
                Ok($crate::backend::admin::affected::<$db, String>(conn, &b.$($field).+.reset, self.0.to_owned()).await? > 0)
            }
        }

        impl $trait for $crate::backend::admin::Purge {
            async fn $method(&self, b: &$ty, conn: &mut <$db as sqlx::Database>::Connection) -> sqlx::Result<$crate::backend::admin::Purged> {
                $crate::backend::admin::purge::<$db>(conn, &b.$($field).+, self.older_than_us).await
            }
        }
    };
}
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) use shared_admin;
