//! Fenced writes and the lock inside the caller's transaction: statements that run on the
//! caller's connection (or, through `&mut *tx`, transaction) on the lock's own database.
//!
//! - **Fence** (`fence`, `succeed_in`): an `UPDATE` of the lease row, owner-, tenure- and
//!   lease-checked in its `WHERE`. An `UPDATE` takes the row's write lock (PostgreSQL, InnoDB) or
//!   the database's write lock (SQLite) and keeps it until the caller's transaction commits or
//!   rolls back; every takeover of the key is an `UPDATE` of that row, so it waits. The fence
//!   changes nothing (`lock_key = lock_key`); `succeed_in` also writes the hold's outcome,
//!   `Succeeded`, and marks the tenure's success as committed (`success_token`): it becomes
//!   visible, and binding, exactly when the caller's transaction commits, and is undone with it.
//!   A release that follows (whatever outcome it brings) and a takeover after the lease ran out
//!   both keep a success whose `success_token` is the row's tenure. A hold taken with `lock_in`
//!   has no lease to check (its row lock is the lock): its fence checks owner and tenure only.
//! - **`lock_in`**: one statement takes the key inside the caller's transaction, writing a new
//!   tenure whose lease has already ended (`expires_at = acquired_at =` the statement's time) and
//!   whose success is recorded (`success_token`, `last_outcome = 1`). While that transaction is
//!   open the row lock excludes every takeover; every other session still reads the committed
//!   row. Committed, the row says "free, last held by this owner, succeeded" with the new token;
//!   rolled back, nothing happened. See `ARCHITECTURE.md` ("The lock inside the app's
//!   transaction") for each backend's atomicity argument.
//! - **`release_in`**: `succeed_in` and a full release in one `UPDATE` of the caller's
//!   transaction.
//!
//! Behind a transaction pooler (a PostgreSQL locker with `ConnectOptions::pooler`) they go as
//! simple queries with their values inlined: a prepared statement would outlive the caller's
//! transaction on a server connection that other clients get next.

use std::future::Future;

use sqlx::SqlStr;

use super::quote_ident;

/// A connection (or, through `&mut *tx`, a transaction) of a database whose writes can be fenced
/// and in whose transactions a lock can be taken: `PgConnection`, `MySqlConnection`,
/// `SqliteConnection` (with the matching cargo feature). Sealed: implemented by dblock only.
pub trait FenceConnection: Send + sealed::Sealed {
    /// The backend's name, as the locker's dialect gives it (`postgres`, `mysql`, `sqlite`).
    #[doc(hidden)]
    const BACKEND: &'static str;

    /// Locks the row of `row`'s key in `table` if its owner holds it in its tenure — live,
    /// unless `in_tx` (a hold taken with `lock_in`) — and with `succeed`, records the hold's
    /// success; how many rows matched.
    #[doc(hidden)]
    fn fence_row(
        &mut self,
        table: &str,
        row: Owned<'_>,
        succeed: bool,
        in_tx: bool,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send {
        let text = Self::TEXTS.fence(table, succeed, in_tx);
        async move { self.owned_write(text, row).await }
    }

    /// Takes `key` for `owner` inside the connection's open transaction if no one holds it and
    /// no other transaction has its row locked: the new fencing token, or `None` (busy). `wait`:
    /// how long InnoDB may wait for the row (MariaDB only; whole seconds).
    #[doc(hidden)]
    fn lock_in_row(
        &mut self,
        table: &str,
        key: &str,
        owner: &str,
        holder: &str,
        simple: bool,
        mariadb_wait: Option<u64>,
    ) -> impl Future<Output = Result<Option<u64>, sqlx::Error>> + Send {
        let text = Self::TEXTS.text(Self::TEXTS.lock_in, table);
        async move {
            let args = LockIn {
                text,
                key,
                owner,
                holder,
                simple,
                mariadb_wait,
            };
            self.lock_in(args).await
        }
    }

    /// After a `lock_in` attempt that found the key taken: whether the caller's transaction may
    /// now hold a lock the key's holder needs to release (the row's lock, or on SQLite the
    /// file's write lock). Then the call must not go on waiting in that transaction: it answers
    /// busy at once. Each backend says when (no answer counts as holding it).
    #[doc(hidden)]
    fn holds_row_after_busy(
        &mut self,
        table: &str,
        key: &str,
        simple: bool,
    ) -> impl Future<Output = bool> + Send {
        let _ = (table, key, simple);
        std::future::ready(true)
    }

    /// Records the success of `row`'s live tenure (in `table`) and releases it, inside the
    /// connection's open transaction; how many rows matched.
    #[doc(hidden)]
    fn release_in_row(
        &mut self,
        table: &str,
        row: Owned<'_>,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send {
        let text = Self::TEXTS.text(Self::TEXTS.release_in, table);
        async move { self.owned_write(text, row).await }
    }
}

mod sealed {
    use std::future::Future;

    /// What each backend's connection brings to [`super::FenceConnection`]'s methods: its
    /// texts, and how it runs them.
    pub trait Sealed {
        /// The backend's statement texts.
        const TEXTS: super::Texts;

        /// Runs `text`, a fence or `release_in` (key, owner, token bound in that order): how
        /// many rows matched.
        fn owned_write(
            &mut self,
            text: String,
            row: super::Owned<'_>,
        ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

        /// Runs a `lock_in`: the new fencing token, or `None` (busy).
        fn lock_in(
            &mut self,
            args: super::LockIn<'_>,
        ) -> impl Future<Output = Result<Option<u64>, sqlx::Error>> + Send;
    }
}

/// The values of a fence or a `release_in`. `simple`: as a simple-protocol query with the values
/// inlined (PostgreSQL behind a pooler; other backends ignore it).
pub struct Owned<'a> {
    key: &'a str,
    owner: &'a str,
    token: u64,
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    simple: bool,
}

impl<'a> Owned<'a> {
    pub(crate) fn new(key: &'a str, owner: &'a str, token: u64, simple: bool) -> Self {
        Owned {
            key,
            owner,
            token,
            simple,
        }
    }
}

/// A `lock_in`: its text (`{table}` filled in), its values, and how it goes (`simple`: see
/// [`Owned`]; `mariadb_wait`: [`FenceConnection::lock_in_row`]'s `wait`).
pub struct LockIn<'a> {
    text: String,
    key: &'a str,
    owner: &'a str,
    holder: &'a str,
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    simple: bool,
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    mariadb_wait: Option<u64>,
}

/// The fence's `SET`: nothing changes, the row is locked.
const FENCE_ONLY: &str = "lock_key = lock_key";

fn sql(text: String) -> SqlStr {
    sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(text))
}

/// Runs `text` (a fence or `release_in`: key, owner and token bound in that order) as a prepared
/// statement on `conn`: how many rows matched.
macro_rules! owned_write {
    ($conn:expr, $text:expr, $key:expr, $owner:expr, $token:expr) => {
        async {
            let done = sqlx::query(sql($text))
                .bind($key)
                .bind($owner)
                .bind($token as i64)
                .execute(&mut *$conn)
                .await?;
            Ok::<u64, sqlx::Error>(done.rows_affected())
        }
    };
}

/// The texts of one backend's statements on the caller's connection: `{table}`, the fence's
/// `{set}` and `{live}` (the lease check, empty for a `lock_in` hold), with `$1` key, `$2` owner,
/// `$3` token (fence, release_in) or holder (lock_in).
pub struct Texts {
    quote: char,
    fence: &'static str,
    live: &'static str,
    succeed: &'static str,
    lock_in: &'static str,
    release_in: &'static str,
}

impl Texts {
    fn fence(&self, table: &str, succeed: bool, in_tx: bool) -> String {
        self.fence
            .replace("{set}", if succeed { self.succeed } else { FENCE_ONLY })
            .replace("{live}", if in_tx { "" } else { self.live })
            .replace("{table}", &quote_ident(table, self.quote))
    }

    fn text(&self, template: &str, table: &str) -> String {
        template.replace("{table}", &quote_ident(table, self.quote))
    }
}

#[cfg(feature = "postgres")]
mod pg {
    use super::*;
    use crate::backend::postgres::{pooler, Arg};
    use sqlx::Row;

    pub(super) const TEXTS: Texts = Texts {
        quote: '"',
        fence: "UPDATE {table} SET {set}
WHERE lock_key = $1 AND owner = $2 AND fencing_token = $3{live}",
        live: " AND expires_at > statement_timestamp()",
        succeed:
            "success_token = fencing_token, last_outcome = 1, finished_at = statement_timestamp()",
        // `s` locks the row only if it is free (no live lease, no lock_in committed or not) and
        // no other transaction has it locked: SKIP LOCKED, so the caller's session never waits
        // on a row lock, and a busy key is never locked by it. `u` writes the new tenure on the
        // row `s` locked. `i` creates a key no one has used, when the statement's snapshot has
        // no row (two racing creators: ON CONFLICT DO NOTHING, the second is busy).
        lock_in: "WITH s AS (
    SELECT lock_key FROM {table}
    WHERE lock_key = $1 AND expires_at <= statement_timestamp()
    FOR UPDATE SKIP LOCKED
), u AS (
    UPDATE {table} AS l SET owner = $2, holder = $3, hold_count = 1,
        fencing_token = greatest(l.fencing_token + 1, (extract(epoch FROM statement_timestamp()) * 1000000)::int8),
        success_token = greatest(l.fencing_token + 1, (extract(epoch FROM statement_timestamp()) * 1000000)::int8),
        acquired_at = statement_timestamp(), expires_at = statement_timestamp(),
        available_at = NULL, attempt_id = NULL, contended = false,
        last_outcome = 1, finished_at = statement_timestamp()
    FROM s WHERE l.lock_key = s.lock_key
    RETURNING l.fencing_token
), i AS (
    INSERT INTO {table} (lock_key, owner, hold_count, fencing_token, expires_at, acquired_at,
                         holder, last_outcome, finished_at, success_token)
    SELECT $1, $2, 1, n.token, statement_timestamp(), statement_timestamp(), $3, 1,
           statement_timestamp(), n.token
    FROM (SELECT (extract(epoch FROM statement_timestamp()) * 1000000)::int8 AS token) n
    WHERE NOT EXISTS (SELECT 1 FROM {table} WHERE lock_key = $1)
    ON CONFLICT (lock_key) DO NOTHING
    RETURNING fencing_token
)
SELECT fencing_token FROM u UNION ALL SELECT fencing_token FROM i",
        release_in: "UPDATE {table} SET hold_count = 0, owner = NULL,
    expires_at = greatest(statement_timestamp(), available_at),
    success_token = fencing_token, last_outcome = 1, finished_at = statement_timestamp(),
    release_token = fencing_token
WHERE lock_key = $1 AND owner = $2 AND fencing_token = $3 AND expires_at > statement_timestamp()
  AND hold_count = 1",
    };

    /// Runs `text` with `args` on the caller's connection: prepared, or (`simple`) inlined.
    async fn rows(
        conn: &mut sqlx::PgConnection,
        text: String,
        args: &[Arg<'_>],
        simple: bool,
    ) -> sqlx::Result<(u64, Option<i64>)> {
        if simple {
            let inlined = pooler::inline(&text, args)?;
            let mut affected = 0;
            let mut first = None;
            use futures_util::TryStreamExt as _;
            let mut stream = sqlx::raw_sql(sqlx::AssertSqlSafe(inlined)).fetch_many(&mut *conn);
            while let Some(item) = stream.try_next().await? {
                match item {
                    sqlx::Either::Left(done) => affected += done.rows_affected(),
                    sqlx::Either::Right(row) => {
                        if first.is_none() {
                            first = Some(row.try_get::<i64, _>(0)?);
                        }
                    }
                }
            }
            return Ok((affected, first));
        }
        let query = args
            .iter()
            .try_fold(sqlx::query(sql(text)), |q, arg| arg.bind(q))?;
        let rows = query.fetch_all(&mut *conn).await?;
        let first = match rows.first() {
            Some(row) if row.len() > 0 => Some(row.try_get::<i64, _>(0)?),
            _ => None,
        };
        Ok((rows.len() as u64, first))
    }

    impl sealed::Sealed for sqlx::PgConnection {
        const TEXTS: Texts = TEXTS;

        /// Prepared, or (`simple`) inlined.
        async fn owned_write(&mut self, text: String, row: Owned<'_>) -> sqlx::Result<u64> {
            if row.simple {
                let args = [
                    Arg::Text(row.key),
                    Arg::Text(row.owner),
                    Arg::Int8(row.token as i64),
                ];
                return Ok(rows(self, text, &args, true).await?.0);
            }
            owned_write!(self, text, row.key, row.owner, row.token).await
        }

        /// One statement: prepared (the connection's statement cache keeps its plan), or behind
        /// a pooler a simple query with the values inlined.
        async fn lock_in(&mut self, a: LockIn<'_>) -> sqlx::Result<Option<u64>> {
            let args = [Arg::Text(a.key), Arg::Text(a.owner), Arg::Text(a.holder)];
            let token = rows(self, a.text, &args, a.simple).await?.1;
            Ok(token.map(|t| t as u64))
        }
    }

    impl FenceConnection for sqlx::PgConnection {
        const BACKEND: &'static str = "postgres";

        /// Whether the key's row is locked by this transaction: its latest version's `xmax` is
        /// the transaction's id (a row lock, or a write of its own). At READ COMMITTED `s` may
        /// have locked the row's latest version and then found, re-checking it, that a lease
        /// committed after the statement's snapshot took the key: the row stays locked until the
        /// transaction ends. A transaction with no id yet has locked nothing. No answer counts
        /// as holding it. (A lock taken inside a savepoint of the caller's is under the
        /// savepoint's own id and is not seen: that call waits out its `wait`.)
        async fn holds_row_after_busy(&mut self, table: &str, key: &str, simple: bool) -> bool {
            let text = TEXTS.text(HOLDS_ROW, table);
            match rows(self, text, &[Arg::Text(key)], simple).await {
                Ok((_, first)) => first != Some(0),
                Err(_) => true,
            }
        }
    }

    /// 1 if the latest version of `$1`'s row is locked (or written) by this transaction, else 0;
    /// no row: nothing.
    const HOLDS_ROW: &str =
        "SELECT CASE WHEN xmax::text::int8 = txid_current_if_assigned() % 4294967296
    THEN 1::int8 ELSE 0::int8 END FROM {table} WHERE lock_key = $1";
}

#[cfg(feature = "mysql")]
mod my {
    use super::*;

    // sqlx sets CLIENT_FOUND_ROWS: rows_affected counts the matched row, changed or not.
    pub(super) const TEXTS: Texts = Texts {
        quote: '`',
        fence: "UPDATE {table} SET {set}
WHERE lock_key = ? AND owner = ? AND fencing_token = ?{live}",
        live: " AND expires_at > UTC_TIMESTAMP(6)",
        succeed: "success_token = fencing_token, last_outcome = 1, finished_at = UTC_TIMESTAMP(6)",
        // One single-row UPDATE by primary key: InnoDB locks the row and reads its latest
        // committed version whatever the isolation level, so two takers queue and the second
        // re-reads the first's committed write. The new token comes back in the OK packet
        // (LAST_INSERT_ID(expr)); its columns are assigned left to right, so `fencing_token`
        // is the new one where `success_token` reads it.
        lock_in: "UPDATE {table} SET fencing_token = LAST_INSERT_ID(GREATEST(fencing_token + 1,
        TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6)))),
    success_token = fencing_token, owner = ?, holder = ?, hold_count = 1,
    acquired_at = UTC_TIMESTAMP(6), expires_at = acquired_at, available_at = NULL,
    attempt_id = NULL, last_outcome = 1, finished_at = acquired_at
WHERE lock_key = ? AND expires_at <= UTC_TIMESTAMP(6)",
        release_in: "UPDATE {table} SET success_token = fencing_token, last_outcome = 1,
    finished_at = UTC_TIMESTAMP(6), release_token = fencing_token, hold_count = 0, owner = NULL,
    expires_at = greatest(UTC_TIMESTAMP(6), coalesce(available_at, UTC_TIMESTAMP(6)))
WHERE lock_key = ? AND owner = ? AND fencing_token = ? AND expires_at > UTC_TIMESTAMP(6)
  AND hold_count = 1",
    };

    impl sealed::Sealed for sqlx::MySqlConnection {
        const TEXTS: Texts = TEXTS;

        async fn owned_write(&mut self, text: String, row: Owned<'_>) -> sqlx::Result<u64> {
            owned_write!(self, text, row.key, row.owner, row.token).await
        }

        async fn lock_in(&mut self, a: LockIn<'_>) -> sqlx::Result<Option<u64>> {
            let mut text = a.text;
            if let Some(secs) = a.mariadb_wait {
                // MariaDB: the wait for the row lock is bounded for this statement only.
                text = format!("SET STATEMENT innodb_lock_wait_timeout = {secs} FOR {text}");
            }
            let done = sqlx::query(sql(text))
                .bind(a.owner)
                .bind(a.holder)
                .bind(a.key)
                .execute(&mut *self)
                .await?;
            Ok((done.rows_affected() == 1).then(|| done.last_insert_id()))
        }
    }

    impl FenceConnection for sqlx::MySqlConnection {
        const BACKEND: &'static str = "mysql";

        /// InnoDB at REPEATABLE READ or SERIALIZABLE keeps the lock of a row an `UPDATE` read and
        /// did not change (the key taken in the instant after the check); at READ COMMITTED it
        /// lets it go. So: the session's isolation level (MariaDB's `tx_isolation`, MySQL 8's
        /// `transaction_isolation`); anything but READ COMMITTED / READ UNCOMMITTED, or no
        /// answer, counts as holding the row.
        async fn holds_row_after_busy(&mut self, _table: &str, _key: &str, _simple: bool) -> bool {
            for variable in ["@@session.transaction_isolation", "@@session.tx_isolation"] {
                let text = format!("SELECT CAST({variable} AS CHAR)");
                if let Ok(level) = sqlx::query_scalar::<_, String>(sql(text))
                    .fetch_one(&mut *self)
                    .await
                {
                    return !matches!(level.as_str(), "READ-COMMITTED" | "READ-UNCOMMITTED");
                }
            }
            true
        }
    }
}

#[cfg(feature = "sqlite")]
mod lite {
    use super::*;
    use sqlx::Row;

    /// Milliseconds since the epoch, SQLite's clock as every dblock statement reads it.
    macro_rules! now {
        () => {
            "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"
        };
    }

    pub(super) const TEXTS: Texts = Texts {
        quote: '"',
        fence: "UPDATE {table} SET {set}
WHERE lock_key = $1 AND owner = $2 AND fencing_token = $3{live}",
        live: concat!(" AND expires_at > ", now!()),
        succeed: concat!(
            "success_token = fencing_token, last_outcome = 1, finished_at = ",
            now!()
        ),
        // One upsert: the database's write lock (taken by the statement, kept by the caller's
        // transaction) serialises it with every other writer of the file.
        lock_in: concat!(
            "INSERT INTO {table} (lock_key, owner, hold_count, fencing_token, expires_at,
    acquired_at, holder, last_outcome, finished_at, success_token)
VALUES ($1, $2, 1, ",
            now!(),
            " * 1000, ",
            now!(),
            ", ",
            now!(),
            ", $3, 1, ",
            now!(),
            ", ",
            now!(),
            " * 1000)
ON CONFLICT (lock_key) DO UPDATE SET owner = excluded.owner, holder = excluded.holder,
    hold_count = 1, fencing_token = max(fencing_token + 1, excluded.fencing_token),
    success_token = max(fencing_token + 1, excluded.fencing_token),
    acquired_at = excluded.acquired_at, expires_at = excluded.expires_at, available_at = NULL,
    attempt_id = NULL, last_outcome = 1, finished_at = excluded.finished_at
WHERE expires_at <= excluded.acquired_at
RETURNING fencing_token"
        ),
        release_in: concat!(
            "UPDATE {table} SET success_token = fencing_token, last_outcome = 1, finished_at = ",
            now!(),
            ", release_token = fencing_token, hold_count = 0, owner = NULL,
    expires_at = max(",
            now!(),
            ", coalesce(available_at, 0))
WHERE lock_key = $1 AND owner = $2 AND fencing_token = $3 AND hold_count = 1
  AND expires_at > ",
            now!()
        ),
    };

    impl sealed::Sealed for sqlx::SqliteConnection {
        const TEXTS: Texts = TEXTS;

        async fn owned_write(&mut self, text: String, row: Owned<'_>) -> sqlx::Result<u64> {
            owned_write!(self, text, row.key, row.owner, row.token).await
        }

        async fn lock_in(&mut self, a: LockIn<'_>) -> sqlx::Result<Option<u64>> {
            let row = sqlx::query(sql(a.text))
                .bind(a.key)
                .bind(a.owner)
                .bind(a.holder)
                .fetch_optional(&mut *self)
                .await?;
            row.map(|r| r.try_get::<i64, _>(0).map(|t| t as u64))
                .transpose()
        }
    }

    /// The statement took the file's write lock and the caller's transaction keeps it: the
    /// holder could not release while the call waited (the trait's default, `true`).
    impl FenceConnection for sqlx::SqliteConnection {
        const BACKEND: &'static str = "sqlite";
    }
}
