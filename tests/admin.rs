//! The operator API against real tables: permits of semaphores in `held`/`permits`, the
//! migration status, and the fair queue's waiters. (The `dblock` command-line tool built on it
//! has its own tests in `dblock-cli/tests/`.)

mod common;

use std::time::Duration;

/// A semaphore in the operator's view: each permit a row of kind `Permit`, listed by `held` and
/// `permits`; `force_release` frees them all, `purge` deletes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphores_show_their_permits_in_use() {
    let (dbs, _dir) = common::all("admin_semaphore").await;
    for db in dbs.iter().filter(|d| d.name != "mysql8-path") {
        let a = db
            .locker
            .semaphore("exports", 3)
            .holder("export-a")
            .await
            .unwrap();
        let b = db
            .locker
            .semaphore("exports", 3)
            .holder("export-b")
            .await
            .unwrap();
        let in_use = db.locker.permits("exports").await.unwrap();
        assert_eq!(in_use.len(), 2, "{}", db.name);
        assert!(in_use
            .iter()
            .all(|p| p.key == "exports"
                && matches!(p.kind, dblock::LockKind::Permit { permits: 3, .. })));
        assert_eq!(
            db.locker.held().await.unwrap().len(),
            2,
            "{}: held() lists the permits",
            db.name
        );

        assert!(db.locker.force_release("exports").await.unwrap());
        assert!(
            db.locker.permits("exports").await.unwrap().is_empty(),
            "{}",
            db.name
        );
        assert!(
            a.release().await.is_err(),
            "{}: a released permit still held",
            db.name
        );
        assert!(b.release().await.is_err(), "{}", db.name);
        assert!(!db.locker.force_release("exports").await.unwrap());
        assert_eq!(db.locker.purge(Duration::ZERO).await.unwrap(), 2);
    }
}

/// `migration_status` reports every migration pending on a table that is not there, and
/// applied once `migrate` ran; a table made with the first migration only (a team that applied
/// `0001_dblock_locks.sql` with its own tool) has exactly that one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_status_follows_the_schema() {
    let (dbs, _dir) = common::all("admin_migrations").await;
    for db in dbs.iter().filter(|d| d.name != "mysql8-path") {
        let status = db.locker.migration_status().await.unwrap();
        let versions: Vec<u32> = status.iter().map(|m| m.version).collect();
        assert_eq!(versions, [1, 2, 3, 4, 5, 6, 7], "{}", db.name);
        assert_eq!(
            status.iter().map(|m| m.name).collect::<Vec<_>>(),
            [
                "dblock_locks",
                "outcomes",
                "exactly_once",
                "fair_queue",
                "permits",
                "shared",
                "renewals"
            ]
        );
        assert!(status.iter().all(|m| m.applied), "{}: {status:?}", db.name);

        let fresh = db.locker.table(&common::table_for("admin_fresh"));
        let status = fresh.migration_status().await.unwrap();
        assert!(status.iter().all(|m| !m.applied), "{}: {status:?}", db.name);

        let old = common::table_for("admin_0001");
        common::create_with_0001(db, &old).await;
        let status = db.locker.table(&old).migration_status().await.unwrap();
        let applied: Vec<bool> = status.iter().map(|m| m.applied).collect();
        assert_eq!(
            applied,
            [true, false, false, false, false, false, false],
            "{}",
            db.name
        );

        fresh.migrate().await.unwrap();
        db.locker.table(&old).migrate().await.unwrap();
        for locker in [&fresh, &db.locker.table(&old)] {
            let status = locker.migration_status().await.unwrap();
            assert!(status.iter().all(|m| m.applied), "{}: {status:?}", db.name);
        }
    }
}

/// `waiters` lists the fair waiters of a key in ticket order, with their owners and live ticket
/// leases, filtered by prefix; a waiter that got the key has left the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_the_fair_queue() {
    let (dbs, _dir) = common::all("admin_waiters").await;
    for db in dbs.iter().filter(|d| d.name != "mysql8-path") {
        assert!(db.locker.waiters("").await.unwrap().is_empty());
        let held = db.locker.lock("queue:k").await.unwrap();
        let mut tasks = Vec::new();
        let mut owners = Vec::new();
        for _ in 0..2 {
            let owner = dblock::Owner::new();
            owners.push(owner.id().to_owned());
            let locker = db.locker.clone();
            tasks.push(tokio::spawn(async move {
                let g = locker
                    .lock("queue:k")
                    .owner(&owner)
                    .fair()
                    .wait(Duration::from_secs(60))
                    .await
                    .unwrap();
                g.release().await.unwrap();
            }));
            // One after the other: the second takes its ticket after the first.
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while db.locker.waiters("queue:").await.unwrap().len() < owners.len() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{}: waiter never queued",
                    db.name
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let waiters = db.locker.waiters("queue:").await.unwrap();
        assert_eq!(
            waiters.iter().map(|w| w.owner.clone()).collect::<Vec<_>>(),
            owners,
            "{}",
            db.name
        );
        assert!(waiters[0].ticket < waiters[1].ticket, "{}", db.name);
        for w in &waiters {
            assert_eq!(w.key, "queue:k");
            assert!(w.time_left > Duration::ZERO, "{}: {w:?}", db.name);
            assert!(w.expires_at > std::time::SystemTime::UNIX_EPOCH);
        }
        assert!(db.locker.waiters("other:").await.unwrap().is_empty());

        held.release().await.unwrap();
        for t in tasks {
            t.await.unwrap();
        }
        assert!(
            db.locker.waiters("").await.unwrap().is_empty(),
            "{}",
            db.name
        );
    }
}

/// The admin view counts each tenure's lease extensions (`LockInfo::renewals`, migration 0007):
/// every `extend` and every background renewal (the batched statement) adds one; a release
/// keeps the last tenure's count in the row; a new tenure starts again at 0 and its first
/// renewal counts 1, not one more than the tenure before. Permits count theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_view_counts_renewals() {
    const TTL: Duration = Duration::from_millis(900);
    const EXTENDS: u32 = 20;
    let (dbs, _dir) = common::all("admin_renewals").await;
    for db in &dbs {
        let name = db.name;
        let l = &db.locker;
        let renewals = |key: &'static str| async move {
            l.inspect(key).await.unwrap().expect("the row").renewals
        };

        let first = l.lock("renewed").ttl(TTL).await.unwrap();
        assert_eq!(renewals("renewed").await, 0, "{name}: a new tenure");
        for n in 1..=EXTENDS {
            first.extend(TTL).await.unwrap();
            assert_eq!(renewals("renewed").await, n, "{name}: extend {n}");
        }
        first.release().await.unwrap();
        let after = l.inspect("renewed").await.unwrap().unwrap();
        assert!(!after.held, "{name}");
        assert_eq!(
            after.renewals, EXTENDS,
            "{name}: the last tenure's count stays"
        );

        // A new tenure, renewed in the background every ttl/3.
        let second = l.lock("renewed").ttl(TTL).await.unwrap().auto_renew();
        assert_eq!(
            renewals("renewed").await,
            0,
            "{name}: the new tenure starts at 0"
        );
        let seen = first_nonzero(|| renewals("renewed")).await;
        // Carried on from the last tenure it would be above EXTENDS; from 1, it is below unless
        // the polls missed many renewals in a row.
        assert!(
            seen < EXTENDS,
            "{name}: the new tenure's first renewals counted {seen}: carried on from the last"
        );
        tokio::time::sleep(TTL * 2).await;
        let info = l.inspect("renewed").await.unwrap().unwrap();
        assert!(
            info.held && info.fencing_token == second.fencing_token() && info.renewals > seen,
            "{name}: renewal goes on counting: {info:?}, first seen {seen}"
        );
        second.release().await.unwrap();

        if name != "mysql8-path" {
            let permit = l
                .semaphore("renewed-sem", 2)
                .ttl(TTL)
                .await
                .unwrap()
                .auto_renew();
            let counted =
                first_nonzero(|| async { l.permits("renewed-sem").await.unwrap()[0].renewals })
                    .await;
            assert!(counted >= 1, "{name}");
            permit.release().await.unwrap();
        }
    }
}

/// Polls `read` every 20 ms for up to 10 s until it is not 0.
async fn first_nonzero<F, Fut>(read: F) -> u32
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = u32>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let n = read().await;
        if n > 0 {
            return n;
        }
        assert!(tokio::time::Instant::now() < deadline, "never renewed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `force_release_if_owner` frees what that owner holds and nothing else: its lock (not a lock
/// another owner took over since), its permits of a semaphore (not another owner's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_release_if_owner_frees_only_that_owners_holds() {
    use dblock::{LockError, Owner};
    let (dbs, _dir) = common::all("admin_if_owner").await;
    for db in &dbs {
        let (l, name) = (&db.locker, db.name);
        let (a, b) = (Owner::new(), Owner::new());
        let held = l.lock("k").owner(&a).await.unwrap();
        assert!(
            !l.force_release_if_owner("k", b.id()).await.unwrap(),
            "{name}"
        );
        assert!(l.inspect("k").await.unwrap().unwrap().held, "{name}");
        assert!(
            l.force_release_if_owner("k", a.id()).await.unwrap(),
            "{name}"
        );
        assert!(!l.inspect("k").await.unwrap().unwrap().held, "{name}");
        assert!(held.release().await.is_err(), "{name}: released twice");
        // Taken over since it was listed: left alone.
        let taken = l.lock("k").owner(&b).await.unwrap();
        assert!(
            !l.force_release_if_owner("k", a.id()).await.unwrap(),
            "{name}"
        );
        taken.release().await.unwrap();

        let pa = l.semaphore("s", 2).owner(&a).await.unwrap();
        let pb = l.semaphore("s", 2).owner(&b).await.unwrap();
        assert!(
            l.force_release_if_owner("s", a.id()).await.unwrap(),
            "{name}"
        );
        let live = l.permits("s").await.unwrap();
        assert_eq!(live.len(), 1, "{name}: {live:?}");
        assert_eq!(live[0].owner.as_deref(), Some(b.id()), "{name}");
        assert!(pa.release().await.is_err(), "{name}");
        pb.release().await.unwrap();

        assert!(matches!(
            l.force_release_if_owner("s", "").await,
            Err(LockError::Config(_))
        ));
    }
}

/// `ConnectOptions::auto_purge`: a locker deletes its own table's old free rows (locks and
/// semaphore permits) by itself, and keeps what `purge` keeps: a held key, a `once` key whose
/// work succeeded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_purge_deletes_old_free_rows_by_itself() {
    let (dbs, _dir) = common::all("auto_purge").await;
    for db in &dbs {
        let table = common::table_for("auto_purge");
        db.locker.table(&table).migrate().await.unwrap();
        let options = common::options_for(db.name).auto_purge(Duration::from_millis(100));
        let connected = dblock::Locker::connect_with(&db.url, options)
            .await
            .unwrap();
        let locker = common::as_named(db.name, connected);
        // A copy made for one call and dropped, as `locker.table(t).lock(k)` in a handler: the
        // purge goes on while the locker is in use.
        let once = locker.table(&table);
        once.lock("gone").await.unwrap().release().await.unwrap();
        let permit = once.semaphore("pool", 2).await.unwrap();
        permit.release().await.unwrap();
        drop(once);
        let l = locker.table(&table);
        l.lock("done")
            .once()
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        let held = l.lock("held").ttl(Duration::from_secs(120)).await.unwrap();

        let permit_rows = format!("SELECT COUNT(*) FROM {table}_permits");
        let url = common::direct_url(db);
        let start = std::time::Instant::now();
        while l.inspect("gone").await.unwrap().is_some()
            || common::run_sql(db.name, &url, &permit_rows).await > 0
        {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{}: old free rows still there",
                db.name
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(l.inspect("held").await.unwrap().is_some(), "{}", db.name);
        assert!(
            l.inspect("done").await.unwrap().is_some(),
            "{}: a succeeded once key was purged",
            db.name
        );
        held.release().await.unwrap();
        l.shutdown().await;
    }
}
