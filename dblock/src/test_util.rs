//! Test hooks and the benchmark's ceiling, behind the private `_test-util` feature: not part of
//! the API, changed without notice, never needed by an application.
//!
//! ```
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let locker = dblock::Locker::connect("sqlite::memory:").await?;
//! locker.migrate().await?;
//! let raw = dblock::test_util::statements(&locker);
//! let token = raw.acquire("k", "owner-1", std::time::Duration::from_secs(30)).await?;
//! assert!(raw.release("k", "owner-1", token.expect("free")).await?);
//! # Ok(()) }
//! # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
//! ```

use std::time::Duration;

use tokio::time::Instant;

use crate::backend::coalesce::ReleaseRow;
use crate::backend::{Acquire, Attempt, Backend, HoldRef, Outcome, Released};
use crate::locker::Locker;

fn with_backend(locker: &Locker, change: impl FnOnce(&Backend) -> Backend) -> Locker {
    let shared = locker.shared();
    match shared.backend() {
        Ok(backend) => Locker::from_shared(shared.on_backend(change(backend))),
        Err(_) => locker.clone(),
    }
}

/// The same locker, sending the MySQL 8 statements (no `RETURNING`) even to MariaDB, so the
/// tests cover that path. Other backends: unchanged.
pub fn mysql8_statements(locker: &Locker) -> Locker {
    with_backend(locker, Backend::without_returning)
}

/// The same locker without LISTEN/NOTIFY wake-ups: waiters only poll.
pub fn polling_only(locker: &Locker) -> Locker {
    with_backend(locker, Backend::without_notify)
}

/// PostgreSQL: a `pgbench` script of one lock cycle with the locker's own acquire and release
/// statements, as prepared statements with the library's binds (the benchmark measures the
/// server's cost of dblock's SQL with it, apart from the client's).
pub fn pgbench_script(locker: &Locker) -> Option<String> {
    locker.shared().backend().ok()?.pgbench_script()
}

/// Coalesced statements (more than one row) the locker has sent on its table, and the rows
/// in them: acquires, releases and extensions together.
pub fn coalesced(locker: &Locker) -> (u64, u64) {
    locker.shared().coalescer.coalesced()
}

/// Whether the locker sends its statements in pooler mode (PostgreSQL behind a transaction
/// pooler, configured or found out); `false` elsewhere.
pub fn pooler_mode(locker: &Locker) -> bool {
    locker.shared().backend().is_ok_and(|b| b.pooler())
}

/// PostgreSQL: the NOTIFY channel of the locker's table.
pub fn notify_channel(locker: &Locker) -> Option<String> {
    locker.shared().backend().ok()?.notify_channel()
}

/// The locker's own acquire and release statements on its own pool, sent one by one with none
/// of the client's machinery (no task, no retry, no guard, no serialisation): the benchmark's
/// ceiling. Sharing the pool set-up and the binds with the library, it cannot drift from it.
pub fn statements(locker: &Locker) -> Statements {
    Statements {
        locker: locker.clone(),
    }
}

/// What the locker's renewal task has done so far: wake-ups that sent statements, statements,
/// leases sent for extension, and the time spent waiting for those statements.
pub fn renewal_stats(locker: &Locker) -> (u64, u64, u64, Duration) {
    use std::sync::atomic::Ordering::Relaxed;
    let s = &locker.shared().renewer.stats;
    (
        s.ticks.load(Relaxed),
        s.statements.load(Relaxed),
        s.leases.load(Relaxed),
        Duration::from_micros(s.busy_us.load(Relaxed)),
    )
}

/// How long one raw statement may take.
const STATEMENT_LIMIT: Duration = Duration::from_secs(10);

/// See [`statements`].
pub struct Statements {
    locker: Locker,
}

impl Statements {
    /// `send(backend, limit)` with the statement limit from now; a failure as its sqlx error.
    async fn send<'a, T, F>(
        &'a self,
        send: impl FnOnce(&'a Backend, Instant) -> F,
    ) -> Result<T, sqlx::Error>
    where
        F: std::future::Future<Output = Result<T, crate::backend::Failed>>,
    {
        let limit = Instant::now() + STATEMENT_LIMIT;
        send(self.backend()?, limit).await.map_err(|f| f.error)
    }

    fn backend(&self) -> Result<&Backend, sqlx::Error> {
        self.locker
            .shared()
            .backend()
            .map_err(|e| sqlx::Error::Configuration(e.to_string().into()))
    }

    /// The values of `owner`'s first hold of `key` for `ttl`, with a fresh attempt id.
    fn first_hold<'a>(&'a self, key: &'a str, owner: &'a str, ttl: Duration) -> Acquire<'a> {
        Acquire {
            key,
            owner,
            ttl_us: ttl.as_micros() as i64,
            holder: &self.locker.shared().holder,
            attempt: fastrand::i64(1..i64::MAX),
            waiting: false,
            tenure: None,
            held: 0,
            min_hold_us: 0,
            once: false,
        }
    }

    /// One acquire statement for `owner`: the fencing token, or `None` when the key is busy.
    pub async fn acquire(
        &self,
        key: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Option<u64>, sqlx::Error> {
        let attempt = self.first_hold(key, owner, ttl);
        Ok(token(self.send(|b, limit| b.run(&attempt, limit)).await?))
    }

    /// One release statement: `true` if it released a hold of `owner` in that tenure.
    pub async fn release(
        &self,
        key: &str,
        owner: &str,
        fencing_token: u64,
    ) -> Result<bool, sqlx::Error> {
        let hold = HoldRef {
            key,
            owner,
            fencing_token,
        };
        let release = crate::backend::Release {
            hold,
            remaining: 0,
            outcome: Some(Outcome::Succeeded),
            release_id: fastrand::i64(1..i64::MAX),
        };
        let released = self.send(|b, limit| b.run(&release, limit)).await?;
        Ok(released != Released::NotHeld)
    }

    /// One coalesced acquire statement for `keys` (sorted by bytes, distinct), as the locker's
    /// coalescer sends a batch: each key's fencing token, or `None` where it is busy. One key
    /// goes as the one-row statement, as in the coalescer.
    pub async fn acquire_batch(
        &self,
        keys: &[String],
        owner: &str,
        ttl: Duration,
    ) -> Result<Vec<Option<u64>>, sqlx::Error> {
        let rows: Vec<Acquire<'_>> = keys
            .iter()
            .map(|key| self.first_hold(key, owner, ttl))
            .collect();
        let attempts = self.send(|b, limit| b.acquire_batch(&rows, limit)).await?;
        Ok(attempts.into_iter().map(token).collect())
    }

    /// One coalesced release statement for `held` (key and fencing token, sorted by key,
    /// distinct keys), as the locker's coalescer sends a batch: `true` for each hold of `owner`
    /// it released.
    pub async fn release_batch(
        &self,
        held: &[(String, u64)],
        owner: &str,
    ) -> Result<Vec<bool>, sqlx::Error> {
        let rows: Vec<ReleaseRow> = held
            .iter()
            .map(|(key, fencing_token)| {
                let hold = HoldRef {
                    key,
                    owner,
                    fencing_token: *fencing_token,
                };
                let release_id = fastrand::i64(1..i64::MAX);
                ReleaseRow::new(&hold, 0, Some(Outcome::Succeeded), release_id)
            })
            .collect();
        let released = self.send(|b, limit| b.release_batch(&rows, limit)).await?;
        Ok(released
            .into_iter()
            .map(|r| r != Released::NotHeld)
            .collect())
    }

    /// One batched lock cycle: `keys` (sorted by bytes, distinct) acquired by `owner` in one
    /// coalesced statement and released in another. An error if a key was busy or a hold was
    /// not released: the benchmark's keys are its own.
    pub async fn cycle_batch(
        &self,
        keys: &[String],
        owner: &str,
        ttl: Duration,
    ) -> Result<(), sqlx::Error> {
        let tokens = self.acquire_batch(keys, owner, ttl).await?;
        let held = keys
            .iter()
            .zip(tokens)
            .map(|(key, token)| match token {
                Some(token) => Ok((key.clone(), token)),
                None => Err(sqlx::Error::Protocol(format!("key `{key}` was busy"))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let released = self.release_batch(&held, owner).await?;
        match held.iter().zip(released).find(|(_, r)| !r) {
            Some(((key, _), _)) => Err(sqlx::Error::Protocol(format!(
                "the hold of `{key}` was not released"
            ))),
            None => Ok(()),
        }
    }
}

/// An attempt's fencing token, `None` when it did not acquire.
fn token(attempt: Attempt) -> Option<u64> {
    match attempt {
        Attempt::Acquired(grant) => Some(grant.fencing_token),
        Attempt::Busy { .. } | Attempt::Done { .. } => None,
    }
}

/// MySQL / MariaDB: the session value of the system variable `name` (such as Galera's
/// `wsrep_retry_autocommit`), read as text on a connection of the locker's own pool: the settings
/// its lock statements run with. `Ok(None)` for a locker of another backend.
pub async fn mysql_session_variable(
    locker: &Locker,
    name: &str,
) -> Result<Option<String>, sqlx::Error> {
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return Err(sqlx::Error::Configuration(
            format!("not a system variable: {name:?}").into(),
        ));
    }
    locker
        .shared()
        .backend()
        .map_err(|e| sqlx::Error::Configuration(e.to_string().into()))?
        .mysql_session_variable(name)
        .await
}
