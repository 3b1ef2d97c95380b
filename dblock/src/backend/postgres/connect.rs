//! Connecting to PostgreSQL: the pool set up for locking (settings at start-up, or by `SET`
//! after connecting, or with every statement behind a pooler), and finding out whether a
//! transaction pooler stands between the locker and the server.

use std::str::FromStr;
use std::sync::Arc;

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions, Postgres};
use sqlx::{AssertSqlSafe, Connection, Row};

use super::{Pg, ACQUIRE_TIMEOUT, KEEPALIVE_COUNT, KEEPALIVE_IDLE, KEEPALIVE_INTERVAL};
use crate::backend::Conns;
use crate::connect::ConnectOptions;
use crate::error::LockError;

/// Server-side TCP keepalives, set at start-up (no extra round trip).
pub(super) fn keepalives() -> [(&'static str, &'static str); 3] {
    [
        ("tcp_keepalives_idle", KEEPALIVE_IDLE),
        ("tcp_keepalives_interval", KEEPALIVE_INTERVAL),
        ("tcp_keepalives_count", KEEPALIVE_COUNT),
    ]
}

/// A pool configured for locking: autocommit connections at READ COMMITTED, statement and lock
/// time-outs and server keepalives (all set at start-up, no extra round trip), no ping before
/// each statement, a bounded wait for a connection.
///
/// Behind a pooler the start-up sends only what a pooler accepts out of the box (no `options`,
/// no `extra_float_digits`): isolation and time-outs come with each statement instead
/// ([`Pooler::prefix`]), keepalives are the pooler's. Unless `opts.pooler` says which, the
/// direct path is tried first and a transaction pooler found on it ([`pooler_found`], or a
/// refused start-up) means connecting again in pooler mode, said once at `info`.
pub(crate) async fn connect(
    url: &str,
    table: &str,
    opts: &ConnectOptions,
) -> Result<Pg, LockError> {
    let parsed = PgConnectOptions::from_str(url).map_err(|e| crate::backend::bad_url(url, e))?;
    if opts.pooler == Some(true) {
        return connect_pool(parsed, table, opts, Startup::Pooler).await;
    }
    // The direct path first; what the first connections show decides (see `pooler_found`).
    let direct = connect_pool(parsed.clone(), table, opts, Startup::Options).await;
    let reason = match &direct {
        Err(LockError::Database(e)) if refused_startup(e) => {
            // Refused, not dropped: a pooler that knows no `options`. In session pooling mode
            // (each client its own server session) the settings can come by SET once a
            // connection is made, and statements stay prepared. Looked at without any SET, so
            // that nothing sticks to a server connection a transaction pooler shares.
            let bare = parsed.clone().extra_float_digits(None);
            if !shared_at_any_look(&bare)
                .await
                .map_err(LockError::Database)?
            {
                let pg = connect_pool(bare, table, opts, Startup::SetAfterConnect).await?;
                pg.settings.pooler.settle(false);
                tracing::info!(
                    url = %crate::redact::redact(url),
                    "PostgreSQL behind a session pooler that refuses start-up settings: they are \
                     set on each new connection instead; statements stay prepared"
                );
                return Ok(pg);
            }
            Some(format!(
                "it refused the session settings sent at start-up ({e}), and server connections \
                 are shared between clients"
            ))
        }
        Err(_) => None,
        Ok(pg) => pooler_found(&pg.pool, opts)
            .await
            .map_err(LockError::Database)?,
    };
    let Some(reason) = reason else {
        if let Ok(pg) = &direct {
            pg.settings.pooler.settle(false);
        }
        return direct;
    };
    if opts.pooler == Some(false) {
        return Err(LockError::Config(format!(
            "{} looks like a transaction pooler: {reason}; `pooler(false)` forces the direct path, \
             use ConnectOptions::pooler(true) (or leave it unset) to lock through it",
            crate::redact::redact(url)
        )));
    }
    if let Ok(pg) = &direct {
        pg.pool.close().await;
    }
    tracing::info!(
        url = %crate::redact::redact(url),
        %reason,
        listen = opts.listen_url.is_some(),
        "PostgreSQL behind a transaction pooler: statements go as simple queries with their settings; \
         waiters poll (give ConnectOptions::listen_url a direct URL for NOTIFY wake-ups)"
    );
    let pooled = ConnectOptions {
        pooler: Some(true),
        ..opts.clone()
    };
    connect_pool(parsed, table, &pooled, Startup::Pooler).await
}

/// Whether a connect failed because the server side refused the start-up parameters (a
/// PgBouncer that does not know `options` or `extra_float_digits`: "unsupported startup
/// parameter").
fn refused_startup(e: &sqlx::Error) -> bool {
    e.to_string().contains("unsupported startup parameter")
}

/// The marker that [`pooler_found`] sets on one connection and looks for on another.
const PROBE_SETTING: &str = "dblock.pooler_probe";

/// On a pool built for the direct path: why it is a transaction pooler, or `None` when it is
/// not. Two signs, each enough: the settings sent at start-up did not take effect (dropped by
/// a pooler that ignores them), or session state is shared between connections
/// ([`state_shared`]). Simple queries only: a prepared statement through such a pooler could
/// itself fail.
///
/// Its connection is the pool's first (kept by `first_connection`), taken through [`Conns`]: the
/// pool itself would have none to give until the kept one went back.
async fn pooler_found(
    pool: &Conns<Postgres>,
    opts: &ConnectOptions,
) -> sqlx::Result<Option<String>> {
    let mut conn = pool.acquire().await?;
    let rows = sqlx::raw_sql(AssertSqlSafe("SELECT current_setting('statement_timeout')"))
        .fetch_all(&mut *conn)
        .await?;
    pool.keep(conn);
    let timeout: String = rows
        .first()
        .map(|r| r.try_get(0))
        .transpose()?
        .unwrap_or_default();
    if parse_pg_duration_ms(&timeout) != Some(opts.statement_timeout.as_millis()) {
        return Ok(Some(format!(
            "the session settings sent at start-up did not take effect (statement_timeout is \
             {timeout:?}, not {} ms)",
            opts.statement_timeout.as_millis()
        )));
    }
    Ok(state_shared(&pool.connect_options()).await?.then(|| {
        "server connections are shared between clients (a session setting made on one connection \
         showed up on another, or a connection's server session changed between statements)"
            .to_owned()
    }))
}

/// How many times [`state_shared`] looks.
const PROBE_ROUNDS: usize = 8;

/// How many times, each on a fresh pair of connections, a pooler that refused the start-up
/// settings is looked at before it is taken for a session pooler. That answer is for good
/// (statements stay prepared), so it needs more than one look: a transaction pooler busy with
/// other clients can hand the two connections of one look two different, steady server
/// connections (seen once in CI, under the suite's load: a locker then failed its first
/// prepared statement with another client's).
const SESSION_POOLER_LOOKS: usize = 3;

/// [`state_shared`], [`SESSION_POOLER_LOOKS`] times: shared if any look says so.
async fn shared_at_any_look(options: &PgConnectOptions) -> sqlx::Result<bool> {
    for _ in 0..SESSION_POOLER_LOOKS {
        if state_shared(options).await? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Whether the server connections behind `options` are shared between clients (transaction or
/// statement pooling, whose pooler hands an idle server connection to the next client), seen
/// from two connections of our own held open side by side. A direct server, or session
/// pooling, gives each of them a session of its own for as long as it lives, so any of these
/// signs, in any of [`PROBE_ROUNDS`] rounds, means shared:
/// - a session setting made on the first shows up on the second,
/// - both report the same server process (`pg_backend_pid()`),
/// - either one's server process changes from one statement to the next.
///
/// An idle pooler shows the first two at once (it hands the second client the server
/// connection the first just left); under load one of them, or the third, shows within the
/// rounds. Simple queries only: a prepared statement through such a pooler could itself fail.
/// The marker is cleared again, so nothing is left on a shared server connection.
pub(crate) async fn state_shared(options: &PgConnectOptions) -> sqlx::Result<bool> {
    let marker = format!("{:016x}", fastrand::u64(..));
    let mut first = PgConnection::connect_with(options).await?;
    let mut second = match PgConnection::connect_with(options).await {
        Ok(c) => c,
        Err(e) => {
            let _ = first.close().await;
            return Err(e);
        }
    };
    let shared = probe_rounds(&mut first, &mut second, &marker).await;
    let cleared = sqlx::raw_sql(AssertSqlSafe(format!(
        "SELECT set_config('{PROBE_SETTING}', '', false)"
    )))
    .execute(&mut first)
    .await;
    let _ = first.close().await;
    let _ = second.close().await;
    let shared = shared?;
    cleared?;
    Ok(shared)
}

async fn probe_rounds(
    first: &mut PgConnection,
    second: &mut PgConnection,
    marker: &str,
) -> sqlx::Result<bool> {
    async fn pid_and_setting(
        conn: &mut PgConnection,
        sql: &str,
    ) -> sqlx::Result<(i32, Option<String>)> {
        let rows = sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .fetch_all(conn)
            .await?;
        let row = rows.first().ok_or(sqlx::Error::RowNotFound)?;
        Ok((row.try_get(0)?, row.try_get(1)?))
    }
    let set = format!("SELECT pg_backend_pid(), set_config('{PROBE_SETTING}', '{marker}', false)");
    let read = format!("SELECT pg_backend_pid(), current_setting('{PROBE_SETTING}', true)");
    let (first_pid, _) = pid_and_setting(first, &set).await?;
    let mut second_pid = None;
    for _ in 0..PROBE_ROUNDS {
        let (pid, seen) = pid_and_setting(second, &read).await?;
        if pid == first_pid
            || seen.as_deref() == Some(marker)
            || *second_pid.get_or_insert(pid) != pid
        {
            return Ok(true);
        }
        let (pid, seen) = pid_and_setting(first, &read).await?;
        if pid != first_pid || seen.as_deref() != Some(marker) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// A PostgreSQL duration setting as shown (`5s`, `5000ms`, `1min`, `0`) in milliseconds.
fn parse_pg_duration_ms(shown: &str) -> Option<u128> {
    let digits = shown.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let n: u128 = digits.parse().ok()?;
    let unit = &shown[digits.len()..];
    Some(match unit {
        "" | "ms" => n,
        "s" => n * 1000,
        "min" => n * 60_000,
        "h" => n * 3_600_000,
        "d" => n * 86_400_000,
        _ => return None,
    })
}

/// How the connections of a pool get their session settings ([`session_settings`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Startup {
    /// In the start-up packet's `options` (the direct path: no extra round trip).
    Options,
    /// By one SET query once connected: a session pooler that refuses `options`.
    SetAfterConnect,
    /// Not at all: behind a transaction pooler each statement brings them ([`Pooler::prefix`]).
    Pooler,
}

/// READ COMMITTED, the statement and lock time-outs, server keepalives, no sequential scans
/// and no JIT compilation: what a lock session runs with on the direct path.
///
/// `enable_seqscan = off`: every statement of the hot path reads the lock table by key, but the
/// plan PostgreSQL caches for a prepared statement (its generic plan, after five executions)
/// is chosen for the table as it is then. Made while the table is a page or two (a new
/// deployment), the coalesced statements' plan scanned the whole table for their keys, and a
/// server that never analyzes the table again (autovacuum off) kept that plan as the table grew:
/// 4.8 ms instead of 0.9 ms for a batch of 64 rows of 4,096 (see the test
/// `coalesced_statements_made_on_a_small_table_read_a_grown_one_by_key`). The setting keeps the
/// index whatever the table's size then. It only prices scans, never forbids one: a statement
/// with no index to use (`purge`) still scans. The cost lands on the listings (`held`), which
/// may then read a large table in key order through its index (300,000 rows: 117 ms instead of
/// 35 ms). A pool the application passes in (`Locker::postgres`) keeps its own settings.
/// Behind a transaction pooler statements are not prepared: each is planned for the table as
/// it is.
///
/// `jit = off`: the price `enable_seqscan = off` puts on a scan (10¹⁰) is far above
/// `jit_above_cost`, so every statement that scans (`purge` and its held-back read, on a table
/// of a few rows) was compiled by LLVM before it ran: 60–80 ms each, a one-row purge 200 ms
/// instead of 2 ms (server log, `log_min_duration_statement`). No statement of the lock table
/// reads enough rows for compiled expressions to pay. (PostgreSQL 11 and later have the
/// setting.)
fn session_settings(opts: &ConnectOptions) -> Vec<(&'static str, String)> {
    let ms = opts.statement_timeout.as_millis().to_string();
    let mut settings = vec![
        ("default_transaction_isolation", "read committed".to_owned()),
        ("statement_timeout", ms),
        (
            "lock_timeout",
            super::row_lock_wait(opts.statement_timeout)
                .as_millis()
                .to_string(),
        ),
        ("enable_seqscan", "off".to_owned()),
        ("jit", "off".to_owned()),
    ];
    settings.extend(keepalives().map(|(name, value)| (name, value.to_owned())));
    settings
}

/// The pool itself, its sessions set up as `startup` says, and its first connection made.
/// Its mode is `opts.pooler`'s, except that settings made by SET are the direct path.
async fn connect_pool(
    parsed: PgConnectOptions,
    table: &str,
    opts: &ConnectOptions,
    startup: Startup,
) -> Result<Pg, LockError> {
    let acquire_timeout = opts.acquire_timeout.unwrap_or(ACQUIRE_TIMEOUT);
    let pool = PgPoolOptions::new()
        .max_connections(opts.max_connections.unwrap_or(10))
        .test_before_acquire(false)
        .acquire_timeout(acquire_timeout);
    let settings = session_settings(opts);
    let (pool, opts) = match startup {
        Startup::Options => (
            pool.connect_lazy_with(
                parsed.options(settings.iter().map(|(name, value)| (*name, value.as_str()))),
            ),
            opts.clone(),
        ),
        Startup::Pooler => (
            pool.connect_lazy_with(parsed.extra_float_digits(None)),
            opts.clone(),
        ),
        Startup::SetAfterConnect => {
            let set: Arc<str> = settings
                .iter()
                .map(|(name, value)| format!("SET {name} = '{value}';"))
                .collect::<Vec<_>>()
                .join(" ")
                .into();
            let pool = pool
                .after_connect(move |conn, _| {
                    let set = set.clone();
                    Box::pin(async move {
                        sqlx::raw_sql(AssertSqlSafe(set.to_string()))
                            .execute(conn)
                            .await
                            .map(|_| ())
                    })
                })
                .connect_lazy_with(parsed.extra_float_digits(None));
            let direct = ConnectOptions {
                pooler: Some(false),
                ..opts.clone()
            };
            (pool, direct)
        }
    };
    let pool = Conns::own(pool);
    crate::backend::exec::first_connection(&pool, acquire_timeout).await?;
    Pg::configured(pool, table, &opts)
}
