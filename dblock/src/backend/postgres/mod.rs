//! PostgreSQL: statements on `statement_timestamp()`, the one clock that is fixed for the statement
//! and not frozen for a caller's whole transaction (as `now()` is). Also the pool set-up, the
//! SQLSTATE codes that decide retries, the LISTEN connection (`notify.rs`) and the statements'
//! form behind a transaction pooler such as PgBouncer (`pooler.rs`).
//!
//! Every statement runs through one place, [`Pg::send`]: prepared with its values bound (the
//! default), or behind a pooler as one simple-protocol query with the values inlined. A new
//! statement is a [`Stmt`] in [`Statements`] and a list of [`Arg`]s, nothing more.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use futures_core::future::BoxFuture;
use sqlx::postgres::{PgArguments, PgConnectOptions, PgConnection, PgPool, PgRow, Postgres};
use sqlx::query::Query;
use sqlx::RawSql;
use sqlx::{AssertSqlSafe, Connection, Execute, Executor, Row, SqlSafeStr, SqlStr};

use super::admin::PURGE_BATCH;
use super::{quote_ident, Dialect};
use crate::backend::kind_sql::KindSqls;
use crate::backend::Conns;
use crate::connect::ConnectOptions;
use crate::error::LockError;
use crate::retry::{Failed, Failure};

mod admin;
pub(crate) mod batch;
mod connect;
mod lock;
mod migrate;
mod queue;
mod sql;
use connect::keepalives;
pub(crate) use connect::{connect, state_shared};
pub(crate) mod notify;
pub(crate) mod pooler;
pub(crate) mod read;
pub(crate) mod semaphore;

pub(crate) use crate::backend::contract::Arg;
use pooler::{Mode, Template};
pub(crate) use sql::Stmt;
use sql::{stmt, Statements};

/// SQLSTATE codes (PostgreSQL manual, appendix A) that decide how a failed statement is retried.
mod sqlstate {
    /// Rolled back: the transaction could not be serialised.
    pub(super) const SERIALIZATION_FAILURE: &str = "40001";
    /// Rolled back: chosen as a deadlock victim.
    pub(super) const DEADLOCK_DETECTED: &str = "40P01";
    /// Rolled back: cancelled (statement_timeout, pg_cancel_backend).
    pub(super) const QUERY_CANCELED: &str = "57014";
    /// Rolled back: `lock_timeout` ran out waiting for a row lock (e.g. a long fenced
    /// transaction holding the lease row).
    pub(super) const LOCK_NOT_AVAILABLE: &str = "55P03";
    /// A prepared statement that is not on this server connection, or one of its name that is
    /// already there: sqlx's named statements meeting a server connection shared with other
    /// clients (a transaction pooler). Nothing ran.
    pub(super) const INVALID_SQL_STATEMENT_NAME: &str = "26000";
    pub(super) const DUPLICATE_PREPARED_STATEMENT: &str = "42P05";
    /// Class 08, connection exception: the outcome is unknown.
    pub(super) const CONNECTION_EXCEPTION: &str = "08";
    /// 57P01-57P05: administrator or crash shutdown, cannot connect now, idle session timeout.
    pub(super) const OPERATOR_SHUTDOWN: &str = "57P";

    pub(super) fn is_shared_connection(code: Option<&str>) -> bool {
        matches!(
            code,
            Some(INVALID_SQL_STATEMENT_NAME | DUPLICATE_PREPARED_STATEMENT)
        )
    }
}

/// The longest a lock statement waits for a row lock (`lock_timeout`) before the server rolls it
/// back (55P03) and the call tries again within its own `wait`. Lock statements hold a row for
/// one statement's time (a millisecond or so), so only a transaction holds one longer: an
/// application's fenced transaction, or a key taken with `lock_in`. Short, so that a call on such
/// a key answers `Busy` near its `wait` instead of blocking until the statement time-out and
/// taking the key after that transaction commits, long after its caller stopped waiting.
const ROW_LOCK_WAIT: Duration = Duration::from_millis(250);

/// [`ROW_LOCK_WAIT`], or the statement time-out if shorter.
pub(crate) fn row_lock_wait(statement_timeout: Duration) -> Duration {
    ROW_LOCK_WAIT
        .min(statement_timeout)
        .max(Duration::from_millis(1))
}

/// How long `Locker::connect`'s pool waits for a connection before failing.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);
/// Server-side TCP keepalives (s): a vanished client's connection is dropped within ~25 s.
const KEEPALIVE_IDLE: &str = "10";
const KEEPALIVE_INTERVAL: &str = "5";
const KEEPALIVE_COUNT: &str = "3";

/// Lease end as microseconds since the epoch.
const US: &str = "(extract(epoch FROM {c}) * 1000000)::int8";

/// A hold that ran out without a release: it ended in failure, unless its success committed
/// with the work (`succeed_in`: `success_token` is its tenure). `{l}` is the row's alias.
const RAN_OUT: &str = "({l}owner IS NOT NULL AND {l}expires_at <= statement_timestamp()
                AND {l}success_token IS DISTINCT FROM {l}fencing_token)";

/// [`RAN_OUT`] for the row aliased `l`, and unaliased.
fn ran_out(alias: &str) -> String {
    RAN_OUT.replace("{l}", alias)
}

#[derive(Clone, Debug)]
pub(crate) struct Pg {
    pool: Conns<Postgres>,
    /// NOTIFY channel for releases of this table (see [`notify_channel`]).
    channel: Arc<str>,
    sql: Arc<Statements>,
    /// The texts of kinds' own statements (shared locks', `read.rs`; a semaphore's NOTIFY
    /// request, `semaphore.rs`), each built on first use.
    kind_sql: Arc<KindSqls>,
    batch_sql: Arc<batch::Sql>,
    /// The LISTEN connection that wakes this locker's waiters; `None` when turned off.
    notifier: Option<Arc<notify::Notifier>>,
    settings: Settings,
}

/// How a [`Pg`] talks to its server, apart from the pool and the table: kept by `with_table`.
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    /// Releases commit without waiting for their WAL flush (`ConnectOptions::durable_release`).
    lazy_release: bool,
    /// Where the LISTEN connection goes; `None`: no LISTEN, waiters only poll.
    listen: Option<notify::Source>,
    /// Behind a transaction pooler or not (`ConnectOptions::pooler`, or found out): behind one,
    /// every statement goes as one simple-protocol query with its values inlined, never a
    /// prepared statement. Shared by the lockers of every table made from this one.
    pooler: Arc<Mode>,
}

impl Settings {
    /// `Locker::postgres(pool)`: LISTEN through the pool's connect options (unless they lead
    /// to a transaction pooler), lazily durable releases, prepared statements unless a pooler
    /// is found before the first one.
    fn defaults(pool: &PgPool) -> Settings {
        Settings {
            lazy_release: true,
            listen: Some(notify::Source::Pool(pool.clone())),
            pooler: Arc::new(Mode::unknown(ConnectOptions::new().statement_timeout)),
        }
    }

    /// As `opts` say. Behind a pooler LISTEN is off unless `listen_url` names a direct
    /// connection for it.
    fn from_options(pool: &PgPool, opts: &ConnectOptions) -> Result<Settings, LockError> {
        let listen = match (&opts.listen_url, opts.listen) {
            (_, false) => None,
            (Some(url), true) => Some(notify::Source::Direct(Arc::new(
                PgConnectOptions::from_str(url)
                    .map_err(|e| super::bad_url(url, e))?
                    .options(keepalives()),
            ))),
            (None, true) if opts.pooler == Some(true) => None,
            (None, true) => Some(notify::Source::Pool(pool.clone())),
        };
        let mode = match opts.pooler {
            Some(pooler) => Mode::known(pooler, opts.statement_timeout),
            None => Mode::unknown(opts.statement_timeout),
        };
        Ok(Settings {
            lazy_release: !opts.durable_release,
            listen,
            pooler: Arc::new(mode),
        })
    }
}

impl Pg {
    /// Locks in `table` through `pool`, with LISTEN/NOTIFY wake-ups.
    pub(crate) fn new(pool: Conns<Postgres>, table: &str) -> Self {
        let settings = Settings::defaults(&pool);
        Pg::build(pool, table, settings)
    }

    /// Locks in `table` through `pool`, set up as `opts` say (those options that are not about
    /// building the pool).
    pub(crate) fn configured(
        pool: Conns<Postgres>,
        table: &str,
        opts: &ConnectOptions,
    ) -> Result<Self, LockError> {
        let settings = Settings::from_options(&pool, opts)?;
        Ok(Pg::build(pool, table, settings))
    }

    /// Whether statements go as simple queries with inlined values (behind a pooler).
    pub(crate) fn pooler(&self) -> bool {
        self.settings.pooler.pooler().is_some()
    }

    /// The one place a statement is made ready to send: prepared, with `args` bound in order
    /// (the default: sqlx keeps it prepared on the connection, one round trip from the second
    /// use on); or, behind a pooler, one simple-protocol query with the transaction's settings
    /// first and `args` written in as literals (`pooler.rs` says why).
    fn ready(&self, s: &Stmt, args: &[Arg<'_>]) -> sqlx::Result<Ready> {
        match self.settings.pooler.pooler() {
            None => Ok(Ready::Prepared(
                args.iter()
                    .try_fold(sqlx::query(s.sql.clone()), |q, a| a.bind(q))?,
            )),
            Some(p) => Ok(Ready::Simple(sqlx::raw_sql(AssertSqlSafe(
                s.template.render(p.prefix(), args)?,
            )))),
        }
    }

    /// The one place a statement is sent: made ready ([`Pg::ready`]), run, and its answer read
    /// as `T` asks: its first row (`Option<PgRow>`), every row (`Vec<PgRow>`) or how many rows
    /// it changed ([`Changed`]; the settings a pooled statement begins with change none).
    async fn send<T: Answer>(
        &self,
        conn: &mut PgConnection,
        s: &Stmt,
        args: &[Arg<'_>],
    ) -> sqlx::Result<T> {
        match self.ready(s, args)? {
            Ready::Prepared(q) => self.seen(T::read(conn, q).await),
            Ready::Simple(q) => T::read(conn, q).await,
        }
    }

    /// A prepared statement's result, seen for the sign of a transaction pooler that finding
    /// out missed: the statement met another client's server connection
    /// ([`sqlstate::is_shared_connection`]), so nothing ran; pooler mode from now on, and the
    /// error is retried ([`Dialect::classify`]).
    ///
    /// With `pooler(false)` (the direct path forced) it is a configuration error naming
    /// `pooler(true)`, not retried: a retry could land on another client's statement of the
    /// same name.
    fn seen<T>(&self, result: Result<T, sqlx::Error>) -> sqlx::Result<T> {
        match result {
            Err(sqlx::Error::Database(e))
                if sqlstate::is_shared_connection(e.code().as_deref())
                    && !self.settings.pooler.shared_connection_seen() =>
            {
                Err(sqlx::Error::Configuration(
                    format!(
                        "PostgreSQL server connections are shared between clients (a transaction \
                         pooler): {e}; `pooler(false)` forces prepared statements, use \
                         ConnectOptions::pooler(true) (or leave it unset) to lock through it"
                    )
                    .into(),
                ))
            }
            other => other,
        }
    }

    /// Stops the LISTEN connection for good.
    pub(crate) fn stop_listening(&self) {
        if let Some(n) = &self.notifier {
            n.stop();
        }
    }

    /// The benchmark's `pgbench` script for one lock cycle with this locker's own acquire and
    /// release statements (prepared, one parameter per bind, as the library sends them): each
    /// `$n` becomes a pgbench variable of the bind's type, in the order `acquire` and `release`
    /// bind them. Keys are per client (`:client_id`) and `:k`, like the benchmark's owners.
    #[cfg(feature = "_test-util")]
    pub(crate) fn pgbench_script(&self) -> String {
        let key = "('pgbench:' || :client_id || ':' || :k)";
        let owner = "('pgb:' || :client_id)";
        // The binds of `acquire` ([`Acquire::args`]), in order: no tracked tenure; a first
        // attempt, which sends the text without the waiter's `$10`.
        let acquire_binds = [
            key.to_owned(),
            owner.to_owned(),
            "(:ttl_us)::int8".into(),
            "('bench/' || :client_id)".into(),
            "(:attempt)::int8".into(),
            "nullif(:tenure, -1)::int8".into(),
            "(:held)::int4".into(),
            "(:min_hold_us)::int8".into(),
            "(:once = 1)".into(),
        ];
        // The binds of `release`, in order; the token from the acquire's row (`\gset a_`).
        let release_binds = [
            key.to_owned(),
            owner.to_owned(),
            "(:a_fencing_token)::int8".into(),
            "(:release_id)::int8".into(),
            "(:remaining)::int4".into(),
            "(:outcome)::int2".into(),
            format!("'{}'", self.channel),
            format!("({})", self.settings.lazy_release),
        ];
        let with_binds = |sql: &str, binds: &[String]| {
            // From the highest number down, so `$1` never eats the start of `$10`.
            (1..=binds.len()).rev().fold(sql.to_owned(), |text, n| {
                text.replace(&format!("${n}"), &binds[n - 1])
            })
        };
        format!(
            "\\set k random(0, 63)\n\\set ttl_us 30000000\n\\set attempt random(1, 9000000000000000000)\n\
             \\set release_id random(1, 9000000000000000000)\n\\set tenure -1\n\
             \\set held 0\n\\set min_hold_us 0\n\\set once 0\n\\set remaining 0\n\\set outcome 1\n\
             {};\n\\gset a_\n{};\n",
            with_binds(self.sql.acquire.sql.as_str(), &acquire_binds),
            with_binds(self.sql.release.sql.as_str(), &release_binds),
        )
    }

    /// Interest in a release of `key` (LISTEN set up on first use); `None` when LISTEN is off
    /// or failed.
    pub(crate) async fn interest(&self, key: &str) -> Option<notify::Interest> {
        self.notifier.as_ref()?.interest(key).await
    }
}

super::backend_trait!(OnPostgres, postgres, Pg, sqlx::PgConnection);

impl Dialect for Pg {
    const NAME: &'static str = "postgres";
    type Db = Postgres;

    /// Makes sure the locker knows whether its pool goes through a transaction pooler before
    /// its first statement (`Locker::postgres(pool)`: the application's pool, which no connect
    /// of ours looked at). Once known, free.
    async fn settle(&self, deadline: Instant) -> Result<(), Failed> {
        if self.settings.pooler.is_known() {
            return Ok(());
        }
        let options = self.pool.connect_options();
        let probe = async {
            match tokio::time::timeout_at(deadline, state_shared(&options)).await {
                Ok(answer) => answer,
                Err(_) => Err(super::exec::connect_timed_out()),
            }
        };
        Box::pin(self.settings.pooler.find_out(probe))
            .await
            .map_err(|error| Failed {
                error,
                sent: false,
                class: None,
            })
    }

    fn with_table(&self, table: &str) -> Self {
        Pg::build(self.pool.clone(), table, self.settings.clone())
    }

    fn classify(e: &dyn sqlx::error::DatabaseError) -> Failure {
        match e.code().as_deref() {
            Some(sqlstate::SERIALIZATION_FAILURE)
            | Some(sqlstate::DEADLOCK_DETECTED)
            | Some(sqlstate::QUERY_CANCELED) => Failure::NotCommitted,
            Some(sqlstate::LOCK_NOT_AVAILABLE) => Failure::Locked,
            code if sqlstate::is_shared_connection(code) => Failure::NotCommitted,
            // A standby (the primary this connection reached was demoted by a failover):
            // nothing was written, and the connection is closed (`exec::run`), so the send is
            // tried again, as when no connection could be had, on a new one.
            Some(super::exec::READ_ONLY) => Failure::NotSent,
            Some(c)
                if c.starts_with(sqlstate::CONNECTION_EXCEPTION)
                    || c.starts_with(sqlstate::OPERATOR_SHUTDOWN) =>
            {
                Failure::Unknown
            }
            _ => Failure::Fatal,
        }
    }

    fn pool(&self) -> &Conns<Postgres> {
        &self.pool
    }

    fn database(&self) -> String {
        let o = self.pool.connect_options();
        let db = o.get_database().unwrap_or(o.get_username());
        super::dialect::server_database(o.get_socket(), o.get_host(), o.get_port(), db)
    }
}

/// A statement ready to send, in one of its two forms ([`Pg::ready`]).
enum Ready {
    Prepared(Query<'static, Postgres, PgArguments>),
    Simple(RawSql),
}

/// How a statement's answer is read ([`Pg::send`]): each with sqlx's own reader for it.
trait Answer: Sized {
    fn read<'c, E>(conn: &'c mut PgConnection, q: E) -> BoxFuture<'c, sqlx::Result<Self>>
    where
        E: Execute<'c, Postgres> + 'c;
}

impl Answer for Option<PgRow> {
    fn read<'c, E>(conn: &'c mut PgConnection, q: E) -> BoxFuture<'c, sqlx::Result<Self>>
    where
        E: Execute<'c, Postgres> + 'c,
    {
        conn.fetch_optional(q)
    }
}

impl Answer for Vec<PgRow> {
    fn read<'c, E>(conn: &'c mut PgConnection, q: E) -> BoxFuture<'c, sqlx::Result<Self>>
    where
        E: Execute<'c, Postgres> + 'c,
    {
        conn.fetch_all(q)
    }
}

/// How many rows a statement inserted, updated or deleted.
struct Changed(u64);

impl Answer for Changed {
    fn read<'c, E>(conn: &'c mut PgConnection, q: E) -> BoxFuture<'c, sqlx::Result<Self>>
    where
        E: Execute<'c, Postgres> + 'c,
    {
        Box::pin(async move { Ok(Changed(conn.execute(q).await?.rows_affected())) })
    }
}

/// Takes the advisory lock that serialises concurrent migrations (transaction-scoped).
const MIGRATE_LOCK: &str = "SELECT pg_advisory_xact_lock(7170034453421551936)";

/// The LISTEN/NOTIFY channel of a table: `dblock_` and a 64-bit FNV-1a hash of its name, so any
/// valid table name (up to 127 bytes with a schema) gives a channel within PostgreSQL's 63 bytes.
pub(crate) fn notify_channel(table: &str) -> String {
    let hash = table.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("dblock_{hash:016x}")
}

#[cfg(feature = "_test-util")]
impl Pg {
    /// The same backend without LISTEN/NOTIFY wake-ups (waiters only poll).
    pub(crate) fn without_notify(&self) -> Self {
        Pg {
            notifier: None,
            settings: Settings {
                listen: None,
                ..self.settings.clone()
            },
            ..self.clone()
        }
    }

    /// The channel releases of this table are announced on.
    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::postgres::PgPoolOptions;

    /// Options for `url` that PgBouncer accepts as they are (no `extra_float_digits`).
    pub(super) fn plain_options(url: &str) -> PgConnectOptions {
        PgConnectOptions::from_str(url)
            .unwrap()
            .extra_float_digits(None)
    }

    fn lazy_pool() -> PgPool {
        PgPoolOptions::new()
            .connect_lazy("postgres://postgres@127.0.0.1:5432/test")
            .unwrap()
    }

    /// Each statement's template finds exactly the placeholders its binds fill (comments with
    /// `($n)` in them are not placeholders).
    #[tokio::test]
    async fn every_statement_has_the_placeholders_its_values_fill() {
        let sql = &Pg::new(lazy_pool().into(), "some.t").sql;
        for (name, s, n) in [
            ("exists", &sql.exists, 2),
            ("acquire", &sql.acquire, 9),
            ("acquire_waiting", &sql.acquire_waiting, 10),
            ("release", &sql.release, 8),
            ("extend", &sql.extend, 5),
            ("extend_many", &sql.extend_many, 5),
            ("last_write", &sql.last_write, 1),
            ("inspect", &sql.inspect, 1),
            ("held", &sql.held, 0),
            ("rows_in", &sql.rows_in, 3),
            ("force_release", &sql.force_release, 2),
            ("reset", &sql.reset, 1),
            ("purge", &sql.purge, 1),
            ("queue join", &sql.queue_steps.join, 3),
            ("queue ahead", &sql.queue_steps.ahead, 2),
            ("queue touch", &sql.queue_steps.touch, 4),
            ("queue leave", &sql.queue_steps.leave, 3),
        ] {
            assert_eq!(s.template.params(), n, "{name}");
            let args: Vec<Arg<'_>> = (0..n).map(|_| Arg::Int8(0)).collect();
            let text = s.template.render("", &args).unwrap();
            assert!(!text.contains("--"), "{name}: a comment went out: {text}");
        }
    }

    /// The session-state sign of a transaction pooler ([`state_shared`]): PgBouncer in
    /// transaction mode shares it, the server itself does not. (Found through the start-up
    /// signs first in `connect`, this one is what a pooler that took and applied the settings
    /// would still show.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shared_session_state_tells_a_transaction_pooler_from_a_server() {
        let require = crate::backend::servers_required();
        let server = plain_options("postgres://postgres@127.0.0.1:5432/test");
        let bouncer = plain_options("postgres://postgres@127.0.0.1:6432/test");
        match (state_shared(&server).await, state_shared(&bouncer).await) {
            (Ok(s), Ok(b)) => {
                assert!(!s, "the server taken for a pooler");
                assert!(b, "PgBouncer in transaction mode not found");
            }
            (s, b) => {
                assert!(!require, "servers unreachable: {s:?} {b:?}");
                return;
            }
        }
        // Under load: other clients keep taking the pooler's server connections between the
        // probe's statements (the case a single look got wrong: it then saw no sharing, and
        // LISTEN went through the pooler).
        let busy = PgPoolOptions::new()
            .max_connections(6)
            .connect_lazy_with(bouncer.clone());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let load: Vec<_> = (0..6)
            .map(|_| {
                let (busy, stop) = (busy.clone(), stop.clone());
                tokio::spawn(async move {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let _ = sqlx::raw_sql(AssertSqlSafe("SELECT pg_sleep(0.0005)"))
                            .execute(&busy)
                            .await;
                    }
                })
            })
            .collect();
        for round in 0..20 {
            assert!(
                state_shared(&bouncer).await.unwrap(),
                "PgBouncer under load not found (look {round})"
            );
            assert!(
                !state_shared(&server).await.unwrap(),
                "the server taken for a pooler"
            );
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for task in load {
            task.await.unwrap();
        }
    }

    #[tokio::test]
    async fn settings_follow_the_options() {
        let pool = lazy_pool();
        let direct = Settings::from_options(&pool, &ConnectOptions::new()).unwrap();
        assert!(!direct.pooler.is_known() && direct.lazy_release);
        assert!(matches!(direct.listen, Some(notify::Source::Pool(_))));

        // Behind a pooler: no LISTEN unless a URL of its own is given for it.
        let pooled = ConnectOptions::new().pooler(true).durable_release(true);
        let s = Settings::from_options(&pool, &pooled).unwrap();
        assert!(s.pooler.pooler().is_some() && s.listen.is_none() && !s.lazy_release);
        let s = Settings::from_options(
            &pool,
            &pooled.clone().listen_url("postgres://app@db:5432/app"),
        )
        .unwrap();
        assert!(matches!(s.listen, Some(notify::Source::Direct(_))));
        let s = Settings::from_options(
            &pool,
            &pooled
                .clone()
                .listen_url("postgres://app@db/app")
                .listen(false),
        )
        .unwrap();
        assert!(s.listen.is_none());

        match Settings::from_options(&pool, &pooled.listen_url("postgres://u:hunter2@[::1:x/db")) {
            Err(LockError::Config(msg)) => assert!(!msg.contains("hunter2"), "{msg}"),
            other => panic!("{other:?}"),
        }
    }

    /// Behind a pooler each statement brings its transaction's settings, whatever the session
    /// says, and leaves the session as it found it. Shown on a direct connection whose session
    /// defaults are the opposite (SERIALIZABLE, one-hour time-outs), the one place this test can
    /// set session defaults without touching connections that others share.
    #[tokio::test]
    async fn pooler_statements_bring_their_own_settings_and_leave_none() {
        let url = std::env::var("DBLOCK_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let options = PgConnectOptions::from_str(&url).unwrap().options([
            ("default_transaction_isolation", "serializable"),
            ("statement_timeout", "1h"),
            ("lock_timeout", "1h"),
        ]);
        let pool = match PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
        {
            Ok(pool) => pool,
            Err(e) if crate::backend::servers_required() => {
                panic!("PostgreSQL unreachable and DBLOCK_REQUIRE_SERVERS=1: {e}")
            }
            Err(e) => {
                eprintln!("!!!!! SKIPPING the pooler settings test: {e}");
                return;
            }
        };
        let opts = ConnectOptions::new()
            .pooler(true)
            .statement_timeout(Duration::from_millis(300));
        let pg = Pg::configured(pool.clone().into(), "unused", &opts).unwrap();
        let probe = stmt(
            "SELECT current_setting('transaction_isolation'), current_setting('statement_timeout'),
       current_setting('lock_timeout'), $1::text",
            "unused",
        );
        let mut conn = pool.acquire().await.unwrap();
        let row = pg
            .send::<Option<PgRow>>(&mut conn, &probe, &[Arg::Text("it's \\ fine")])
            .await
            .unwrap()
            .unwrap();
        let got: (String, String, String, String) = (
            row.try_get(0).unwrap(),
            row.try_get(1).unwrap(),
            row.try_get(2).unwrap(),
            row.try_get(3).unwrap(),
        );
        assert_eq!(
            got,
            (
                "read committed".into(),
                "300ms".into(),
                // The row-lock wait: 250 ms, or the statement time-out if shorter.
                "250ms".into(),
                "it's \\ fine".into()
            )
        );
        // Nothing stays behind on the (here: only) connection.
        let row = sqlx::raw_sql(
            "SELECT current_setting('transaction_isolation'), current_setting('statement_timeout')",
        )
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        let after: (String, String) = (row.try_get(0).unwrap(), row.try_get(1).unwrap());
        assert_eq!(after, ("serializable".into(), "1h".into()));
    }

    /// The coalesced statements keep reading the table by key after it grows. Their generic
    /// plan (the one PostgreSQL caches after five executions of a prepared statement) is made
    /// while the table is small, and a server that never analyzes it (autovacuum off) keeps
    /// that plan: without `enable_seqscan = off` in the session it scanned the whole table
    /// for every batch (measured: 4.8 ms instead of 0.9 ms for 64 rows of 4,096).
    /// A migrated backend on a table of its own (`t_{name}_…`) with one connection, on the
    /// direct path; `None` (the test skipped) when PostgreSQL is not there and not required.
    async fn direct_backend(name: &str) -> Option<(crate::backend::Backend, String)> {
        let url = std::env::var("DBLOCK_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let table = format!("t_{name}_{}_{}", std::process::id(), fastrand::u32(..));
        let opts = ConnectOptions::new().max_connections(1);
        let b = match crate::backend::Backend::connect(&url, &table, &opts).await {
            Ok(b) => b,
            Err(e) => {
                let require = crate::backend::servers_required();
                assert!(!require, "PostgreSQL unreachable: {e}");
                return None;
            }
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        b.run(&crate::backend::Migrate, deadline).await.unwrap();
        Some((b, table))
    }

    /// A lock session never has the server compile a statement (`jit = off`): with
    /// `enable_seqscan = off` a statement that scans, as `purge` does, is priced far above
    /// `jit_above_cost`, and was compiled before it ran (60–80 ms for a table of a few rows).
    #[tokio::test]
    async fn lock_sessions_scan_without_compiling_the_statement() {
        let Some((b, table)) = direct_backend("jit").await else {
            return;
        };
        #[allow(irrefutable_let_patterns)] // with no other backend built
        let crate::backend::Backend::Postgres(pg) = &b
        else {
            unreachable!("a PostgreSQL URL")
        };
        let mut conn = pg.pool().acquire().await.unwrap();
        let (jit, seqscan): (String, String) =
            sqlx::query_as("SELECT current_setting('jit'), current_setting('enable_seqscan')")
                .fetch_one(&mut *conn)
                .await
                .unwrap();
        assert_eq!((jit.as_str(), seqscan.as_str()), ("off", "off"));
        let plan: Vec<(String,)> = sqlx::query_as(AssertSqlSafe(format!(
            "EXPLAIN (ANALYZE, COSTS false, TIMING false) SELECT max(fencing_token) FROM {table}
             WHERE expires_at <= statement_timestamp()"
        )))
        .fetch_all(&mut *conn)
        .await
        .unwrap();
        let plan: Vec<String> = plan.into_iter().map(|r| r.0).collect();
        assert!(plan.iter().any(|l| l.contains("Seq Scan")), "{plan:?}");
        assert!(!plan.iter().any(|l| l.contains("JIT")), "{plan:?}");
        sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {table}")))
            .execute(&mut *conn)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn coalesced_statements_made_on_a_small_table_read_a_grown_one_by_key() {
        // One connection: the statements' executions all build up its plan cache.
        let Some((b, table)) = direct_backend("grow").await else {
            return;
        };
        let deadline = || Instant::now() + Duration::from_secs(10);
        for i in 0..8 {
            let keys = [format!("small:{i}:a"), format!("small:{i}:b")];
            let rows = keys
                .each_ref()
                .map(|k| crate::backend::statement_tests::one(k, "o", 1));
            b.acquire_batch(&rows, deadline()).await.unwrap();
            let rows = keys.map(|key| {
                let hold = crate::backend::HoldRef {
                    key: &key,
                    owner: "o",
                    fencing_token: 1,
                };
                crate::backend::coalesce::ReleaseRow::new(&hold, 0, None, 2)
            });
            b.release_batch(&rows, deadline()).await.unwrap();
        }
        #[allow(irrefutable_let_patterns)] // with no other backend built
        let crate::backend::Backend::Postgres(pg) = &b
        else {
            unreachable!("a PostgreSQL URL")
        };
        let mut conn = pg.pool().acquire().await.unwrap();
        let run = async |conn: &mut PgConnection, sql: String| {
            let rows: Vec<(String,)> = sqlx::query_as(AssertSqlSafe(sql))
                .fetch_all(conn)
                .await
                .unwrap();
            rows.into_iter().map(|r| r.0).collect::<Vec<_>>().join("\n")
        };
        run(
            &mut conn,
            format!(
                "INSERT INTO {table} (lock_key, hold_count, fencing_token, expires_at, acquired_at)
                 SELECT 'grown:' || g, 0, 1, now(), now() FROM generate_series(0, 4095) AS g
                 RETURNING ''"
            ),
        )
        .await;
        let keys = (0..64)
            .map(|i| format!("'grown:{i}'"))
            .collect::<Vec<_>>()
            .join(",");
        let each = |v: &str| format!("ARRAY[{}]", vec![v; 64].join(","));
        let (o, n, zero) = (each("'o'"), each("7"), each("0"));
        for (start, args) in [
            (
                "WITH r AS (",
                format!(
                    "ARRAY[{keys}], {o}, {}, {o}, {n}, {}, {zero}, {}, {zero}",
                    each("1e6"),
                    each("-1"),
                    each("0.0")
                ),
            ),
            (
                "WITH q AS (",
                format!(
                    "ARRAY[{keys}], {o}, {n}, {n}, {zero}, {}, 'c', false",
                    each("-1")
                ),
            ),
        ] {
            let name = run(
                &mut conn,
                format!(
                    "SELECT name FROM pg_prepared_statements
                     WHERE starts_with(statement, '{start}') AND generic_plans > 0"
                ),
            )
            .await;
            assert!(!name.is_empty(), "{start}: no generic plan was made");
            let plan = run(
                &mut conn,
                format!("EXPLAIN (COSTS false) EXECUTE {name}({args})"),
            )
            .await;
            assert!(plan.contains("Index Cond"), "{start}:\n{plan}");
            assert!(!plan.contains("Seq Scan"), "{start}:\n{plan}");
        }
        sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {table}")))
            .execute(&mut *conn)
            .await
            .unwrap();
    }
}
