//! (a) One owner's lock + release on free keys against one raw round trip, `SELECT 1`, on a
//! pool of the same kind (same URL, one connection, the same protocol: prepared statements
//! straight to the servers, simple queries through PgBouncer as dblock's pooler mode sends).
//! The two alternate call by call, so both meet the same moments of the machine.

use std::str::FromStr;
use std::time::{Duration, Instant};

use super::chart::{bars, Group};
use super::{ms, ms_of, pct, Report, Target};

/// One raw round trip on a pool of the target's kind.
enum RoundTrip {
    Pg(sqlx::PgPool),
    /// Through PgBouncer: a simple query (no prepared statement survives a transaction pooler).
    PgSimple(sqlx::PgPool),
    My(sqlx::MySqlPool),
    Lite(sqlx::SqlitePool),
}

impl RoundTrip {
    async fn connect(t: &Target) -> Result<RoundTrip, sqlx::Error> {
        Ok(if t.pooler {
            let options =
                sqlx::postgres::PgConnectOptions::from_str(&t.url)?.extra_float_digits(None);
            RoundTrip::PgSimple(
                sqlx::postgres::PgPoolOptions::new()
                    .max_connections(1)
                    .test_before_acquire(false)
                    .connect_with(options)
                    .await?,
            )
        } else if t.is_postgres() {
            RoundTrip::Pg(
                sqlx::postgres::PgPoolOptions::new()
                    .max_connections(1)
                    .test_before_acquire(false)
                    .connect(&t.url)
                    .await?,
            )
        } else if t.url.starts_with("mysql") {
            RoundTrip::My(
                sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(1)
                    .test_before_acquire(false)
                    .connect(&t.url)
                    .await?,
            )
        } else {
            let options = sqlx::sqlite::SqliteConnectOptions::from_str(&t.url)?
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
            RoundTrip::Lite(
                sqlx::sqlite::SqlitePoolOptions::new()
                    .max_connections(1)
                    .test_before_acquire(false)
                    .connect_with(options)
                    .await?,
            )
        })
    }

    async fn once(&self) {
        let done = match self {
            RoundTrip::Pg(p) => sqlx::query("SELECT 1").fetch_one(p).await.map(|_| ()),
            RoundTrip::PgSimple(p) => sqlx::raw_sql("SELECT 1").execute(p).await.map(|_| ()),
            RoundTrip::My(p) => sqlx::query("SELECT 1").fetch_one(p).await.map(|_| ()),
            RoundTrip::Lite(p) => sqlx::query("SELECT 1").fetch_one(p).await.map(|_| ()),
        };
        done.expect("SELECT 1");
    }

    fn what(&self) -> &'static str {
        match self {
            RoundTrip::Pg(_) => "`SELECT 1`, prepared",
            RoundTrip::PgSimple(_) => "`SELECT 1`, simple query",
            RoundTrip::My(_) => "`SELECT 1`, prepared",
            RoundTrip::Lite(_) => "`SELECT 1` (in process, no write)",
        }
    }
}

pub(crate) async fn run(targets: &[Target], report: &mut Report, secs: f64) {
    let each = Duration::from_secs_f64((secs * 0.6).max(1.0));
    report.section(
        "(a) Uncontended lock + release against one round trip",
        &format!(
            "One owner, one call at a time, on free keys (64 of them in turn): `lock(key)` then \
             `release()` through a `Locker` with the default options, against one raw round trip \
             on a pool of the same kind (same URL, one connection, `test_before_acquire(false)`; \
             prepared statements straight to the servers, a simple query through PgBouncer, as \
             dblock's pooler mode sends). The two alternate call by call for {:.1} s per backend \
             after 0.2 s of warm-up. A lock + release is two statements (two round trips, two \
             commits; the grant waits for its disk flush, the release does not, the default), so \
             2× the round trip is its floor. SQLite has no round trip: its `SELECT 1` is a call \
             into the library on sqlx's worker thread, and the lock's cost is its commit.",
            each.as_secs_f64()
        ),
    );
    report.header(&[
        "backend",
        "round trip",
        "round trip p50",
        "round trip p99",
        "lock + release p50",
        "lock + release p99",
        "lock p50",
        "release p50",
        "p50 ratio",
        "p99 ratio",
        "samples",
    ]);
    let mut groups = Vec::new();
    for t in targets {
        super::vacuum(t).await;
        let (locker, raw) = match (t.locker().await, RoundTrip::connect(t).await) {
            (Ok(l), Ok(r)) => (l, r),
            (Err(e), _) => {
                report.row(&[t.name.into(), format!("skipped: {e}")]);
                continue;
            }
            (_, Err(e)) => {
                report.row(&[t.name.into(), format!("skipped: {e}")]);
                continue;
            }
        };
        let run = fastrand::u32(..);
        let keys: Vec<String> = (0..64).map(|i| format!("uncontended:{run}:{i}")).collect();
        let (mut rt, mut cycle, mut lock, mut release) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (measured, time) in [(false, Duration::from_millis(200)), (true, each)] {
            let start = Instant::now();
            let mut i = 0;
            while start.elapsed() < time {
                let t0 = Instant::now();
                raw.once().await;
                let t1 = Instant::now();
                let g = locker
                    .lock(&keys[i % keys.len()])
                    .ttl(Duration::from_secs(30))
                    .await
                    .unwrap();
                let t2 = Instant::now();
                g.release().await.unwrap();
                let t3 = Instant::now();
                if measured {
                    rt.push(ms_of(t1 - t0));
                    lock.push(ms_of(t2 - t1));
                    release.push(ms_of(t3 - t2));
                    cycle.push(ms_of(t3 - t1));
                }
                i += 1;
            }
        }
        let (rt50, rt99, c50, c99) = (
            pct(&rt, 0.5),
            pct(&rt, 0.99),
            pct(&cycle, 0.5),
            pct(&cycle, 0.99),
        );
        report.row(&[
            t.name.into(),
            raw.what().into(),
            ms(rt50),
            ms(rt99),
            ms(c50),
            ms(c99),
            ms(pct(&lock, 0.5)),
            ms(pct(&release, 0.5)),
            format!("{:.1}×", c50 / rt50),
            format!("{:.1}×", c99 / rt99),
            cycle.len().to_string(),
        ]);
        groups.push(Group {
            label: t.name.into(),
            sub: String::new(),
            bars: vec![
                ("SELECT 1 p50".into(), Some(rt50)),
                ("SELECT 1 p99".into(), Some(rt99)),
                ("lock + release p50".into(), Some(c50)),
                ("lock + release p99".into(), Some(c99)),
            ],
        });
        locker.shutdown().await;
    }
    report.chart(
        "series-uncontended.svg",
        &bars(
            "Uncontended lock + release against one SELECT 1 round trip",
            "ms",
            true,
            &groups,
        ),
    );
}
