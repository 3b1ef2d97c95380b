//! Part 8 of the benchmark, **service** (`DBLOCK_BENCH_PARTS=service`; it runs only when named):
//! a service's request under a lock, the commonest use there is.
//!
//! Each request is one application transaction of four statements on a table of its own (a read,
//! two writes, a read) on an id no other request uses at the same time, committed. Sides, in the
//! same rounds (their order rotated each round), each for `DBLOCK_BENCH_SECS / 2` seconds:
//!
//! - **no lock**: the transaction alone, the ceiling;
//! - **token write**: the raw SQL ceiling of any lock that hands out a fencing token in the
//!   transaction: a single-row `UPDATE ... SET token = token + 1` by primary key (on a table of
//!   its own) as the transaction's first statement, no library code;
//! - **lease**: `lock` before it, `fence` in it, `release` after the commit (three statements);
//! - **release_in**: `lock` before it, `release_in` in it (two statements, the key free at the
//!   commit);
//! - **lock_in**: `lock_in` as the transaction's first statement (one statement).
//!
//! At 1, 16 and 64 concurrent requests, on PostgreSQL (direct and through PgBouncer), MariaDB and
//! SQLite. The application's pool has 16 connections, the locker its own default pool. Ratios are
//! each side's requests/s over the no-lock side's in the same round; the table gives the median
//! of the rounds and each round's.

use std::time::{Duration, Instant};

use dblock::{ConnectOptions, Locker};

const CONCURRENCY: [usize; 3] = [1, 16, 64];
const ROUNDS: usize = 3;
/// Ids per concurrent request slot: request `t` uses ids `t * IDS .. (t + 1) * IDS`.
const IDS: i64 = 1000;
const APP_POOL: u32 = 16;
const TABLE: &str = "dblock_bench_service";
const LOCKS: &str = "dblock_bench_service_locks";
const TOKENS: &str = "dblock_bench_service_tokens";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    NoLock,
    Token,
    Lease,
    ReleaseIn,
    LockIn,
}

const SIDES: [Side; 5] = [
    Side::NoLock,
    Side::Token,
    Side::Lease,
    Side::ReleaseIn,
    Side::LockIn,
];

/// The application's pool, of the backend under test.
#[derive(Clone)]
enum App {
    Pg { pool: sqlx::PgPool, prepared: bool },
    My(sqlx::MySqlPool),
    Lite(sqlx::SqlitePool),
}

/// One request of `side` on id `id`: the transaction of four statements, with the lock as the
/// side takes it. `$begin` opens the transaction; `$q` makes a query (prepared or not).
macro_rules! request {
    ($pool:expr, $begin:ident, $q:expr, $p1:literal, $p2:literal, $locker:expr, $side:expr, $id:expr) => {{
        let (locker, side, id): (&Locker, Side, i64) = ($locker, $side, $id);
        let key = format!("svc:{id}");
        let guard = match side {
            Side::Lease | Side::ReleaseIn => Some(
                locker
                    .lock(&key)
                    .wait(Duration::from_secs(10))
                    .await
                    .unwrap(),
            ),
            _ => None,
        };
        let mut tx = $begin!($pool);
        if side == Side::LockIn {
            locker
                .lock_in(&mut *tx, &key)
                .wait(Duration::from_secs(10))
                .await
                .unwrap();
        }
        if side == Side::Token {
            let token = concat!(
                "UPDATE dblock_bench_service_tokens SET token = token + 1 WHERE id = ",
                $p1
            );
            $q(token).bind(id).execute(&mut *tx).await.unwrap();
        }
        let read = concat!("SELECT n FROM dblock_bench_service WHERE id = ", $p1);
        let bump = concat!("UPDATE dblock_bench_service SET n = n + 1 WHERE id = ", $p1);
        let note = concat!(
            "UPDATE dblock_bench_service SET note = ",
            $p1,
            " WHERE id = ",
            $p2
        );
        $q(read).bind(id).fetch_one(&mut *tx).await.unwrap();
        $q(bump).bind(id).execute(&mut *tx).await.unwrap();
        $q(note)
            .bind("settled")
            .bind(id)
            .execute(&mut *tx)
            .await
            .unwrap();
        $q(read).bind(id).fetch_one(&mut *tx).await.unwrap();
        match (side, guard) {
            (Side::Lease, Some(g)) => {
                g.fence(&mut *tx).await.unwrap();
                tx.commit().await.unwrap();
                g.release().await.unwrap();
            }
            (Side::ReleaseIn, Some(g)) => {
                g.release_in(&mut *tx).await.unwrap();
                tx.commit().await.unwrap();
            }
            _ => tx.commit().await.unwrap(),
        }
    }};
}

macro_rules! begin {
    ($pool:expr) => {
        $pool.begin().await.unwrap()
    };
}

macro_rules! begin_immediate {
    ($pool:expr) => {
        $pool.begin_with("BEGIN IMMEDIATE").await.unwrap()
    };
}

impl App {
    async fn request(&self, locker: &Locker, side: Side, id: i64) {
        match self {
            App::Pg { pool, prepared } => {
                let prepared = *prepared;
                let q = |sql: &'static str| sqlx::query(sql).persistent(prepared);
                request!(pool, begin, q, "$1", "$2", locker, side, id)
            }
            App::My(pool) => request!(pool, begin, sqlx::query, "?", "?", locker, side, id),
            App::Lite(pool) => {
                request!(
                    pool,
                    begin_immediate,
                    sqlx::query,
                    "?",
                    "?",
                    locker,
                    side,
                    id
                )
            }
        }
    }

    /// The table, made afresh with a row for every id.
    async fn set_up(&self, ids: i64) {
        let ddl = [
            format!("DROP TABLE IF EXISTS {TABLE}"),
            format!(
                "CREATE TABLE {TABLE} (id BIGINT PRIMARY KEY, n BIGINT NOT NULL, note VARCHAR(40))"
            ),
            format!(
                "INSERT INTO {TABLE} (id, n, note) SELECT id, 0, NULL FROM ({}) AS ids",
                ids_query(self, ids)
            ),
            format!("DROP TABLE IF EXISTS {TOKENS}"),
            format!("CREATE TABLE {TOKENS} (id BIGINT PRIMARY KEY, token BIGINT NOT NULL)"),
            format!(
                "INSERT INTO {TOKENS} (id, token) SELECT id, 0 FROM ({}) AS ids",
                ids_query(self, ids)
            ),
        ];
        for sql in ddl {
            let sql = sqlx::AssertSqlSafe(sql);
            match self {
                App::Pg { pool, .. } => drop(sqlx::raw_sql(sql).execute(pool).await.unwrap()),
                App::My(pool) => drop(sqlx::raw_sql(sql).execute(pool).await.unwrap()),
                App::Lite(pool) => drop(sqlx::raw_sql(sql).execute(pool).await.unwrap()),
            }
        }
    }
}

/// A query of the ids `0..ids` as a column `id`, in the backend's dialect.
fn ids_query(app: &App, ids: i64) -> String {
    let last = ids - 1;
    match app {
        App::Pg { .. } => format!("SELECT generate_series(0, {last})::int8 AS id"),
        App::My(_) => format!("SELECT seq AS id FROM seq_0_to_{last}"),
        App::Lite(_) => format!(
            "WITH RECURSIVE s(id) AS (SELECT 0 UNION ALL SELECT id + 1 FROM s WHERE id < {last}) SELECT id FROM s"
        ),
    }
}

/// `concurrency` request loops of `side` for `secs`; requests per second.
async fn run(app: &App, locker: &Locker, side: Side, concurrency: usize, secs: Duration) -> f64 {
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let (app, locker) = (app.clone(), locker.clone());
            tokio::spawn(async move {
                let mut done = 0u64;
                while started.elapsed() < secs {
                    let id = t as i64 * IDS + (done as i64 % IDS);
                    app.request(&locker, side, id).await;
                    done += 1;
                }
                done
            })
        })
        .collect();
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    total as f64 / started.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The part: every backend `only` lets through, every concurrency, every side.
pub(crate) async fn service(
    sqlite_url: &str,
    pg: &str,
    bouncer: &str,
    my: &str,
    only: &dyn Fn(&str) -> bool,
    secs: f64,
) {
    let side_secs = Duration::from_secs_f64((secs / 2.0).max(0.5));
    println!("\n## Service: a request's transaction under a lock (requests/s; ratio to no lock)\n");
    println!(
        "| backend | requests at once | no lock | token write (raw SQL) | lease + fence + release | lease + release_in | lock_in | rounds (token, lease, release_in, lock_in) |"
    );
    debug_assert_eq!(SIDES[0], Side::NoLock);
    println!("|---|---|---|---|---|---|---|---|");
    let ids = IDS * *CONCURRENCY.iter().max().unwrap() as i64;
    let pooler = ConnectOptions::new().pooler(true);
    for (name, url, options) in [
        ("postgres", pg, ConnectOptions::new()),
        ("postgres-pgbouncer", bouncer, pooler),
        ("mariadb", my, ConnectOptions::new()),
        ("sqlite", sqlite_url, ConnectOptions::new()),
    ] {
        if !only(name) {
            continue;
        }
        let locker = match Locker::connect_with(url, options).await {
            Ok(l) => l.table(LOCKS),
            Err(e) => {
                println!("| {name} | skipped: {e} | | | | | | |");
                continue;
            }
        };
        locker.migrate().await.unwrap();
        let app = match name {
            "postgres" | "postgres-pgbouncer" => {
                use std::str::FromStr;
                let options = sqlx::postgres::PgConnectOptions::from_str(url)
                    .unwrap()
                    .extra_float_digits(None);
                App::Pg {
                    pool: sqlx::postgres::PgPoolOptions::new()
                        .max_connections(APP_POOL)
                        .connect_with(options)
                        .await
                        .unwrap(),
                    // Through a transaction pooler, the application's statements go unprepared.
                    prepared: name == "postgres",
                }
            }
            "mariadb" => App::My(
                sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(APP_POOL)
                    .connect(url)
                    .await
                    .unwrap(),
            ),
            _ => App::Lite(
                sqlx::sqlite::SqlitePoolOptions::new()
                    .max_connections(APP_POOL)
                    .connect(url)
                    .await
                    .unwrap(),
            ),
        };
        app.set_up(ids).await;
        for concurrency in CONCURRENCY {
            // Warm both pools and the caches.
            for side in SIDES {
                run(&app, &locker, side, concurrency, Duration::from_millis(200)).await;
            }
            let mut rates: Vec<Vec<f64>> = vec![Vec::new(); SIDES.len()];
            let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); SIDES.len()];
            for round in 0..ROUNDS {
                let mut this = [0.0; SIDES.len()];
                for k in 0..SIDES.len() {
                    let i = (k + round) % SIDES.len();
                    this[i] = run(&app, &locker, SIDES[i], concurrency, side_secs).await;
                }
                for i in 0..SIDES.len() {
                    rates[i].push(this[i]);
                    ratios[i].push(this[i] / this[0]);
                }
            }
            let rounds = (1..SIDES.len())
                .map(|i| {
                    ratios[i]
                        .iter()
                        .map(|r| format!("{r:.2}"))
                        .collect::<Vec<_>>()
                        .join("/")
                })
                .collect::<Vec<_>>()
                .join(", ");
            let cell = |i: usize| {
                let rate = median(rates[i].clone());
                if i == 0 {
                    format!("{rate:.0}")
                } else {
                    format!("{rate:.0} ({:.2}×)", median(ratios[i].clone()))
                }
            };
            println!(
                "| {name} | {concurrency} | {} | {} | {} | {} | {} | {rounds} |",
                cell(0),
                cell(1),
                cell(2),
                cell(3),
                cell(4)
            );
        }
    }
}
