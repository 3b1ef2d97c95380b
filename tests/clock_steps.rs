//! Steps of the database server's clock while keys are held: dblock's expiry is the database's
//! clock, so a step moves every live lease at once. Each PostgreSQL and MariaDB test runs a server
//! of its own under libfaketime (`common::cluster::PrivatePg::start_with_clock`,
//! `PrivateMariaDb::start_with_clock`), whose time of day the test steps; without the server
//! binaries or libfaketime it says SKIPPING and passes, unless `DBLOCK_REQUIRE_SERVERS=1`.
//!
//! - **Forward** by more than the remaining lease (an NTP correction of a clock that was behind,
//!   a failover to a server whose clock is ahead): every lease ends at once on the database. The
//!   holder's fenced write is refused from the step on, another owner takes the key with a higher
//!   token, and the holder learns it lost at its next renewal: within one renewal period (ttl/3)
//!   of the step.
//! - **Back**: every lease lasts that much longer. A renewing holder keeps its key and its fenced
//!   writes commit; a lease nobody renews (its holder crashed) keeps its key for the step longer
//!   than its ttl — the error, measured here, is the step.
//!
//! **SQLite** has no server: its clock is the clock of each process that runs a statement. Its
//! tests run the holder as a child process under libfaketime (this test binary, its ignored
//! `sqlite_clock_child`) and the contender in the test process on the real clock, on one file:
//! - the holder's clock steps **forward**: its lease ends for itself first — its fenced writes are
//!   refused and it learns `Lost` at its next renewal —, while to others it lasts until its end on
//!   their clock: nobody writes in between;
//! - the holder's clock steps **back** (its clock now disagrees with the others', which the
//!   documented assumption rules out): its renewals stop lengthening the lease (an extension never
//!   shortens one), the lease ends on the others' clock and another owner takes the key; the old
//!   holder's fenced writes are refused from that moment (the token changed), and it learns `Lost`
//!   at its next renewal.
//!
//! In all, the fenced writes are checked in commit order: their fencing tokens never go down (no
//! write of an old holder after a newer holder's).
#![cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]

mod common;

use std::time::{Duration, Instant};

use dblock::sqlx;
use dblock::{LockError, LockGuard, Locker, Owner};

/// `fenced_write(pool, guard, who)` on a pool of type `$pool`: the fence and `$insert` (token,
/// who) in one transaction, committed only if the fence held.
macro_rules! fenced_write {
    ($pool:ty, $insert:literal) => {
        async fn fenced_write(pool: &$pool, guard: &LockGuard, who: &str) -> Result<(), LockError> {
            let mut tx = pool.begin().await.map_err(LockError::Database)?;
            guard.fence(&mut *tx).await?;
            sqlx::query($insert)
                .bind(guard.fencing_token() as i64)
                .bind(who)
                .execute(&mut *tx)
                .await
                .map_err(LockError::Database)?;
            tx.commit().await.map_err(LockError::Database)
        }
    };
}

/// The two tests of a server backend: `$start` gives a server of the test's own with a clock
/// (`url()`, `set_clock(secs)`), `$pool` the application's pool type, `$create` and `$insert` the
/// table of fenced writes and one write (token, who).
macro_rules! server_clock_steps {
    ($module:ident, $feature:literal, $start:expr, $pool:ty, $create:literal, $insert:literal) => {
        #[cfg(feature = $feature)]
        mod $module {
            use super::*;

            /// The server, a locker on it (migrated), and an application pool with the table of
            /// fenced writes; `None` where the set-up cannot run.
            async fn setup(test: &str) -> Option<(impl Server, Locker, $pool)> {
                let server = $start(test).await?;
                let locker = Locker::connect(&server.url()).await.expect("connect");
                locker.migrate().await.expect("migrate");
                let pool = <$pool>::connect(&server.url()).await.expect("app pool");
                sqlx::query($create)
                    .execute(&pool)
                    .await
                    .expect("writes table");
                Some((server, locker, pool))
            }

            fenced_write!($pool, $insert);

            /// The committed writes in commit order: their tokens never go down.
            async fn check_history(pool: &$pool) -> usize {
                let rows: Vec<(i64, i64, String)> =
                    sqlx::query_as("SELECT id, token, who FROM writes ORDER BY id")
                        .fetch_all(pool)
                        .await
                        .expect("read the writes");
                for pair in rows.windows(2) {
                    assert!(
                        pair[1].1 >= pair[0].1,
                        "a write under an older token after a newer one: {pair:?}"
                    );
                }
                rows.len()
            }

            #[tokio::test]
            async fn a_forward_step_ends_every_lease_and_the_holder_learns_within_a_renewal() {
                let Some((server, locker, pool)) = setup("a forward clock step").await else {
                    return;
                };
                let ttl = Duration::from_secs(6);
                let old = locker.lock("k").ttl(ttl).await.expect("lock").auto_renew();
                fenced_write(&pool, &old, "old, before the step")
                    .await
                    .expect("a fenced write of the holder");
                // Mid-transaction when the clock steps.
                let mut tx = pool.begin().await.expect("begin");
                server.set_clock(60);
                let stepped = Instant::now();
                let refused = old.fence(&mut *tx).await;
                assert!(refused.is_err(), "fenced after the step: {refused:?}");
                drop(tx);
                let newer = locker
                    .lock("k")
                    .owner(&Owner::new())
                    .await
                    .expect("another owner takes the key at once");
                assert!(newer.fencing_token() > old.fencing_token());
                fenced_write(&pool, &newer, "newer")
                    .await
                    .expect("the newer holder writes");
                let lost = tokio::time::timeout(ttl, old.lost()).await;
                let learned = stepped.elapsed();
                assert!(matches!(lost, Ok(LockError::Lost { .. })), "{lost:?}");
                within_a_renewal(ttl, learned);
                assert!(fenced_write(&pool, &old, "old, after").await.is_err());
                assert_eq!(check_history(&pool).await, 2);
                println!(
                    "{}: clock_step_forward_60s_to_lost_ms={}",
                    stringify!($module),
                    learned.as_millis()
                );
                server.set_clock(0);
            }

            #[tokio::test]
            async fn a_backward_step_lengthens_every_lease_by_the_step() {
                let Some((server, locker, pool)) = setup("a backward clock step").await else {
                    return;
                };
                let step = 10;
                let renewing = locker
                    .lock("renewed")
                    .ttl(Duration::from_secs(3))
                    .await
                    .expect("lock")
                    .auto_renew();
                let ttl = Duration::from_secs(2);
                // A holder that crashed: its lease is never renewed nor released.
                let abandoned = locker.lock("abandoned").ttl(ttl).await.expect("lock");
                let taken_at = Instant::now();
                std::mem::forget(abandoned);
                server.set_clock(-step);
                let other = locker
                    .lock("abandoned")
                    .owner(&Owner::new())
                    .wait(Duration::from_secs(30))
                    .await
                    .expect("the key comes back once the lease ends on the stepped clock");
                let held_for = taken_at.elapsed();
                let error = held_for.saturating_sub(ttl);
                // The lease lasted its ttl plus the step (less what passed before the step).
                assert!(
                    error >= Duration::from_secs(step as u64) - Duration::from_millis(800)
                        && error <= Duration::from_secs(step as u64) + Duration::from_secs(2),
                    "held {held_for:?} for a {ttl:?} lease after a {step} s step back"
                );
                drop(other);
                // Meanwhile the renewing holder kept its key, and its fenced writes commit.
                assert!(!renewing.is_lost());
                fenced_write(&pool, &renewing, "renewing, after the step")
                    .await
                    .expect("the renewing holder still writes");
                let info = locker
                    .inspect("renewed")
                    .await
                    .expect("inspect")
                    .expect("row");
                assert!(info.held && info.fencing_token == renewing.fencing_token());
                assert_eq!(check_history(&pool).await, 1);
                println!(
                    "{}: clock_step_back_{step}s_lease_error_ms={}",
                    stringify!($module),
                    error.as_millis()
                );
                renewing.release().await.expect("release");
                server.set_clock(0);
            }
        }
    };
}

/// A holder learned it lost `learned` after the fact: within one renewal period (ttl/3), and a
/// little for the statement.
fn within_a_renewal(ttl: Duration, learned: Duration) {
    assert!(
        learned <= ttl / 3 + Duration::from_millis(1500),
        "{learned:?}"
    );
}

/// A database server whose clock the test steps.
#[cfg(any(feature = "postgres", feature = "mysql"))]
trait Server {
    fn set_clock(&self, secs: i64);
}

#[cfg(feature = "postgres")]
impl Server for common::cluster::PrivatePg {
    fn set_clock(&self, secs: i64) {
        common::cluster::PrivatePg::set_clock(self, secs)
    }
}

#[cfg(feature = "mysql")]
impl Server for common::cluster::PrivateMariaDb {
    fn set_clock(&self, secs: i64) {
        common::cluster::PrivateMariaDb::set_clock(self, secs)
    }
}

server_clock_steps!(
    postgres,
    "postgres",
    |test| async move { common::cluster::PrivatePg::start_with_clock(test, &[]) },
    sqlx::PgPool,
    "CREATE TABLE writes (id bigserial PRIMARY KEY, token bigint NOT NULL, who text NOT NULL)",
    "INSERT INTO writes (token, who) VALUES ($1, $2)"
);

server_clock_steps!(
    mariadb,
    "mysql",
    common::cluster::PrivateMariaDb::start_with_clock,
    sqlx::MySqlPool,
    "CREATE TABLE writes (id BIGINT AUTO_INCREMENT PRIMARY KEY, token BIGINT NOT NULL, who TEXT NOT NULL)",
    "INSERT INTO writes (token, who) VALUES (?, ?)"
);

/// SQLite: the holder in a child process under libfaketime, the contender here.
#[cfg(feature = "sqlite")]
mod sqlite {
    use std::io::BufRead;
    use std::process::{Child, Command, Stdio};

    use dblock::sqlx::SqlitePool;
    use tokio::sync::mpsc;

    use super::*;

    const FAKETIME_LIB: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";
    const TTL: Duration = Duration::from_secs(6);

    fenced_write!(
        SqlitePool,
        "INSERT INTO writes (token, who) VALUES ($1, $2)"
    );

    /// The holder: takes `k` with renewal, writes under it every 100 ms, and says what happens
    /// on its stdout: `HELD`, `REFUSED` (a fenced write refused, the first time), `LOST`.
    #[tokio::test]
    #[ignore = "the child process of the SQLite clock-step tests"]
    async fn sqlite_clock_child() {
        let url = std::env::var("DBLOCK_CLOCK_CHILD_URL").expect("DBLOCK_CLOCK_CHILD_URL");
        let locker = Locker::connect(&url).await.expect("connect");
        let pool = SqlitePool::connect(&url).await.expect("pool");
        let guard = locker.lock("k").ttl(TTL).await.expect("lock").auto_renew();
        fenced_write(&pool, &guard, "old")
            .await
            .expect("the first write");
        println!("HELD {}", guard.fencing_token());
        let mut refused = false;
        let lost = guard.lost();
        tokio::pin!(lost);
        for _ in 0..300 {
            tokio::select! {
                _ = &mut lost => {
                    println!("LOST");
                    return;
                }
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
            if fenced_write(&pool, &guard, "old").await.is_err() && !refused {
                refused = true;
                println!("REFUSED");
            }
        }
        println!("NEVER LOST");
    }

    /// The child's lines as they come, each with the instant it was read.
    fn lines(child: &mut Child) -> mpsc::UnboundedReceiver<(String, Instant)> {
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if tx.send((line, Instant::now())).is_err() {
                    break;
                }
            }
        });
        rx
    }

    /// Waits for a line containing `word`; when it came.
    async fn said(rx: &mut mpsc::UnboundedReceiver<(String, Instant)>, word: &str) -> Instant {
        let wait = async {
            while let Some((line, at)) = rx.recv().await {
                if line.contains(word) {
                    return at;
                }
            }
            panic!("the child ended without saying {word}");
        };
        tokio::time::timeout(Duration::from_secs(30), wait)
            .await
            .unwrap_or_else(|_| panic!("the child did not say {word} in 30 s"))
    }

    struct Run {
        _dir: tempfile::TempDir,
        offset: std::path::PathBuf,
        locker: Locker,
        pool: SqlitePool,
        child: Child,
        out: mpsc::UnboundedReceiver<(String, Instant)>,
    }

    impl Drop for Run {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// The file, its writes table, and the holder started and holding; `None` without libfaketime.
    async fn start(test: &str) -> Option<Run> {
        if !std::path::Path::new(FAKETIME_LIB).exists() {
            let msg = format!("SKIPPING {test}: no libfaketime ({FAKETIME_LIB}; package faketime)");
            assert!(!common::require_servers(), "{msg}");
            common::shout(&msg);
            return None;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!(
            "sqlite://{}?mode=rwc",
            dir.path().join("locks.db").display()
        );
        let offset = dir.path().join("offset");
        std::fs::write(&offset, "+0\n").unwrap();
        let locker = Locker::connect(&url).await.expect("connect");
        locker.migrate().await.expect("migrate");
        let pool = SqlitePool::connect(&url).await.expect("pool");
        sqlx::query(
            "CREATE TABLE writes (id INTEGER PRIMARY KEY, token INTEGER NOT NULL, who TEXT NOT NULL)",
        )
        .execute(&pool)
        .await
        .expect("writes table");
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "sqlite::sqlite_clock_child",
                "--exact",
                "--ignored",
                "--nocapture",
            ])
            .env("DBLOCK_CLOCK_CHILD_URL", &url)
            .env("LD_PRELOAD", FAKETIME_LIB)
            .env("FAKETIME_TIMESTAMP_FILE", &offset)
            .env("FAKETIME_NO_CACHE", "1")
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the holder");
        let mut out = lines(&mut child);
        said(&mut out, "HELD").await;
        Some(Run {
            _dir: dir,
            offset,
            locker,
            pool,
            child,
            out,
        })
    }

    impl Run {
        /// Steps the holder's clock by `secs`; the instant of the step.
        fn step(&self, secs: i64) -> Instant {
            std::fs::write(&self.offset, format!("{secs:+}\n")).unwrap();
            Instant::now()
        }

        /// Takes the key as another owner, waiting as long as it takes; writes under it.
        async fn take_over(&self) -> (LockGuard, Instant) {
            let guard = self
                .locker
                .lock("k")
                .owner(&Owner::new())
                .wait(Duration::from_secs(30))
                .await
                .expect("the key comes back");
            let at = Instant::now();
            fenced_write(&self.pool, &guard, "new")
                .await
                .expect("the new holder writes");
            (guard, at)
        }

        /// The writes in commit order: tokens never go down; the old holder's, then one of the
        /// new holder's.
        async fn check_history(&self) {
            let rows: Vec<(i64, i64, String)> =
                sqlx::query_as("SELECT id, token, who FROM writes ORDER BY id")
                    .fetch_all(&self.pool)
                    .await
                    .expect("read the writes");
            for pair in rows.windows(2) {
                assert!(pair[1].1 >= pair[0].1, "out of order: {pair:?}");
            }
            let old = rows.iter().filter(|r| r.2 == "old").count();
            let newer = rows.len() - old;
            assert!(old >= 1 && newer == 1, "{old} old, {newer} new writes");
        }
    }

    #[tokio::test]
    async fn a_holder_whose_clock_steps_forward_loses_its_key_first() {
        let Some(mut run) = start("the SQLite forward clock step").await else {
            return;
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        let stepped = run.step(60);
        let refused = said(&mut run.out, "REFUSED").await;
        let lost = said(&mut run.out, "LOST").await;
        let (new, taken) = run.take_over().await;
        assert!(
            refused < taken,
            "the old holder wrote until the new one took the key"
        );
        let learned = lost - stepped;
        within_a_renewal(TTL, learned);
        run.check_history().await;
        println!(
            "sqlite_holder_clock_forward_60s: refused_after_ms={} lost_after_ms={} taken_after_ms={}",
            (refused - stepped).as_millis(),
            learned.as_millis(),
            (taken - stepped).as_millis()
        );
        drop(new);
    }

    #[tokio::test]
    async fn a_holder_whose_clock_steps_back_is_fenced_off_once_the_key_is_taken() {
        let Some(mut run) = start("the SQLite backward clock step").await else {
            return;
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        let stepped = run.step(-10);
        let (new, taken) = run.take_over().await;
        let lost = said(&mut run.out, "LOST").await;
        // The old holder learns at its next renewal after the take-over.
        let learned = lost.saturating_duration_since(taken);
        within_a_renewal(TTL, learned);
        run.check_history().await;
        println!(
            "sqlite_holder_clock_back_10s: taken_after_ms={} lost_after_take_ms={}",
            (taken - stepped).as_millis(),
            learned.as_millis()
        );
        drop(new);
    }
}
