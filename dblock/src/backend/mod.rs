//! The database side: one module per backend, each with the handful of statements dblock needs.
//!
//! Every operation is ONE statement sent in ONE round trip on an autocommit connection. The
//! comment above each statement says why it is atomic on its own.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::LockInfo;

#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;

#[cfg(not(any(feature = "postgres", feature = "mysql", feature = "sqlite")))]
compile_error!("dblock needs at least one backend feature: `sqlite`, `postgres` or `mysql`");

/// What one acquire statement is asked to do.
pub(crate) struct AcquireParams<'a> {
    pub key: &'a str,
    pub owner: &'a str,
    /// Lease length in microseconds (validated: > 0 and fits the database's interval type).
    pub ttl_us: i64,
    pub holder: &'a str,
    /// Random id of this `lock()` call. A retry after an unknown outcome sends the same id, so
    /// the statement recognises its own earlier success instead of counting the hold twice.
    pub attempt: i64,
    /// A waiter whose LISTEN is in place: on PostgreSQL, a busy attempt asks for a NOTIFY.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub waiting: bool,
}

/// A lock that the statement granted (first hold, takeover or re-entry).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Grant {
    pub hold_count: u32,
    pub fencing_token: u64,
    pub expires_at_us: i64,
}

/// The outcome of one acquire statement.
#[derive(Debug)]
pub(crate) enum Attempt {
    Acquired(Grant),
    /// Held by someone else; `retry_after` is the holder's remaining lease where the backend
    /// reports it, measured on the database clock.
    Busy {
        retry_after: Option<Duration>,
    },
}

/// What one release statement did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Released {
    /// The hold count reached zero: the key is free.
    Free,
    /// Still held by the same owner at this count.
    StillHeld(u32),
    /// Nothing matched: not the owner, a different tenure, or the lease already ended.
    NotHeld,
}

/// The parameters every owner-checked statement carries.
pub(crate) struct HoldRef<'a> {
    pub key: &'a str,
    pub owner: &'a str,
    pub fencing_token: u64,
}

/// One lease in a batched extension.
pub(crate) struct RenewItem<'a> {
    pub key: &'a str,
    pub owner: &'a str,
    pub fencing_token: u64,
    pub ttl_us: i64,
}

/// The holds a batched extension found live and extended: (key, owner, fencing token).
pub(crate) type Extended = Vec<(String, String, u64)>;

/// The database behind a [`Locker`](crate::Locker).
#[derive(Clone, Debug)]
pub(crate) enum Backend {
    #[cfg(feature = "postgres")]
    Postgres(postgres::Pg),
    #[cfg(feature = "mysql")]
    MySql(mysql::My),
    #[cfg(feature = "sqlite")]
    Sqlite(sqlite::Lite),
}

/// Forwards a call to whichever backend is active.
macro_rules! dispatch {
    ($self:expr, $b:ident => $call:expr) => {
        match $self {
            #[cfg(feature = "postgres")]
            Backend::Postgres($b) => $call,
            #[cfg(feature = "mysql")]
            Backend::MySql($b) => $call,
            #[cfg(feature = "sqlite")]
            Backend::Sqlite($b) => $call,
        }
    };
}

impl Backend {
    pub(crate) fn name(&self) -> &'static str {
        dispatch!(self, _b => _b.name())
    }

    pub(crate) fn statements(&self) -> Vec<(&'static str, String)> {
        let listed = dispatch!(self, b => b.statements());
        listed
            .into_iter()
            .map(|(name, sql)| (name, sql.as_str().to_owned()))
            .collect()
    }

    pub(crate) async fn migrate(&self) -> Result<(), sqlx::Error> {
        dispatch!(self, b => b.migrate().await)
    }

    pub(crate) async fn acquire(&self, p: &AcquireParams<'_>) -> Result<Attempt, sqlx::Error> {
        dispatch!(self, b => b.acquire(p).await)
    }

    /// Decrements the hold count if `h` is the live tenure, recording `release_id` in the row;
    /// a repeat with the same id (after a lost reply) then matches nothing instead of
    /// decrementing twice. Callers serialise the owner's operations on the key around it.
    pub(crate) async fn release(
        &self,
        h: &HoldRef<'_>,
        release_id: i64,
    ) -> Result<Released, sqlx::Error> {
        dispatch!(self, b => b.release(h, release_id).await)
    }

    /// Pushes the lease end to at least `now + ttl`; `None` if `h` is not the live tenure.
    pub(crate) async fn extend(
        &self,
        h: &HoldRef<'_>,
        ttl_us: i64,
    ) -> Result<Option<i64>, sqlx::Error> {
        dispatch!(self, b => b.extend(h, ttl_us).await)
    }

    /// Extends every live hold in `items` in one statement; returns those it extended.
    pub(crate) async fn extend_many(
        &self,
        items: &[RenewItem<'_>],
    ) -> Result<Extended, sqlx::Error> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        dispatch!(self, b => b.extend_many(items).await)
    }

    pub(crate) async fn inspect(&self, key: &str) -> Result<Option<LockInfo>, sqlx::Error> {
        dispatch!(self, b => b.inspect(key).await)
    }

    pub(crate) async fn held(&self) -> Result<Vec<LockInfo>, sqlx::Error> {
        dispatch!(self, b => b.held().await)
    }

    pub(crate) async fn force_release(&self, key: &str) -> Result<bool, sqlx::Error> {
        dispatch!(self, b => b.force_release(key).await)
    }

    pub(crate) async fn purge(&self, older_than_us: i64) -> Result<u64, sqlx::Error> {
        dispatch!(self, b => b.purge(older_than_us).await)
    }
}

/// How a failed statement may be treated.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The server rolled the statement back (serialization failure, deadlock, lock wait timeout,
    /// Galera certification conflict): it changed nothing and can be sent again as it is.
    NotCommitted,
    /// The connection broke: the statement may or may not have committed.
    Unknown,
    /// Anything else (bad SQL, missing table, permissions): retrying will not help.
    Fatal,
}

pub(crate) fn classify(e: &sqlx::Error) -> Failure {
    match e {
        sqlx::Error::Database(db) => {
            #[cfg(feature = "mysql")]
            if let Some(my) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
                return match my.number() {
                    // ER_LOCK_DEADLOCK (also Galera's certification conflict), ER_LOCK_WAIT_TIMEOUT.
                    1213 | 1205 => Failure::NotCommitted,
                    // WSREP not ready, server shutdown, gone away, lost connection.
                    1047 | 1053 | 2006 | 2013 => Failure::Unknown,
                    _ => Failure::Fatal,
                };
            }
            match db.code().as_deref() {
                // PostgreSQL: serialization_failure, deadlock_detected.
                Some("40001") | Some("40P01") => Failure::NotCommitted,
                // PostgreSQL: connection exceptions and administrator shutdowns.
                Some(c) if c.starts_with("08") || c.starts_with("57P") => Failure::Unknown,
                // SQLite: SQLITE_BUSY / SQLITE_LOCKED and their extended codes, after the busy
                // timeout ran out: the statement never got the write lock.
                Some("5") | Some("6") | Some("261") | Some("262") | Some("517") => {
                    Failure::NotCommitted
                }
                _ => Failure::Fatal,
            }
        }
        sqlx::Error::Io(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => Failure::Unknown,
        // Nothing was sent, and the pool already waited its whole timeout for a connection:
        // another try would only wait as long again.
        sqlx::Error::PoolTimedOut => Failure::Fatal,
        _ => Failure::Fatal,
    }
}

/// Microseconds since the Unix epoch (as the database reports them) to `SystemTime`.
pub(crate) fn time_from_micros(us: i64) -> SystemTime {
    if us >= 0 {
        UNIX_EPOCH + Duration::from_micros(us as u64)
    } else {
        UNIX_EPOCH - Duration::from_micros(us.unsigned_abs())
    }
}

/// A non-negative millisecond count from the database to a `Duration`.
pub(crate) fn millis(ms: i64) -> Duration {
    Duration::from_millis(ms.max(0) as u64)
}

/// Quotes an identifier that [`crate::locker::validate_table`] already accepted.
pub(crate) fn quote_ident(name: &str, quote: char) -> String {
    name.split('.')
        .map(|part| format!("{quote}{part}{quote}"))
        .collect::<Vec<_>>()
        .join(".")
}

#[cfg(test)]
mod tests {
    /// The files in `migrations/` are what `Locker::migrate()` runs, for the default table.
    #[test]
    fn migration_files_match_the_ddl_migrate_runs() {
        #[cfg(feature = "postgres")]
        assert!(
            include_str!("../../../migrations/postgres/0001_dblock_locks.sql")
                .ends_with(&super::postgres::DDL.replace("{table}", "\"dblock_locks\""))
        );
        #[cfg(feature = "mysql")]
        assert!(
            include_str!("../../../migrations/mysql/0001_dblock_locks.sql")
                .ends_with(&super::mysql::DDL.replace("{table}", "`dblock_locks`"))
        );
        #[cfg(feature = "sqlite")]
        assert!(
            include_str!("../../../migrations/sqlite/0001_dblock_locks.sql")
                .ends_with(&super::sqlite::DDL.replace("{table}", "\"dblock_locks\""))
        );
    }
}

/// The statements themselves, below the public API: what only they can show.
#[cfg(all(test, feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod statement_tests {
    use super::*;
    use crate::Locker;

    /// SQLite in memory, and the servers of the integration tests when they are reachable.
    async fn lockers() -> Vec<(String, Locker)> {
        let table = format!("t_stmt_{}_{}", std::process::id(), fastrand::u32(..));
        let mut out = vec![(
            "sqlite".to_owned(),
            Locker::connect("sqlite::memory:").await.unwrap(),
        )];
        let require = std::env::var("DBLOCK_REQUIRE_SERVERS").is_ok_and(|v| v == "1");
        for (name, var, default) in [
            (
                "postgres",
                "DBLOCK_POSTGRES_URL",
                "postgres://postgres@127.0.0.1:5432/test",
            ),
            (
                "mariadb",
                "DBLOCK_MYSQL_URL",
                "mysql://root@127.0.0.1:3306/test",
            ),
        ] {
            let url = std::env::var(var).unwrap_or_else(|_| default.into());
            match Locker::connect(&url).await {
                Ok(l) => {
                    if name == "mariadb" {
                        out.push(("mysql8-path".into(), l.__without_returning()));
                    }
                    out.push((name.into(), l));
                }
                Err(e) if !require => eprintln!("!!!!! SKIPPING {name}: {e}"),
                Err(e) => panic!("{name} unreachable and DBLOCK_REQUIRE_SERVERS=1: {e}"),
            }
        }
        let mut tabled = Vec::new();
        for (name, l) in out {
            let l = l.table(&table);
            l.migrate().await.unwrap();
            tabled.push((name, l));
        }
        tabled
    }

    fn grant(a: Attempt) -> Grant {
        match a {
            Attempt::Acquired(g) => g,
            Attempt::Busy { .. } => panic!("expected a grant"),
        }
    }

    #[tokio::test]
    async fn a_repeated_attempt_is_recognised_not_counted_twice() {
        for (name, l) in lockers().await {
            let b = l.backend().unwrap();
            let mut p = AcquireParams {
                key: "idem",
                owner: "owner-1",
                ttl_us: 30_000_000,
                holder: "h",
                attempt: 7,
                waiting: false,
            };
            let first = grant(b.acquire(&p).await.unwrap());
            let repeat = grant(b.acquire(&p).await.unwrap());
            assert_eq!(
                (first.hold_count, repeat.hold_count),
                (1, 1),
                "{name}: repeat counted twice"
            );
            assert_eq!(first.fencing_token, repeat.fencing_token, "{name}");
            p.attempt = 8;
            assert_eq!(
                grant(b.acquire(&p).await.unwrap()).hold_count,
                2,
                "{name}: new attempt is re-entry"
            );
            assert_eq!(
                grant(b.acquire(&p).await.unwrap()).hold_count,
                2,
                "{name}: repeat of re-entry"
            );
            assert_eq!(
                l.inspect("idem").await.unwrap().unwrap().hold_count,
                2,
                "{name}"
            );

            // Another owner's attempt with the same id is still busy.
            let other = AcquireParams {
                owner: "owner-2",
                ..p
            };
            assert!(
                matches!(b.acquire(&other).await.unwrap(), Attempt::Busy { .. }),
                "{name}"
            );

            // Release: a repeat of the same release (same id, after a lost reply) matches
            // nothing instead of decrementing twice; a new release decrements again.
            let h = HoldRef {
                key: "idem",
                owner: "owner-1",
                fencing_token: first.fencing_token,
            };
            assert_eq!(
                b.release(&h, 100).await.unwrap(),
                Released::StillHeld(1),
                "{name}"
            );
            assert_eq!(
                b.release(&h, 100).await.unwrap(),
                Released::NotHeld,
                "{name}: applied twice"
            );
            assert_eq!(
                l.inspect("idem").await.unwrap().unwrap().hold_count,
                1,
                "{name}"
            );
            let stale = HoldRef {
                fencing_token: first.fencing_token - 1,
                ..h
            };
            assert_eq!(
                b.release(&stale, 101).await.unwrap(),
                Released::NotHeld,
                "{name}: other tenure"
            );
            assert_eq!(b.release(&h, 102).await.unwrap(), Released::Free, "{name}");
            assert_eq!(
                b.release(&h, 103).await.unwrap(),
                Released::NotHeld,
                "{name}"
            );
        }
    }

    #[tokio::test]
    async fn busy_attempts_report_the_holders_time_left_where_the_dialect_can() {
        for (name, l) in lockers().await {
            let b = l.backend().unwrap();
            let p = AcquireParams {
                key: "left",
                owner: "a",
                ttl_us: 10_000_000,
                holder: "h",
                attempt: 1,
                waiting: false,
            };
            grant(b.acquire(&p).await.unwrap());
            let q = AcquireParams {
                owner: "b",
                attempt: 2,
                ..p
            };
            match b.acquire(&q).await.unwrap() {
                Attempt::Busy {
                    retry_after: Some(left),
                } => {
                    assert!(
                        left > std::time::Duration::from_secs(8)
                            && left <= std::time::Duration::from_secs(10),
                        "{name}: {left:?}"
                    );
                }
                Attempt::Busy { retry_after: None } => {
                    assert!(
                        name == "sqlite" || name == "mysql8-path",
                        "{name}: no time left reported"
                    )
                }
                Attempt::Acquired(_) => panic!("{name}: double grant"),
            }
        }
    }
}
