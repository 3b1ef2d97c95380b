//! The fenced-write chaos worker and its checker, shared by `tests/chaos_kinds.rs` (single
//! servers through fault proxies, a clock that steps) and `tests/replicated.rs` (Patroni through a
//! switchover and a killed leader, Galera through a node kill).
//!
//! A worker process takes key `doc` with a lease (`lock`), by stealing it (`steal`), or with
//! `lock_in` in a transaction, and writes its fencing token into the app's table
//! (`DBLOCK_CHAOS_TABLE` + `_w`) in a transaction that fences it (the lease's `fence`) or holds it
//! (`lock_in`). The checker reads the committed writes in the order the app's table gives them
//! and requires their tokens never to go down ([`out_of_order`]). The workers need a server
//! backend; the checker builds with any.

#[cfg(any(feature = "postgres", feature = "mysql"))]
use std::time::{Duration, Instant};

#[cfg(any(feature = "postgres", feature = "mysql"))]
use dblock::Locker;

#[cfg(any(feature = "postgres", feature = "mysql"))]
use super::history::{self, now_us};

/// What a worker process starts with: the URL and lock table its parent gave it, a locker on
/// them (through its fault proxy), and `line`, which appends `pid text` to the shared history.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub struct Worker {
    pub url: String,
    pub table: String,
    pub locker: Locker,
    pub line: Box<dyn Fn(String)>,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl Worker {
    pub async fn start() -> Worker {
        let url = std::env::var("DBLOCK_CHAOS_URL").expect("DBLOCK_CHAOS_URL");
        let table = std::env::var("DBLOCK_CHAOS_TABLE").unwrap();
        let log = std::env::var("DBLOCK_CHAOS_LOG").unwrap();
        let options = dblock::ConnectOptions::new()
            .max_connections(2)
            .statement_timeout(Duration::from_secs(4));
        // Through its fault proxy, whose faults may already cut this first connection (a
        // reset at start-up failed a CI run), as the other chaos workers do (`history.rs`).
        let locker = loop {
            match Locker::connect_with(&url, options.clone()).await {
                Ok(l) => break l.table(&table),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        };
        let pid = std::process::id();
        let line = Box::new(move |text: String| {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .open(&log)
                .unwrap();
            f.write_all(format!("{pid} {text}\n").as_bytes()).unwrap();
        });
        Worker {
            url,
            table,
            locker,
            line,
        }
    }
}

/// The worker's own application pool (through its proxy, as the locker's), on which it takes the
/// key with `lock_in` in transactions.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub enum App {
    #[cfg(feature = "postgres")]
    Pg(sqlx::PgPool),
    #[cfg(feature = "mysql")]
    My(sqlx::MySqlPool),
}

/// How a transaction of the app's own holds the key: `lock_in` within a wait, or the fence of a
/// lease it holds.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub enum Take<'a> {
    LockIn(&'a Locker, Duration),
    Fence(&'a dblock::LockGuard),
}

/// One transaction holding the key ([`Take`]), a statement of the app's own with the token
/// (`$write`, the token bound), a short hold, a commit. Only dblock's errors are the worker's
/// to check: the app's own statements failing under the faults end the transaction (`None`).
#[cfg(any(feature = "postgres", feature = "mysql"))]
macro_rules! hold_in {
    ($pool:expr, $take:expr, $prepare:expr, $write:expr) => {{
        let app = async {
            let mut conn = $pool.acquire().await.ok()?;
            sqlx::raw_sql($prepare).execute(&mut *conn).await.ok()?;
            Some(conn)
        };
        let Some(mut conn) = app.await else {
            return Ok(None);
        };
        let Ok(mut tx) = sqlx::Connection::begin(&mut *conn).await else {
            return Ok(None);
        };
        let token = match $take {
            Take::LockIn(locker, wait) => locker
                .lock_in(&mut *tx, "doc")
                .wait(wait)
                .await?
                .fencing_token(),
            Take::Fence(guard) => {
                guard.fence(&mut *tx).await?;
                guard.fencing_token()
            }
        } as i64;
        let from = now_us();
        if sqlx::query(sqlx::AssertSqlSafe($write))
            .bind(token)
            .execute(&mut *tx)
            .await
            .is_err()
        {
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..40))).await;
        let to = now_us();
        Ok(tx.commit().await.ok().map(|()| (token, from, to)))
    }};
}

/// The same code on the app's pool of either backend: `on_pool!(app, |p| ...)`.
#[cfg(any(feature = "postgres", feature = "mysql"))]
macro_rules! on_pool {
    ($app:expr, |$p:ident| $e:expr) => {
        match $app {
            #[cfg(feature = "postgres")]
            App::Pg($p) => $e,
            #[cfg(feature = "mysql")]
            App::My($p) => $e,
        }
    };
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl App {
    pub fn connect(url: &str) -> App {
        fn options<DB: sqlx::Database>() -> sqlx::pool::PoolOptions<DB> {
            sqlx::pool::PoolOptions::new()
                .max_connections(2)
                .acquire_timeout(Duration::from_secs(4))
        }
        #[cfg(feature = "postgres")]
        if url.starts_with("postgres") {
            return App::Pg(options().connect_lazy(url).unwrap());
        }
        #[cfg(feature = "mysql")]
        return App::My(options().connect_lazy(url).unwrap());
        #[allow(unreachable_code)]
        {
            unreachable!("no backend for {url}")
        }
    }

    /// A transaction that held the key and committed: its token and the span in which it
    /// surely held it; `None` when its commit failed (or the whole call hung past its bound).
    /// `write`: the app's statement with the token (`$1` / `?`); `None`: a `SELECT` of it.
    pub async fn hold_in(
        &self,
        take: Take<'_>,
        write: Option<&str>,
    ) -> Result<Option<(i64, i64, i64)>, dblock::LockError> {
        let run = async {
            match self {
                // A transaction's statements on the proxied connection may hang with it: the
                // locker's statement timeout bounds dblock's, 4 s bound the app's own.
                #[cfg(feature = "postgres")]
                App::Pg(pool) => hold_in!(
                    pool,
                    take,
                    "SET statement_timeout = 4000",
                    write.unwrap_or("SELECT $1::bigint").to_owned()
                ),
                // Half the transactions at READ COMMITTED, where a busy `lock_in` waits for the
                // row; the others at MariaDB's REPEATABLE READ, where it is `Busy` at once.
                #[cfg(feature = "mysql")]
                App::My(pool) => hold_in!(
                    pool,
                    take,
                    if fastrand::bool() {
                        "SET SESSION max_statement_time = 4; \
                         SET TRANSACTION ISOLATION LEVEL READ COMMITTED"
                    } else {
                        "SET SESSION max_statement_time = 4"
                    },
                    write.unwrap_or("SELECT ?").to_owned()
                ),
            }
        };
        match tokio::time::timeout(Duration::from_secs(8), run).await {
            Ok(held) => held,
            Err(_) => Ok(None),
        }
    }

    /// Runs `sql` (statements of the test's own, no result) on the app's pool.
    pub async fn execute(&self, sql: &str) -> Result<(), sqlx::Error> {
        let sql = sqlx::AssertSqlSafe(sql.to_owned());
        on_pool!(self, |p| sqlx::raw_sql(sql).execute(p).await.map(drop))
    }

    /// The first column (`BIGINT`) of every row of the `SELECT` `sql`, in order.
    pub async fn column(&self, sql: &str) -> Result<Vec<i64>, sqlx::Error> {
        use sqlx::Row;
        let sql = sqlx::AssertSqlSafe(sql.to_owned());
        on_pool!(self, |p| sqlx::query(sql)
            .fetch_all(p)
            .await
            .map(|rows| rows.iter().map(|r| r.get(0)).collect()))
    }
}

/// The worker's pool has two connections, and a fault that delays replies by more than the ttl
/// can keep both busy past the call that used them (sqlx pings each connection on its way back
/// to the pool, and that ping waits for the delayed bytes too). A call then finds the pool
/// exhausted while the server accepts new connections, and says so: `PoolTimedOut`, a typed
/// answer and no broken promise of the kinds (seen once in a full run of the suite,
/// 2026-11-26, on a read). Every other error must still be typed.
pub fn pool_exhausted(e: &dblock::LockError) -> bool {
    matches!(e, dblock::LockError::Database(sqlx::Error::PoolTimedOut))
}

/// How a fenced-write worker runs.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub struct Plan {
    /// How long it takes, steals and writes (at most: `DBLOCK_CHAOS_STOP_FILE`, when set, ends
    /// the run as soon as that file exists).
    pub run: Duration,
    pub ttl: Duration,
    /// How long it stays after the run, so background releases finish on a healed network.
    pub linger: Duration,
    /// Whether some holds are `lock_in` transactions (else those turns are leases).
    pub lock_in: bool,
    /// The app's table has a `seq` column, each write one more than the table's largest (in the
    /// same statement): the order of the commits, where the table's key is not (Galera's
    /// auto-increment interleaves the nodes' ids).
    pub seq: bool,
}

/// The fenced-write worker (in a child process started with `history::worker_command`): leases,
/// steals and (with `plan.lock_in`) `lock_in` transactions of key `doc`, each writing its token in
/// a transaction that fences it or holds it. A lease's holder waits a little between its grant
/// and its fence, and holds its transaction a little before the commit, so that steals land
/// before and during it. Logs each steal (`STOLE`), each refused fence (`REFUSED kind`), each
/// untyped error (`BAD`, and panics) and its exit (`EXIT`).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub async fn fenced_worker(plan: &Plan) {
    let Worker {
        url,
        table,
        locker,
        line,
    } = Worker::start().await;
    let app = App::connect(&url);
    let placeholder = if url.starts_with("postgres") {
        "$1"
    } else {
        "?"
    };
    let write = if plan.seq {
        format!(
            "INSERT INTO {table}_w (token, seq) \
             SELECT {placeholder}, COALESCE(MAX(seq), 0) + 1 FROM {table}_w"
        )
    } else {
        format!("INSERT INTO {table}_w (token) VALUES ({placeholder})")
    };
    let stop_file = std::env::var_os("DBLOCK_CHAOS_STOP_FILE").map(std::path::PathBuf::from);
    let stopped = || stop_file.as_ref().is_some_and(|f| f.exists());
    let typed = |kind: &str, e: &dblock::LockError| {
        if pool_exhausted(e) {
            return;
        }
        if e.is_lost() {
            line(format!("REFUSED {kind}"));
        } else if let Err(untyped) = history::error_kind(e) {
            line(format!("BAD {kind} {}", untyped.replace(' ', "_")));
            panic!("untyped {kind} error: {untyped}");
        }
    };
    let end = Instant::now() + plan.run;
    let wait = Duration::from_secs(3);
    while Instant::now() < end && !stopped() {
        let kind = match fastrand::u32(0..10) {
            0..=3 => "lease",
            4..=5 => "steal",
            _ if plan.lock_in => "tx",
            _ => "lease",
        };
        if kind == "tx" {
            if let Err(e) = app.hold_in(Take::LockIn(&locker, wait), Some(&write)).await {
                typed(kind, &e);
            }
            continue;
        }
        let taken = if kind == "steal" {
            locker.steal("doc").ttl(plan.ttl).await
        } else {
            locker.lock("doc").ttl(plan.ttl).wait(wait).await
        };
        let guard = match taken {
            Ok(guard) => {
                if kind == "steal" {
                    line("STOLE".into());
                }
                guard
            }
            Err(e) => {
                typed(kind, &e);
                continue;
            }
        };
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..30))).await;
        if let Err(e) = app.hold_in(Take::Fence(&guard), Some(&write)).await {
            typed(kind, &e);
        }
        if let Err(e) = guard.release().await {
            typed("release", &e);
        }
    }
    tokio::time::sleep(plan.linger).await;
    line("EXIT".into());
}

/// Writes whose token is not larger than the one committed before them (in the order the
/// app's table gives them: its key, taken after the fence or `lock_in`, which serialise them on
/// the lock's row; or its `seq`).
pub fn out_of_order(tokens: &[i64]) -> usize {
    tokens.windows(2).filter(|w| w[1] <= w[0]).count()
}

/// What the fenced workers' history says.
pub struct Tally {
    pub steals: usize,
    /// Fences refused (`Lost`: stolen or run out before the fence), of leases and of stealers.
    pub refused_lease: usize,
    pub refused_steal: usize,
    /// Workers that exited gracefully.
    pub exits: usize,
}

pub fn tally(history: &str) -> Tally {
    let count = |end: &str| history.lines().filter(|l| l.ends_with(end)).count();
    Tally {
        steals: count("STOLE"),
        refused_lease: count("REFUSED lease"),
        refused_steal: count("REFUSED steal"),
        exits: count("EXIT"),
    }
}
