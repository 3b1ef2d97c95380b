//! Proofs of holding (`dblock::Held`) at run time, on every backend: the proof's key and token
//! are the locked body's (`dblock::current()`), one proof stands for every key of a list, and a
//! fence through a proof refuses a write once the lease was taken over. The compile-time half
//! (what cannot be done with a proof) is in `tests/ui/*/proof*.rs`.

mod common;

use std::time::Duration;

use dblock::{distributed_lock, Held, LockError, Locker};

dblock::lock_kind!(
    /// The lock of one account.
    AccountLock
);

const STALE_TTL: Duration = Duration::from_millis(300);

/// Two calls down from the body, under the account's lock only.
async fn post(held: Held<'_, AccountLock>) -> (String, u64) {
    tokio::task::yield_now().await;
    keyed(held.untyped())
}

fn keyed(held: Held<'_>) -> (String, u64) {
    (held.key().to_owned(), held.fencing_token())
}

#[distributed_lock(key = "acct:{id}", locker = locker, proof = held: AccountLock)]
async fn deposit(locker: &Locker, id: u64) -> Result<(), LockError> {
    let current = dblock::current().expect("inside a locked body");
    assert_eq!(post(held).await, (current.key, current.fencing_token));
    assert_eq!(held.locks(), &dblock::current_all()[..]);
    Ok(())
}

#[distributed_lock(key = ["acct:{to}", "acct:{from}"], locker = locker, proof = held)]
async fn transfer(locker: &Locker, from: u64, to: u64) -> Result<Vec<u64>, LockError> {
    let all = dblock::current_all();
    assert_eq!(held.locks(), &all[..], "one proof for every key, in order");
    assert_eq!(held.key(), format!("acct:{}", from.min(to)));
    Ok(held.locks().iter().map(|l| l.fencing_token).collect())
}

#[distributed_lock(key = "report", locker = locker, shared = true, proof = held)]
async fn report(locker: &Locker) -> Result<u64, LockError> {
    assert_eq!(
        held.fencing_token(),
        dblock::current().unwrap().fencing_token
    );
    Ok(held.fencing_token())
}

/// A body stopped past its ttl (no renewal) whose key another owner took meanwhile: its write
/// fenced through the proof must not commit.
macro_rules! stale_body {
    ($name:ident, $pool:ty) => {
        #[distributed_lock(key = "stale", locker = locker, ttl = STALE_TTL, renew = false, proof = held)]
        async fn $name(locker: &Locker, pool: &$pool) -> Result<LockError, LockError> {
            tokio::time::sleep(STALE_TTL + Duration::from_millis(200)).await;
            let l = locker.clone();
            // Another task: another owner.
            let taker = tokio::spawn(async move { l.lock("stale").await })
                .await
                .unwrap()?;
            assert!(taker.fencing_token() > held.fencing_token());
            let mut tx = pool.begin().await.unwrap();
            let fenced = held.fence(&mut *tx).await;
            let _ = tx.rollback().await;
            // Through the guard's proof too.
            let fresh = taker.held();
            let mut tx = pool.begin().await.unwrap();
            fresh.fence(&mut *tx).await.expect("the new holder's fence");
            tx.commit().await.unwrap();
            taker.release().await?;
            Ok(fenced.expect_err("a stale proof fenced a write"))
        }
    };
}

#[cfg(feature = "sqlite")]
stale_body!(stale_sqlite, sqlx::SqlitePool);
#[cfg(feature = "postgres")]
stale_body!(stale_postgres, sqlx::PgPool);
#[cfg(feature = "mysql")]
stale_body!(stale_mysql, sqlx::MySqlPool);

async fn stale(db: &common::Db, l: &Locker) -> LockError {
    let outcome = match db.name {
        #[cfg(feature = "sqlite")]
        "sqlite" => {
            let pool = <sqlx::SqlitePool as common::TestPool>::open(&db.url).await;
            stale_sqlite(l, &pool).await
        }
        #[cfg(feature = "postgres")]
        name if common::is_postgres(name) => {
            let pool = <sqlx::PgPool as common::TestPool>::open(&db.url).await;
            stale_postgres(l, &pool).await
        }
        #[cfg(feature = "mysql")]
        _ => {
            let pool = <sqlx::MySqlPool as common::TestPool>::open(&db.url).await;
            stale_mysql(l, &pool).await
        }
        #[allow(unreachable_patterns)]
        other => panic!("no pool type for {other}"),
    };
    outcome.unwrap_or_else(|e| panic!("{}: {e}", db.name))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proof_is_the_bodys_lock_and_fences_nothing_stale() {
    let (dbs, _dir) = common::all("proof").await;
    for db in &dbs {
        let l = common::own_table(db, "proof").await;
        deposit(&l, 7).await.unwrap();
        let tokens = transfer(&l, 2, 1).await.unwrap();
        assert_eq!(tokens.len(), 2, "{}", db.name);
        report(&l).await.unwrap();

        let refused = stale(db, &l).await;
        assert!(
            matches!(&refused, LockError::Lost { key } if key == "stale"),
            "{}: {refused:?}",
            db.name
        );

        // A guard's proof is the guard's; a read guard's proof refuses to fence a write.
        let guard = l.lock("g").await.unwrap();
        assert_eq!(keyed(guard.held()), ("g".to_owned(), guard.fencing_token()));
        guard.release().await.unwrap();
        let reader = l.read("r").await.unwrap();
        assert_eq!(reader.held().fencing_token(), reader.fencing_token());
        #[cfg(feature = "sqlite")]
        {
            // Refused before any statement: any connection shows it.
            use sqlx::Connection;
            let mut conn = sqlx::SqliteConnection::connect("sqlite::memory:")
                .await
                .unwrap();
            let e = reader.held().fence(&mut conn).await.unwrap_err();
            assert!(matches!(e, LockError::Config(_)), "{}: {e:?}", db.name);
        }
        reader.release().await.unwrap();

        // A leadership's proof.
        let leadership = l.leader("lead").campaign().await.unwrap();
        assert_eq!(
            leadership.held().fencing_token(),
            leadership.fencing_token()
        );
        leadership.resign().await.unwrap();
    }
}
