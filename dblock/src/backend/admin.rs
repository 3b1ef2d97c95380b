//! The operator's statements (inspect, live rows, rows in a range, force_release, reset,
//! purge) as values, their runner for MySQL and SQLite (`shared_admin!`: the same code for each
//! one's concrete sqlx types, which they give their SQL text, `AdminSql`), the last-writer read,
//! and the row decoder, written once. PostgreSQL runs its own text through its own runner (which
//! knows the form a transaction pooler needs) and shares the decoder. Every dialect's text
//! returns the columns [`decode`] reads, with the same types.

#[cfg(any(feature = "mysql", feature = "sqlite"))]
use sqlx::SqlStr;

use super::contract::{Columns, LastWrite, Statement};
use std::time::Duration;

use crate::info::{count, millis, time_from_micros, LockInfo, LockKind, Outcome};

#[cfg(any(feature = "mysql", feature = "sqlite"))]
/// One dialect's operator statements.
#[derive(Debug)]
pub(crate) struct AdminSql {
    /// `$1`/`?` = key; the row's columns as [`decode`] reads them.
    pub(crate) inspect: SqlStr,
    /// Every row with a live lease, ordered by key.
    pub(crate) held: SqlStr,
    /// `$1`, `$2`, `$3` / `?`, `?`, `?` = from, to, a span in µs: the rows whose key is in
    /// `from..to` with a live lease or taken within the span (0: only the live ones), ordered
    /// by key.
    pub(crate) rows_in: SqlStr,
    /// `$1`, `$2` / `?`, `?` = key, owner (`''`: any); frees a live lease of that owner,
    /// keeping the fencing token.
    pub(crate) force_release: SqlStr,
    /// `$1`/`?` = age in µs; deletes rows free or expired for longer, at most [`PURGE_BATCH`].
    pub(crate) purge: SqlStr,
    /// `$1`/`?` = age in µs; how long until the rows `purge` keeps for their fencing token
    /// alone, and could delete within `timing::PURGE_HELD_BACK`, could go (µs, NULL: none; 0
    /// or less: rows `purge` would delete by now).
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

/// Frees a live lease of `key` (held by `owner`; `""`: whoever holds it); whether there was
/// one.
pub(crate) struct ForceRelease<'a> {
    pub key: &'a str,
    pub owner: &'a str,
}

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
    /// µs (0 or less: a row the delete would take by now, the clock having moved since);
    /// `None` when it kept none.
    pub held_back_us: Option<i64>,
}

impl Statement for Purge {
    type Output = Purged;
}

/// Rows one purge statement deletes at most where the dialect can bound it (MySQL), so a large
/// purge never holds many row locks at once.
pub(crate) const PURGE_BATCH: u64 = 1000;

/// Decodes a row of every backend's state query into a [`LockInfo`]. The columns, in this
/// order and type (each dialect's SQL casts them so, and one decoder serves all three): key,
/// owner, holder, hold count, fencing token, lease end and acquired at (µs), held, ms left,
/// last outcome code, finished at (µs), a writer waiting behind the readers (its intent is
/// live), renewals (how many times the tenure's lease was extended). A row not held shows no
/// owner, a count of 0 and no time left; `holder` still names the last holder.
pub(crate) fn decode(r: &impl Columns) -> sqlx::Result<LockInfo> {
    let held = r.flag(7)?;
    let owner = r.opt_text(1)?;
    let kind = LockKind::of_row(owner.as_deref(), held && r.flag(11)?);
    Ok(LockInfo {
        key: r.text(0)?,
        owner: owner.filter(|_| held),
        holder: r.opt_text(2)?,
        hold_count: if held { count(r.int(3)?) } else { 0 },
        fencing_token: r.int(4)? as u64,
        expires_at: time_from_micros(r.int(5)?),
        acquired_at: time_from_micros(r.int(6)?),
        held,
        time_left: if held {
            millis(r.int(8)?)
        } else {
            Duration::ZERO
        },
        last_outcome: r.opt_int(9)?.and_then(Outcome::from_code),
        finished_at: r.opt_int(10)?.map(time_from_micros),
        renewals: count(r.int(12)?),
        kind,
    })
}

/// Decodes the last-writer read's columns (writer, fencing token, release id and token),
/// whatever the backend.
pub(crate) fn decode_last_write(r: &impl Columns) -> sqlx::Result<LastWrite> {
    Ok(LastWrite {
        writer: r.opt_int(0)?,
        fencing_token: r.int(1)?,
        release_id: r.opt_int(2)?,
        release_token: r.opt_int(3)?,
    })
}

/// The operator's statements and the last-writer read for a backend that runs the text of its
/// [`AdminSql`] as it is (`$trait`, its method `$method`, its type `$ty` and sqlx database
/// `$db`; the [`AdminSql`] at `<backend>.<path>`): `shared_admin!(OnMySql, mysql, My,
/// sqlx::MySql, sql.admin)` in its folder. Reads bind their text values first, then their
/// integers, in order; a purge deletes in batches of at most [`PURGE_BATCH`] rows until one
/// comes back short, then reads how long the rows kept for their fencing token alone are held
/// back.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
macro_rules! shared_admin {
    ($trait:ident, $method:ident, $ty:ty, $db:ty, $($field:ident).+) => {
        mod shared_admin {
            use $crate::backend::admin::{decode, decode_last_write, AdminSql, Purged, PURGE_BATCH};
            use $crate::backend::contract::LastWrite;
            use $crate::info::LockInfo;
            use sqlx::{Row, SqlStr};

            type Conn = <$db as sqlx::Database>::Connection;

            pub(super) async fn infos(conn: &mut Conn, sql: &SqlStr, texts: &[&str], ints: &[i64]) -> sqlx::Result<Vec<LockInfo>> {
                let mut query = sqlx::query(sql.clone());
                for text in texts {
                    query = query.bind((*text).to_owned());
                }
                for int in ints {
                    query = query.bind(*int);
                }
                let rows = query.fetch_all(&mut *conn).await?;
                rows.iter().map(decode).collect()
            }

            pub(super) async fn changes(conn: &mut Conn, sql: &SqlStr, texts: &[&str]) -> sqlx::Result<bool> {
                let mut query = sqlx::query(sql.clone());
                for text in texts {
                    query = query.bind((*text).to_owned());
                }
                let done = query.execute(&mut *conn).await?;
                Ok(done.rows_affected() > 0)
            }

            pub(super) async fn purge(conn: &mut Conn, sql: &AdminSql, older_than_us: i64) -> sqlx::Result<Purged> {
                let mut deleted = 0;
                loop {
                    let done = sqlx::query(sql.purge.clone()).bind(older_than_us).execute(&mut *conn).await?;
                    deleted += done.rows_affected();
                    if done.rows_affected() < PURGE_BATCH {
                        break;
                    }
                }
                let row = sqlx::query(sql.held_back.clone()).bind(older_than_us).fetch_one(&mut *conn).await?;
                Ok(Purged { deleted, held_back_us: row.try_get(0)? })
            }

            pub(super) async fn last_write(conn: &mut Conn, sql: &AdminSql, key: &str) -> sqlx::Result<Option<LastWrite>> {
                let row = sqlx::query(sql.last_write.clone()).bind(key.to_owned()).fetch_optional(&mut *conn).await?;
                row.as_ref().map(decode_last_write).transpose()
            }
        }

        impl $trait for $crate::backend::contract::LastWriteOf<'_> {
            async fn $method(&self, b: &$ty, conn: &mut <$db as sqlx::Database>::Connection) -> sqlx::Result<Option<$crate::backend::contract::LastWrite>> {
                shared_admin::last_write(conn, &b.$($field).+, self.0).await
            }
        }

        impl $trait for $crate::backend::admin::Inspect<'_> {
            async fn $method(&self, b: &$ty, conn: &mut <$db as sqlx::Database>::Connection) -> sqlx::Result<Option<$crate::info::LockInfo>> {
                let rows = shared_admin::infos(conn, &b.$($field).+.inspect, &[self.0], &[]).await?;
                Ok(rows.into_iter().next())
            }
        }

        impl $trait for $crate::backend::admin::LiveRows {
            async fn $method(&self, b: &$ty, conn: &mut <$db as sqlx::Database>::Connection) -> sqlx::Result<Vec<$crate::info::LockInfo>> {
                shared_admin::infos(conn, &b.$($field).+.held, &[], &[]).await
            }
        }

        impl $trait for $crate::backend::admin::RowsIn<'_> {
            async fn $method(&self, b: &$ty, conn: &mut <$db as sqlx::Database>::Connection) -> sqlx::Result<Vec<$crate::info::LockInfo>> {
                shared_admin::infos(conn, &b.$($field).+.rows_in, &[self.from, self.to], &[self.taken_within_us]).await
            }
        }

        impl $trait for $crate::backend::admin::ForceRelease<'_> {
            async fn $method(&self, b: &$ty, conn: &mut <$db as sqlx::Database>::Connection) -> sqlx::Result<bool> {
                shared_admin::changes(conn, &b.$($field).+.force_release, &[self.key, self.owner]).await
            }
        }

        impl $trait for $crate::backend::admin::Reset<'_> {
            async fn $method(&self, b: &$ty, conn: &mut <$db as sqlx::Database>::Connection) -> sqlx::Result<bool> {
                shared_admin::changes(conn, &b.$($field).+.reset, &[self.0]).await
            }
        }

        impl $trait for $crate::backend::admin::Purge {
            async fn $method(&self, b: &$ty, conn: &mut <$db as sqlx::Database>::Connection) -> sqlx::Result<$crate::backend::admin::Purged> {
                shared_admin::purge(conn, &b.$($field).+, self.older_than_us).await
            }
        }
    };
}
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) use shared_admin;
