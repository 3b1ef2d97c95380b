//! `ConnectOptions::auto_purge`: the old free rows of each table a locker locks in, deleted by a
//! task of its own (one per table and lifecycle, however many `table()` copies name it), until
//! the locker is shut down or dropped.

use super::*;
use crate::locker::Locker;

/// The longest time between two purges of one table, and the shortest (before jitter).
const MAX_EVERY: Duration = Duration::from_secs(3600);
const MIN_EVERY: Duration = Duration::from_secs(1);

/// How long a purge of rows older than `older_than` waits for the next, before jitter: a
/// quarter of the age, so a row is deleted at most about 1.25 × `older_than` after it was freed.
fn every(older_than: Duration) -> Duration {
    (older_than / 4).clamp(MIN_EVERY, MAX_EVERY)
}

impl Shared {
    /// Starts the background purge of this copy's table if the locker purges by itself and no
    /// task runs for the table yet (inside a tokio runtime only: every call that gets here
    /// runs in one). Called on a grant (a lock, read, permit or `lock_in`).
    pub(crate) fn purge_in_background(&self) {
        let Some(older_than) = self.auto_purge else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut purging = lock(&self.lifecycle.purging);
        // A task whose runtime went away is finished: the table gets a new one.
        if purging
            .get(self.table.as_str())
            .is_some_and(|task| !task.is_finished())
        {
            return;
        }
        tracing::debug!(table = %self.table, ?older_than, "auto purge: started");
        let task = runtime.spawn(purge_table(
            self.lifecycle.clone(),
            self.table.clone(),
            older_than,
        ));
        purging.insert(self.table.clone(), task.abort_handle());
    }
}

/// Purges `table` soon, then now and then, while the locker (or a copy of it) is in use and not
/// shut down.
async fn purge_table(lifecycle: Arc<Lifecycle>, table: String, older_than: Duration) {
    let mut failing = false;
    let mut pause = MIN_EVERY;
    loop {
        tokio::time::sleep(crate::timing::jittered(pause)).await;
        pause = every(older_than);
        // Decided under the map's lock: a grant that starts a purge meanwhile either finds this
        // task listed (and it goes on) or starts a task of its own.
        let copy = {
            let mut purging = lock(&lifecycle.purging);
            let copy = lifecycle
                .purging_copy(&table)
                .filter(|_| !lifecycle.closed.load(Ordering::SeqCst));
            match copy {
                Some(copy) => copy,
                None => {
                    purging.remove(&table);
                    tracing::debug!(table = %table, "auto purge: stopped");
                    return;
                }
            }
        };
        let copy = if copy.table == table {
            copy
        } else {
            copy.with_table(&table)
        };
        match Locker::from_shared(copy).purge_rows(older_than).await {
            Ok(deleted) => {
                failing = false;
                tracing::debug!(table = %table, deleted, "auto purge");
            }
            // Nothing to purge in a table that is not there (yet).
            Err(e) if e.is_not_migrated() => {}
            // Shut down meanwhile: the next turn ends the task.
            Err(LockError::ShutDown) => {}
            Err(e) => {
                if !failing {
                    tracing::warn!(table = %table, error = %e, "auto purge failed; trying again later");
                }
                failing = true;
            }
        }
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;

    #[test]
    fn a_purge_waits_a_quarter_of_its_age_within_bounds() {
        assert_eq!(every(Duration::from_secs(24 * 3600)), MAX_EVERY);
        assert_eq!(every(Duration::from_secs(60)), Duration::from_secs(15));
        assert_eq!(every(Duration::ZERO), MIN_EVERY);
        assert_eq!(every(Duration::MAX), MAX_EVERY);
    }

    /// One task a table, however many copies lock in it (and their semaphores: the permits'
    /// table is purged with it); none for a table nothing locks in; the task goes on while any
    /// copy of the locker is in use and ends when none is left.
    #[tokio::test]
    async fn one_purge_task_a_table_while_the_locker_is_in_use() {
        let options = crate::ConnectOptions::new().auto_purge(Duration::ZERO);
        let locker = Locker::connect_with("sqlite::memory:", options)
            .await
            .unwrap();
        locker.table("jobs").migrate().await.unwrap();
        locker.table("other").migrate().await.unwrap();
        for _ in 0..20 {
            let copy = locker.table("jobs");
            copy.lock("k").await.unwrap().release().await.unwrap();
            copy.semaphore("s", 2)
                .await
                .unwrap()
                .release()
                .await
                .unwrap();
        }
        let lifecycle = locker.shared().lifecycle.clone();
        let tables = |l: &Lifecycle| {
            let mut t: Vec<String> = lock(&l.purging).keys().cloned().collect();
            t.sort();
            t
        };
        assert_eq!(tables(&lifecycle), ["jobs"]);
        // No copy on "jobs" is left, the locker is: its rows are still purged.
        let row = |l: &Locker| {
            let jobs = l.table("jobs");
            async move { jobs.inspect("k").await.unwrap() }
        };
        let start = Instant::now();
        while row(&locker).await.is_some() {
            assert!(start.elapsed() < Duration::from_secs(30), "not purged");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(tables(&lifecycle), ["jobs"]);
        drop(locker);
        // The next turn (within a second) finds no copy of the locker left: the task ends.
        let start = Instant::now();
        while !tables(&lifecycle).is_empty() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the task goes on"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
