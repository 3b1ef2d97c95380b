//! The process-wide registry of one owner's keys: the serialisation that makes resends exact
//! (no two statements of one owner on one key interleave, whichever `Locker` sends them), and
//! what the process holds of each key, from which re-entry counts.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Arc, LazyLock, Mutex};

use tokio::sync::OwnedMutexGuard;

use crate::backend::{Acquire, Attempt};
use crate::owner::Owner;
use crate::sync::lock;

/// One owner's statements on one key, serialised, with what the process holds of it.
pub(crate) type Serial = OwnedMutexGuard<Tracked>;

/// What this process holds of one owner's key: the tenure (its fencing token) and how many
/// holds of it. Re-entry counts from here, never from the row alone, so a hold the process
/// lost track of (an acquire whose reply never came) is never built upon.
#[derive(Default, Debug)]
pub(crate) struct Tracked {
    pub(crate) tenure: Option<u64>,
    pub(crate) holds: u32,
}

impl Tracked {
    /// Whether the process holds the key as this owner (a call now would be a re-entry).
    pub(crate) fn holds(&self) -> bool {
        self.tenure.is_some() && self.holds > 0
    }

    /// The statement counts re-entry from what the process holds.
    pub(crate) fn fill(&self, a: &mut Acquire<'_>) {
        a.held = self.holds;
        a.tenure = self.tenure.map(|t| t as i64);
    }

    /// What the process holds after `attempt`.
    pub(crate) fn note(&mut self, attempt: &Attempt) {
        if let Attempt::Acquired(grant) = attempt {
            // A new tenure replaces whatever this process tracked of the old one (stale).
            self.tenure = Some(grant.fencing_token);
            self.holds = grant.hold_count;
        }
    }
}

/// One owner's key in one lock table, as the process-wide registry keeps it: the serialisation
/// of the owner's statements on the key, and what the process holds of it.
struct Entry {
    space: Arc<str>,
    owner: Arc<str>,
    key: Box<str>,
    tracked: Arc<tokio::sync::Mutex<Tracked>>,
}

/// The registry: hash(space, owner, key) → entries (a bucket, so a hash collision can never mix
/// two owners' counts). Process-wide: every `Locker` of a table (also `locker.table(..)` copies
/// and separately connected ones) goes through it, since an owner's holds may be reached through
/// any of them. The space (database and table) is part of the key: one owner holding the same
/// key name in two tables holds two locks, and counts of one must never leak into the other.
#[derive(Default)]
struct Registry {
    /// Hashes (space, owner, key), seeded once per process.
    hasher: foldhash::fast::RandomState,
    buckets: HashMap<u64, Vec<Entry>, foldhash::fast::RandomState>,
    entries: usize,
    /// Prune when the registry has grown to twice its size after the last pruning.
    prune_at: usize,
}

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(Mutex::default);

impl Registry {
    fn entry(
        &mut self,
        space: &Arc<str>,
        owner: &Owner,
        key: &str,
    ) -> Arc<tokio::sync::Mutex<Tracked>> {
        if self.entries > self.prune_at.max(1024) {
            self.prune();
        }
        let bucket = self
            .buckets
            .entry(self.hasher.hash_one((&**space, owner.id(), key)))
            .or_default();
        if let Some(e) = bucket
            .iter()
            .find(|e| e.space == *space && &*e.owner == owner.id() && &*e.key == key)
        {
            return e.tracked.clone();
        }
        let tracked = Arc::new(tokio::sync::Mutex::new(Tracked::default()));
        bucket.push(Entry {
            space: space.clone(),
            owner: owner.shared_id(),
            key: key.into(),
            tracked: tracked.clone(),
        });
        self.entries += 1;
        tracked
    }

    /// Drops the entries nobody uses and that track no hold.
    fn prune(&mut self) {
        for bucket in self.buckets.values_mut() {
            bucket.retain(|e| {
                Arc::strong_count(&e.tracked) > 1
                    || e.tracked.try_lock().map_or(true, |t| t.tenure.is_some())
            });
        }
        self.buckets.retain(|_, b| !b.is_empty());
        self.entries = self.buckets.values().map(Vec::len).sum();
        self.prune_at = self.entries * 2;
    }
}

/// Serialises one owner's acquire and release statements on one key of one lock table (in this
/// process, which is where all of an owner's holds live), and hands over what the process holds
/// of it. While an operation retries after a lost reply, no other operation of the same owner on
/// the key can change the row, so the repeat's "did my earlier attempt commit?" check (attempt /
/// release id in the row) is exact.
pub(crate) async fn serialise(space: &Arc<str>, owner: &Owner, key: &str) -> Serial {
    let tracked = lock(&REGISTRY).entry(space, owner, key);
    tracked.lock_owned().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The serialisation is per (table, owner, key) for the whole process, not per `Locker`
    /// value; the same key name in another table (or database) is another lock.
    #[tokio::test(start_paused = true)]
    async fn one_owners_statements_on_a_key_never_interleave_process_wide() {
        let (a, b) = (Owner::new(), Owner::new());
        let space: Arc<str> = "sqlite:///tmp/x.db|dblock_locks".into();
        let mut first = serialise(&space, &a, "k").await;
        (first.tenure, first.holds) = (Some(7), 2);
        // The same table, owner and key, whichever locker asks: waits.
        let (a2, space2) = (a.clone(), space.clone());
        let same = tokio::spawn(async move { serialise(&space2, &a2, "k").await.holds });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !same.is_finished(),
            "a second statement of the same owner on the key ran"
        );
        // Another owner, another key, or another table: does not wait, and tracks its own.
        let other_table: Arc<str> = "sqlite:///tmp/x.db|other".into();
        for (space, owner, key) in [
            (&space, &b, "k"),
            (&space, &a, "other"),
            (&other_table, &a, "k"),
        ] {
            let serial =
                tokio::time::timeout(Duration::from_millis(10), serialise(space, owner, key))
                    .await
                    .expect("an unrelated statement waited");
            assert_eq!(serial.holds, 0, "counts leaked between locks");
        }
        drop(first);
        tokio::time::timeout(Duration::from_millis(10), same)
            .await
            .expect("released")
            .unwrap();
    }
}
