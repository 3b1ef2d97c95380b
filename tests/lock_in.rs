//! The lock inside the app's transaction (`Locker::lock_in`, `tx = ..`) and the release that
//! commits with the work (`release_in`), on every backend: a key taken in an open transaction
//! excludes lease holders and other transactions, and they exclude it, each `Busy` within its
//! `wait` with the caller's transaction still usable; the commit frees it at once with a larger
//! fencing token and the hold recorded `Succeeded`; a rollback leaves nothing; `release_in`
//! frees the key exactly when the work commits, and after a rollback the hold stays the
//! owner's until the background release gives it back.

mod common;

use std::time::{Duration, Instant};

use dblock::{distributed_lock, LockError, Locker, Outcome};

const SEC: Duration = Duration::from_secs(1);

/// How long a lease call may take past its own `wait` to say `Busy` on a key a transaction
/// holds: PostgreSQL's lock statements wait 250 ms for a row lock, MySQL's 1 s (whole seconds),
/// SQLite's the busy timeout for the file's write lock. Plus a loaded machine's slack.
fn busy_slack(name: &str) -> Duration {
    match name {
        "sqlite" => 7 * SEC,
        "mariadb" | "mysql8-path" => 3 * SEC,
        _ => 2 * SEC,
    }
}

/// A lease call on `key` as a fresh owner (another task): `Busy`, and how long it took.
async fn lease_is_busy(name: &str, l: &Locker, key: &str, wait: Duration) -> Duration {
    let (l, key, name) = (l.clone(), key.to_owned(), name.to_owned());
    tokio::spawn(async move {
        let started = Instant::now();
        match l.lock(&key).wait(wait).await {
            Err(LockError::Busy { .. }) => started.elapsed(),
            other => panic!("{name}: a lease call on a key held in a transaction: {other:?}"),
        }
    })
    .await
    .unwrap()
}

/// Waits until `key` is not held (reads only), then its row.
async fn until_free(l: &Locker, key: &str, limit: Duration) -> Option<dblock::LockInfo> {
    let started = Instant::now();
    while started.elapsed() < limit {
        match l.inspect(key).await.unwrap() {
            Some(info) if info.held => {}
            other => return other,
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

/// A transaction as the docs advise: `BEGIN IMMEDIATE` on SQLite; on MySQL 8, whose statement
/// cannot bound its own wait for a row lock, a session wait of 1 s.
macro_rules! begin {
    ($pool:expr, $name:expr) => {{
        let mut tx = if $name == "sqlite" {
            $pool.begin_with("BEGIN IMMEDIATE").await.unwrap()
        } else {
            $pool.begin().await.unwrap()
        };
        if $name == "mysql8-path" {
            sqlx::raw_sql("SET SESSION innodb_lock_wait_timeout = 1")
                .execute(&mut *tx)
                .await
                .unwrap();
        }
        tx
    }};
}

/// Runs `$case!(Pool, db)` — with the backend's locked function, `$case!(Pool, db, function)` —
/// for every reachable backend of `common::all($label)`, `Pool` the backend's application pool.
macro_rules! every_backend {
    ($label:expr, $case:ident $(, $lite:ident, $pg:ident, $my:ident)?) => {{
        let (dbs, _dir) = common::all($label).await;
        for db in &dbs {
            match db.name {
                #[cfg(feature = "sqlite")]
                "sqlite" => $case!(sqlx::SqlitePool, db $(, $lite)?),
                #[cfg(feature = "postgres")]
                n if common::is_postgres(n) => $case!(sqlx::PgPool, db $(, $pg)?),
                #[cfg(feature = "mysql")]
                "mariadb" | "mysql8-path" => $case!(sqlx::MySqlPool, db $(, $my)?),
                _ => {}
            }
        }
    }};
}

/// `lock_in` against leases and against another transaction, commit and rollback.
macro_rules! against_leases {
    ($pool:ty, $db:expr) => {{
        let db: &common::Db = $db;
        let (name, l) = (db.name, &db.locker);
        let pool = <$pool as common::TestPool>::open(&db.url).await;

        // A key no one has used: taken in the transaction, busy for a lease meanwhile.
        let mut tx = begin!(pool, name);
        let first = l.lock_in(&mut *tx, "k").await.unwrap();
        assert_eq!(first.key(), "k");
        let took = lease_is_busy(name, l, "k", Duration::from_millis(300)).await;
        assert!(
            took < Duration::from_millis(300) + busy_slack(name),
            "{name}: {took:?}"
        );
        tx.commit().await.unwrap();

        // Committed: free at once, the hold recorded as succeeded, the token larger next time.
        let info = l.inspect("k").await.unwrap().unwrap();
        assert!(!info.held, "{name}: {info:?}");
        assert_eq!(info.last_outcome, Some(Outcome::Succeeded), "{name}");
        let lease = l.lock("k").await.unwrap();
        assert!(lease.fencing_token() > first.fencing_token(), "{name}");

        // Held by a lease: busy within its wait, and the transaction goes on.
        let mut tx = begin!(pool, name);
        let started = Instant::now();
        match l
            .lock_in(&mut *tx, "k")
            .wait(Duration::from_millis(200))
            .await
        {
            Err(LockError::Busy { .. }) => {}
            other => panic!("{name}: lock_in on a leased key: {other:?}"),
        }
        assert!(
            started.elapsed() < 3 * SEC,
            "{name}: {:?}",
            started.elapsed()
        );
        // The transaction is still usable: nothing in it failed.
        sqlx::raw_sql("SELECT 1").execute(&mut *tx).await.unwrap(); // unprepared: PgBouncer too
        // The lease ends while lock_in waits: taken within the wait. (Not on SQLite, where the
        // transaction holds the file's write lock, so the holder cannot release meanwhile: a
        // key held by a lease is busy at once there.)
        let token = lease.fencing_token();
        let second = if name == "sqlite" {
            tx.rollback().await.unwrap();
            lease.release().await.unwrap();
            tx = begin!(pool, name);
            l.lock_in(&mut *tx, "k").await.unwrap()
        } else {
            let releaser = tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                lease.release().await.unwrap();
            });
            let second = l.lock_in(&mut *tx, "k").wait(10 * SEC).await.unwrap();
            releaser.await.unwrap();
            second
        };
        assert!(second.fencing_token() > token, "{name}");

        // Another transaction: busy within its wait; it gets the key once the first commits.
        let mut other = begin_other!(pool, name, tx);
        if let Some(other) = other.as_mut() {
            match l
                .lock_in(&mut **other, "k")
                .wait(Duration::from_millis(200))
                .await
            {
                Err(LockError::Busy { .. }) => {}
                other => panic!("{name}: lock_in on a key another transaction holds: {other:?}"),
            }
        }
        // Rolled back: nothing happened (the committed row is the lease's release).
        tx.rollback().await.unwrap();
        let info = l.inspect("k").await.unwrap().unwrap();
        assert!(!info.held, "{name}");
        assert_eq!(
            info.fencing_token, token,
            "{name}: a rolled-back lock_in left its token"
        );
        if let Some(mut other) = other {
            let third = l
                .lock_in(&mut *other, "k")
                .wait(5 * SEC)
                .await
                .unwrap_or_else(|e| panic!("{name}: {e:?}"));
            assert!(third.fencing_token() > token, "{name}");
            other.commit().await.unwrap();
        }
        pool.close().await;
    }};
}

/// On a server a second transaction is open beside the first; SQLite has one writer per file,
/// so there it is skipped (`None`).
macro_rules! begin_other {
    ($pool:expr, $name:expr, $tx:expr) => {
        if $name == "sqlite" {
            None
        } else {
            Some(begin!($pool, $name))
        }
    };
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_in_excludes_leases_and_transactions_and_ends_with_its_transaction() {
    every_backend!("lock_in", against_leases);
}

/// A failover that rolled the key's row back to an older token (asynchronous replication):
/// `lock_in`'s next token is above every token issued before it, as a lease's is
/// (`tests/locking.rs`).
macro_rules! after_rolled_back_failover {
    ($pool:ty, $db:expr) => {{
        let db: &common::Db = $db;
        let name = db.name;
        let l = db.locker.table(&common::table_for("lock_in_rb"));
        l.migrate().await.unwrap();
        let pool = <$pool as common::TestPool>::open(&db.url).await;
        let mut tokens = Vec::new();
        for _ in 0..2 {
            let mut tx = begin!(pool, name);
            tokens.push(l.lock_in(&mut *tx, "k").await.unwrap().fencing_token());
            tx.commit().await.unwrap();
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
        let (first, lost) = (tokens[0], tokens[1]);
        assert!(lost > first, "{name}");
        let table = l.table_name();
        common::run_sql(
            name,
            &db.url,
            &format!("UPDATE {table} SET fencing_token = {first} WHERE lock_key = 'k'"),
        )
        .await;
        let mut tx = begin!(pool, name);
        let next = l.lock_in(&mut *tx, "k").await.unwrap().fencing_token();
        tx.commit().await.unwrap();
        assert!(
            next > lost,
            "{name}: {next} after a rollback to {first}; {lost} was issued"
        );
        pool.close().await;
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_in_never_issues_a_token_a_rolled_back_failover_lost() {
    every_backend!("lock_in_rb", after_rolled_back_failover);
}

/// `release_in`: the key is free exactly when the work commits; after a rollback the hold stays
/// its owner's until the background release gives it back (recording `Dropped`).
macro_rules! release_in {
    ($pool:ty, $db:expr) => {{
        let db: &common::Db = $db;
        let (name, l) = (db.name, &db.locker);
        let pool = <$pool as common::TestPool>::open(&db.url).await;

        let guard = l.lock("r").ttl(30 * SEC).await.unwrap();
        let token = guard.fencing_token();
        let mut tx = begin!(pool, name);
        guard.release_in(&mut *tx).await.unwrap();
        if name != "sqlite" {
            // Not committed yet: still held (the committed row is the lease).
            let info = l.inspect("r").await.unwrap().unwrap();
            assert!(info.held, "{name}: released before the commit");
        }
        tx.commit().await.unwrap();
        let info = l.inspect("r").await.unwrap().unwrap();
        assert!(!info.held, "{name}: {info:?}");
        assert_eq!(info.last_outcome, Some(Outcome::Succeeded), "{name}");
        let next = l.lock("r").await.unwrap();
        assert!(next.fencing_token() > token, "{name}");

        // Rolled back: the hold is still the owner's, then given back in the background.
        let mut tx = begin!(pool, name);
        next.release_in(&mut *tx).await.unwrap();
        tx.rollback().await.unwrap();
        let info = until_free(l, "r", 20 * SEC)
            .await
            .unwrap_or_else(|| panic!("{name}: never given back after the rollback"));
        assert_eq!(
            info.last_outcome,
            Some(Outcome::Dropped),
            "{name}: {info:?}"
        );
        pool.close().await;
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_in_frees_the_key_when_the_work_commits_and_not_before() {
    every_backend!("release_in", release_in);
}

#[derive(Debug)]
#[allow(dead_code)] // read by `Debug` in failures
enum AppError {
    Lock(LockError),
    Db(sqlx::Error),
}
impl From<LockError> for AppError {
    fn from(e: LockError) -> Self {
        AppError::Lock(e)
    }
}
impl From<sqlx::Error> for AppError {
    fn from(e: sqlx::Error) -> Self {
        AppError::Db(e)
    }
}

/// The attribute with `tx = tx`: the key is taken on the body's transaction before the body
/// runs, `dblock::current()` sees it, and the caller commits.
#[cfg(feature = "sqlite")]
#[distributed_lock(key = "order:{id}", tx = tx, locker = locker, wait = "2s")]
async fn settle_sqlite(
    locker: &Locker,
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    id: u64,
) -> Result<u64, AppError> {
    let held = dblock::current().expect("current() inside the body");
    assert_eq!(held.key, format!("order:{id}"));
    sqlx::query("SELECT 1").execute(&mut **tx).await?;
    dblock::fence(&mut **tx).await?;
    Ok(held.fencing_token)
}

#[cfg(feature = "postgres")]
#[distributed_lock(key = "order:{id}", tx = tx, locker = locker, wait = "2s")]
async fn settle_pg(
    locker: &Locker,
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    id: u64,
) -> Result<u64, AppError> {
    let held = dblock::current().expect("current() inside the body");
    assert_eq!(held.key, format!("order:{id}"));
    dblock::fence(&mut **tx).await?;
    Ok(held.fencing_token)
}

#[cfg(feature = "mysql")]
#[distributed_lock(key = "order:{id}", tx = tx, locker = locker, wait = "2s")]
async fn settle_my(
    locker: &Locker,
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    id: u64,
) -> Result<u64, AppError> {
    let held = dblock::current().expect("current() inside the body");
    assert_eq!(held.key, format!("order:{id}"));
    dblock::fence(&mut **tx).await?;
    Ok(held.fencing_token)
}

/// The outer hold of a re-entered key given to `release_in` (its own count was 1 when taken;
/// the owner holds the key twice now): the statement does not free the key under the inner
/// hold. It records the success, and the outer guard is given back on its own (the count goes
/// down by one); the key stays the owner's until the inner hold is released too.
macro_rules! outer_release_in {
    ($pool:ty, $db:expr) => {{
        let db: &common::Db = $db;
        let (name, l) = (db.name, &db.locker);
        let pool = <$pool as common::TestPool>::open(&db.url).await;
        let owner = dblock::Owner::new();
        let outer = l.lock("nested").owner(&owner).ttl(30 * SEC).await.unwrap();
        let inner = l.lock("nested").owner(&owner).ttl(30 * SEC).await.unwrap();
        assert_eq!(inner.hold_count(), 2, "{name}");
        let mut tx = begin!(pool, name);
        outer.release_in(&mut *tx).await.unwrap();
        tx.commit().await.unwrap();
        let info = l.inspect("nested").await.unwrap().unwrap();
        assert!(
            info.held,
            "{name}: the key was freed under the inner hold: {info:?}"
        );
        // Past the outer guard's own release in the background (500 ms): still the owner's.
        lease_is_busy(name, l, "nested", Duration::from_millis(800)).await;
        inner.release().await.unwrap();
        until_free(l, "nested", 20 * SEC)
            .await
            .unwrap_or_else(|| panic!("{name}: never free after both holds"));
        pool.close().await;
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_in_of_an_outer_hold_leaves_the_key_to_the_inner_one() {
    every_backend!("release_in_outer", outer_release_in);
}

/// A read hold given to `release_in`: readers share the key's row, so the statement does not
/// release it (it records the success, as `succeed_in`) and the guard is given back on its own.
/// The other reader keeps the key: a writer stays `Busy` until that reader leaves too.
macro_rules! reader_release_in {
    ($pool:ty, $db:expr) => {{
        let db: &common::Db = $db;
        let (name, l) = (db.name, &db.locker);
        let pool = <$pool as common::TestPool>::open(&db.url).await;
        let first = l.read("r").await.unwrap();
        let second = l.read("r").await.unwrap();
        let mut tx = begin!(pool, name);
        first.release_in(&mut *tx).await.unwrap();
        tx.commit().await.unwrap();
        match l.lock("r").wait(Duration::from_millis(600)).await {
            Err(LockError::Busy { .. }) => {}
            other => panic!("{name}: a writer beside the reader left: {other:?}"),
        }
        second.release().await.unwrap();
        let writer = l.lock("r").wait(10 * SEC).await;
        writer
            .unwrap_or_else(|e| panic!("{name}: {e:?}"))
            .release()
            .await
            .unwrap();
        pool.close().await;
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_in_of_a_read_hold_leaves_the_other_readers_theirs() {
    every_backend!("lock_in_reader", reader_release_in);
}

/// A locked body (a lease) whose `dblock::release_in` rolls back, and which goes on: the key is
/// still the body's (the same tenure; not renewed any more), and when the body ends it is given
/// back, recording `Dropped`.
macro_rules! rolled_back_body {
    ($f:ident, $pool:ty) => {
        #[distributed_lock(key = "job:{id}", locker = locker, ttl = "30s")]
        async fn $f(locker: &Locker, pool: &$pool, id: u64, name: &str) -> Result<(), AppError> {
            let held = dblock::current().expect("current() inside the body");
            let mut tx = begin!(pool, name);
            dblock::release_in(&mut *tx).await?;
            tx.rollback().await?;
            let info = locker.inspect(&held.key).await?.expect("the key's row");
            assert!(
                info.held,
                "{name}: given back while the body runs: {info:?}"
            );
            assert_eq!(info.fencing_token, held.fencing_token, "{name}");
            // The body carries on and fails.
            Err(AppError::Db(sqlx::Error::RowNotFound))
        }
    };
}
#[cfg(feature = "sqlite")]
rolled_back_body!(rolled_back_sqlite, sqlx::SqlitePool);
#[cfg(feature = "postgres")]
rolled_back_body!(rolled_back_pg, sqlx::PgPool);
#[cfg(feature = "mysql")]
rolled_back_body!(rolled_back_my, sqlx::MySqlPool);

macro_rules! rolled_back {
    ($pool:ty, $db:expr, $f:ident) => {{
        let db: &common::Db = $db;
        let (name, l) = (db.name, &db.locker);
        let pool = <$pool as common::TestPool>::open(&db.url).await;
        match $f(l, &pool, 3, name).await {
            Err(AppError::Db(sqlx::Error::RowNotFound)) => {}
            other => panic!("{name}: {other:?}"),
        }
        let ended = Instant::now();
        let info = until_free(l, "job:3", 10 * SEC)
            .await
            .unwrap_or_else(|| panic!("{name}: never given back after the body ended"));
        assert_eq!(
            info.last_outcome,
            Some(Outcome::Dropped),
            "{name}: {info:?}"
        );
        assert!(ended.elapsed() < 5 * SEC, "{name}: {:?}", ended.elapsed());
        pool.close().await;
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_whose_release_in_rolls_back_keeps_its_key_until_it_ends() {
    every_backend!(
        "release_in_body",
        rolled_back,
        rolled_back_sqlite,
        rolled_back_pg,
        rolled_back_my
    );
}

macro_rules! attribute {
    ($pool:ty, $db:expr, $f:ident) => {{
        let db: &common::Db = $db;
        let (name, l) = (db.name, &db.locker);
        let pool = <$pool as common::TestPool>::open(&db.url).await;
        let mut tx = begin!(pool, name);
        let token = $f(l, &mut tx, 7).await.unwrap();
        // The body has returned; the key is held until the caller's commit.
        if name != "sqlite" {
            lease_is_busy(name, l, "order:7", Duration::ZERO).await;
        }
        tx.commit().await.unwrap();
        let lease = l.lock("order:7").await.unwrap();
        assert!(lease.fencing_token() > token, "{name}");
        // Held by that lease: the attribute's call is busy within its wait.
        let mut tx = begin!(pool, name);
        let started = Instant::now();
        match $f(l, &mut tx, 7).await {
            Err(AppError::Lock(LockError::Busy { .. })) => {}
            other => panic!("{name}: {other:?}"),
        }
        assert!(started.elapsed() < 5 * SEC, "{name}");
        tx.rollback().await.unwrap();
        lease.release().await.unwrap();
        pool.close().await;
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_attribute_takes_the_key_on_the_bodys_transaction() {
    every_backend!(
        "lock_in_attr",
        attribute,
        settle_sqlite,
        settle_pg,
        settle_my
    );
}

/// PostgreSQL, directly and through PgBouncer: a transaction that holds the key's row lock while
/// a lease holds the key (as a `lock_in` attempt leaves it when the lease commits between the
/// statement's snapshot and its lock: that race is too narrow to force, so the test takes the
/// row lock itself) answers busy at once, not after its `wait`, so that the holder can release;
/// a transaction that does not hold it (but has written, so it has an id) waits, and takes the
/// key once the lease is released (on the direct server).
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_holding_the_keys_row_is_busy_at_once() {
    let test = "lock_in_row_held";
    let mut dbs = Vec::new();
    dbs.extend(common::postgres(test).await);
    dbs.extend(common::pgbouncer(test).await);
    for db in &dbs {
        let name = db.name;
        let table = common::table_for(test);
        let l = db.locker.table(&table);
        l.migrate().await.unwrap();
        let pool = <sqlx::PgPool as common::TestPool>::open(&db.url).await;
        let lease = l.lock("k").ttl(30 * SEC).await.unwrap();

        let mut tx = pool.begin().await.unwrap();
        let hold_row = format!(r#"SELECT 1 FROM "{table}" WHERE lock_key = 'k' FOR UPDATE"#);
        sqlx::raw_sql(sqlx::AssertSqlSafe(hold_row))
            .execute(&mut *tx)
            .await
            .unwrap();
        let started = Instant::now();
        match l.lock_in(&mut *tx, "k").wait(4 * SEC).await {
            Err(LockError::Busy { .. }) => {}
            other => panic!("{name}: {other:?}"),
        }
        let took = started.elapsed();
        assert!(took < 2 * SEC, "{name}: busy after {took:?}, not at once");
        sqlx::raw_sql("SELECT 1").execute(&mut *tx).await.unwrap();
        tx.rollback().await.unwrap();
        if name == common::PGBOUNCER {
            // PgBouncer's pool here is 3 server connections, shared with the other tests of
            // this file: a transaction held open while the release goes through is left to
            // the direct server.
            lease.release().await.unwrap();
            pool.close().await;
            continue;
        }

        let mut tx = pool.begin().await.unwrap();
        sqlx::raw_sql("SELECT txid_current()")
            .execute(&mut *tx)
            .await
            .unwrap();
        let released = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(800)).await;
            lease.release().await.unwrap();
        });
        let started = Instant::now();
        let got = l.lock_in(&mut *tx, "k").wait(10 * SEC).await;
        let took = started.elapsed();
        let got = got.unwrap_or_else(|e| panic!("{name}: {e:?} after {took:?}"));
        assert!(took >= Duration::from_millis(700), "{name}: {took:?}");
        tx.commit().await.unwrap();
        released.await.unwrap();
        let info = l.inspect("k").await.unwrap().unwrap();
        assert_eq!(info.fencing_token, got.fencing_token(), "{name}");
        pool.close().await;
    }
}

/// A lock statement of a locker on a connection of another database is a configuration error,
/// not a confusing SQL error.
#[cfg(all(feature = "sqlite", feature = "postgres"))]
#[tokio::test]
async fn lock_in_on_another_databases_connection_is_refused() {
    let (db, _dir) = common::sqlite("lock_in_mismatch").await;
    let Some(pg) = common::postgres("lock_in_mismatch").await else {
        return;
    };
    let pool = <sqlx::PgPool as common::TestPool>::open(&pg.url).await;
    let mut tx = pool.begin().await.unwrap();
    match db.locker.lock_in(&mut *tx, "k").await {
        Err(LockError::Config(msg)) => assert!(msg.contains("postgres"), "{msg}"),
        other => panic!("{other:?}"),
    }
}

/// Holds of one kind or the other, for the cross-process test.
const ROUNDS: u64 = 12;

/// One hold of the shared counter (a file: it is not in the database, so only the lock keeps the
/// read-modify-write whole), as `lock_in` in a transaction or as a lease; its token appended to
/// the log while held.
macro_rules! bump_counter {
    ($pool:ty, $url:expr, $name:expr, $locker:expr, $dir:expr) => {{
        let pool = <$pool as common::TestPool>::open($url).await;
        for round in 0..ROUNDS {
            let counter = $dir.join("counter");
            let bump = |token: u64| {
                let n: u64 = std::fs::read_to_string(&counter)
                    .unwrap()
                    .trim()
                    .parse()
                    .unwrap();
                std::thread::sleep(Duration::from_millis(3)); // widen the race window
                std::fs::write(&counter, format!("{}\n", n + 1)).unwrap();
                let mut log = std::fs::OpenOptions::new()
                    .append(true)
                    .open($dir.join("tokens"))
                    .unwrap();
                use std::io::Write as _;
                writeln!(log, "{token}").unwrap();
            };
            if round % 2 == 0 {
                // On SQLite a key held by a lease is busy at once (the transaction would keep
                // its holder from releasing), and so on MySQL at REPEATABLE READ when a lease
                // took the key in the instant after the check: the transaction is begun again.
                let (tx, lock) = loop {
                    let mut tx = begin!(pool, $name);
                    match $locker.lock_in(&mut *tx, "counter").wait(120 * SEC).await {
                        Ok(lock) => break (tx, lock),
                        Err(LockError::Busy { .. }) => {
                            tx.rollback().await.unwrap();
                            tokio::time::sleep(Duration::from_millis(2)).await;
                        }
                        Err(e) => panic!("{e:?}"),
                    }
                };
                bump(lock.fencing_token());
                tx.commit().await.unwrap();
            } else {
                let guard = $locker.lock("counter").wait(120 * SEC).await.unwrap();
                bump(guard.fencing_token());
                guard.release().await.unwrap();
            }
        }
    }};
}

/// Holds the key in a transaction and waits to be killed.
macro_rules! hold_until_killed {
    ($pool:ty, $url:expr, $name:expr, $locker:expr) => {{
        let pool = <$pool as common::TestPool>::open($url).await;
        let mut tx = begin!(pool, $name);
        let lock = $locker.lock_in(&mut *tx, "doomed").await.unwrap();
        println!("HELD {}", lock.fencing_token());
        use std::io::Write as _;
        std::io::stdout().flush().unwrap();
        tokio::time::sleep(Duration::from_secs(600)).await;
        drop(tx);
    }};
}

/// Runs only inside a child process (ignored in normal runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "child process entry point, started by the other tests"]
async fn child_entry() {
    let (role, locker) = common::child_locker().await;
    let url = std::env::var("DBLOCK_CHILD_URL").unwrap();
    let name = std::env::var("DBLOCK_CHILD_BACKEND").unwrap();
    let name = name.as_str();
    match role.as_str() {
        "counter" => {
            let dir = std::path::PathBuf::from(std::env::var("DBLOCK_CHILD_DIR").unwrap());
            match name {
                #[cfg(feature = "sqlite")]
                "sqlite" => bump_counter!(sqlx::SqlitePool, &url, name, locker, dir),
                #[cfg(feature = "postgres")]
                n if common::is_postgres(n) => bump_counter!(sqlx::PgPool, &url, name, locker, dir),
                #[cfg(feature = "mysql")]
                _ => bump_counter!(sqlx::MySqlPool, &url, name, locker, dir),
                #[allow(unreachable_patterns)]
                _ => unreachable!(),
            }
        }
        "holder" => match name {
            #[cfg(feature = "sqlite")]
            "sqlite" => hold_until_killed!(sqlx::SqlitePool, &url, name, locker),
            #[cfg(feature = "postgres")]
            n if common::is_postgres(n) => hold_until_killed!(sqlx::PgPool, &url, name, locker),
            #[cfg(feature = "mysql")]
            _ => hold_until_killed!(sqlx::MySqlPool, &url, name, locker),
            #[allow(unreachable_patterns)]
            _ => unreachable!(),
        },
        other => panic!("unknown role {other}"),
    }
}

/// Three processes, each alternating `lock_in` in a transaction and a lease on one key, bump a
/// counter kept in a file: no bump is lost, and the tokens logged while held strictly increase
/// in the order the holds happened, across both kinds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_in_and_leases_exclude_each_other_across_processes() {
    let (dbs, _dir) = common::all("lock_in_processes").await;
    for db in &dbs {
        let name = db.name;
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("counter"), "0\n").unwrap();
        std::fs::write(dir.path().join("tokens"), "").unwrap();
        let children: Vec<_> = (0..3)
            .map(|_| {
                common::child_command(db, "counter")
                    .env("DBLOCK_CHILD_DIR", dir.path())
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for mut c in children {
            let status = tokio::task::spawn_blocking(move || c.wait().unwrap())
                .await
                .unwrap();
            assert!(status.success(), "{name}: a child failed");
        }
        let n: u64 = std::fs::read_to_string(dir.path().join("counter"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert_eq!(n, 3 * ROUNDS, "{name}: bumps were lost");
        let tokens: Vec<u64> = std::fs::read_to_string(dir.path().join("tokens"))
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        assert_eq!(tokens.len() as u64, 3 * ROUNDS, "{name}");
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "{name}: tokens out of order: {tokens:?}"
        );
    }
}

/// A process that holds a key in an open transaction is killed (SIGKILL): the database ends its
/// transaction and the key is free at once, with no lease to wait out. The killed tenure rolled
/// back with its transaction, so the next holder's token may be the same number: it is larger
/// than every committed tenure's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_killed_mid_transaction_frees_the_key_at_once() {
    let (dbs, _dir) = common::all("lock_in_killed").await;
    for db in &dbs {
        let name = db.name;
        let mut child = common::child_command(db, "holder")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let token: u64 = common::read_marker(&mut child, "HELD ")
            .await
            .parse()
            .unwrap();
        lease_is_busy(name, &db.locker, "doomed", Duration::ZERO).await;
        let killed = Instant::now();
        child.kill().unwrap(); // SIGKILL: no rollback sent, no destructor
        child.wait().unwrap();
        let guard = db.locker.lock("doomed").wait(30 * SEC).await.unwrap();
        let took = killed.elapsed();
        println!("{name}: free {took:?} after the kill");
        assert!(guard.fencing_token() >= token, "{name}");
        assert!(took < 5 * SEC, "{name}: {took:?}");
        guard.release().await.unwrap();
    }
}
