//! `ConnectOptions::auto_purge`: the old free rows of each table a locker locks in, deleted by a
//! task of its own (one per table and lifecycle, however many `table()` copies name it), until
//! the locker is shut down or dropped.

use super::*;
use crate::locker::Locker;

/// The shortest and longest time between two purges of one table.
const MIN_EVERY: Duration = Duration::from_secs(1);
const MAX_EVERY: Duration = Duration::from_secs(3600);

/// How long a purge of rows older than `older_than` waits for the next: a quarter of the age,
/// so a row is deleted at most about 1.25 × `older_than` after it was freed.
fn every(older_than: Duration) -> Duration {
    (older_than / 4).clamp(MIN_EVERY, MAX_EVERY)
}

impl Shared {
    /// Starts the background purge of this copy's table, if the locker purges by itself and
    /// none runs for the table yet (inside a tokio runtime only: every call that gets here
    /// runs in one).
    pub(super) fn purge_in_background(&self) {
        let Some(older_than) = self.auto_purge else {
            return;
        };
        if self.purge_started.load(Ordering::Relaxed)
            || tokio::runtime::Handle::try_current().is_err()
        {
            return;
        }
        // The task runs while a copy on the table lives, this one included.
        self.purge_started.store(true, Ordering::Relaxed);
        if !lock(&self.lifecycle.purging).insert(self.table.clone()) {
            return;
        }
        tracing::debug!(table = %self.table, ?older_than, "auto purge: started");
        tokio::spawn(purge_table(
            self.lifecycle.clone(),
            self.table.clone(),
            older_than,
        ));
    }
}

/// Purges `table` now and then while a copy on it is alive and the locker is not shut down.
async fn purge_table(lifecycle: Arc<Lifecycle>, table: String, older_than: Duration) {
    let mut failing = false;
    loop {
        tokio::time::sleep(crate::timing::jittered(every(older_than))).await;
        // Decided under the set's lock: a copy that starts purging meanwhile either finds the
        // table still listed (and this task goes on for it) or starts a task of its own.
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
        match Locker::from_shared(copy).purge(older_than).await {
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

    /// One task a table, however many copies lock in it; none for a table nothing locks in,
    /// nor for the permits' table (its locker's purge covers it); the task ends with the
    /// locker.
    #[tokio::test]
    async fn one_purge_task_a_table_ending_with_the_locker() {
        let options = crate::ConnectOptions::new().auto_purge(Duration::ZERO);
        let locker = Locker::connect_with("sqlite::memory:", options)
            .await
            .unwrap();
        locker.table("jobs").migrate().await.unwrap();
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
            let mut t: Vec<String> = lock(&l.purging).iter().cloned().collect();
            t.sort();
            t
        };
        assert_eq!(tables(&lifecycle), ["jobs"]);
        drop(locker);
        // The next turn (within a second) finds no copy on the table left: the task ends.
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
