//! The line of one process's waiters for one key: they get it in arrival order.
//!
//! Without it every waiter polls on its own, with a backoff that grows to its cap, and whoever
//! happens to ask first after a release wins — a waiter that arrived early can lose to newcomers
//! again and again (a user's trial saw a 3 s longest wait where first-come-first-served gives
//! 0.3 s). In a line, only the waiter at its head asks the database; the others wait on the
//! line, which tokio's mutex hands over in FIFO order, and nothing else: no herd of attempts. A
//! release of the key by this process wakes the head at once ([`Line::freed`]); a release by
//! another process wakes it through the backend (PostgreSQL NOTIFY) or its next poll.
//!
//! A caller joins after its first attempt found the key busy, or before its first attempt if
//! waiters of the process are already in line (a newcomer does not go ahead of them); a lone
//! caller, and a re-entry (the owner holds the key), never wait in a line. Across processes the
//! database decides who asks first unless the callers use `LockRequest::fair` (`fair.rs`), which
//! skip this line and keep to the order of their tickets in the database.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, Weak};

use tokio::sync::{Notify, OwnedMutexGuard};

use crate::sync::lock;

/// The waiters of one key (in one lock table of one database) in this process.
#[derive(Default)]
pub(crate) struct Line {
    /// Held by the waiter at the head; the others queue on it in arrival order.
    head: Arc<tokio::sync::Mutex<()>>,
    /// Notified when this process frees the key.
    freed: Notify,
}

/// The head of a line: the one waiter that asks the database.
pub(crate) type Turn = OwnedMutexGuard<()>;

impl Line {
    /// The head's place, at once if nobody is ahead.
    pub(crate) fn try_turn(&self) -> Option<Turn> {
        self.head.clone().try_lock_owned().ok()
    }

    /// The head's place, once every waiter that joined earlier has had its turn.
    pub(crate) async fn turn(&self) -> Turn {
        self.head.clone().lock_owned().await
    }

    /// Resolves when this process frees the key.
    pub(crate) async fn freed(&self) {
        self.freed.notified().await
    }
}

/// The lines by database and table, then by key; dead entries are pruned as the map grows.
/// Looked up by borrowed names: a release or a lone lock call that finds no line allocates
/// nothing.
#[derive(Default)]
struct Lines {
    map: Map<Arc<str>, Map<Box<str>, Weak<Line>>>,
    /// Entries over every space.
    len: usize,
    prune_at: usize,
}

type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

static LINES: LazyLock<Mutex<Lines>> = LazyLock::new(Mutex::default);

/// The line for `key` in `space` (joined by holding the returned `Arc`).
pub(crate) fn of(space: &Arc<str>, key: &str) -> Arc<Line> {
    let mut guard = lock(&LINES);
    let lines = &mut *guard;
    if lines.len > lines.prune_at.max(256) {
        for keys in lines.map.values_mut() {
            keys.retain(|_, line| line.strong_count() > 0);
        }
        lines.map.retain(|_, keys| !keys.is_empty());
        lines.len = lines.map.values().map(HashMap::len).sum();
        lines.prune_at = lines.len * 2;
    }
    let keys = match lines.map.get_mut(&**space) {
        Some(keys) => keys,
        None => lines.map.entry(space.clone()).or_default(),
    };
    if let Some(line) = keys.get(key).and_then(Weak::upgrade) {
        return line;
    }
    let line = Arc::new(Line::default());
    if keys.insert(key.into(), Arc::downgrade(&line)).is_none() {
        lines.len += 1;
    }
    line
}

/// The line for `key` in `space` if there is one, without making one.
fn existing(space: &str, key: &str) -> Option<Arc<Line>> {
    lock(&LINES)
        .map
        .get(space)?
        .get(key)
        .and_then(Weak::upgrade)
}

/// The line for `key` in `space` if waiters of this process are in it (someone is its head).
/// Makes no line: the uncontended path stays one map look-up.
pub(crate) fn waiting(space: &Arc<str>, key: &str) -> Option<Arc<Line>> {
    existing(space, key).filter(|l| l.head.try_lock().is_err())
}

/// This process freed `key` in `space`: the head of its line (if any) asks again at once.
pub(crate) fn freed(space: &Arc<str>, key: &str) {
    if let Some(line) = existing(space, key) {
        line.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Waiters get their turn in the order they joined; a free line is taken at once.
    #[tokio::test(start_paused = true)]
    async fn turns_come_in_arrival_order() {
        let space: Arc<str> = "db|t".into();
        let line = of(&space, "k");
        let first = line.try_turn().expect("nobody ahead");
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for i in 0..5 {
            let (line, order) = (of(&space, "k"), order.clone());
            waiters.push(tokio::spawn(async move {
                let turn = line.turn().await;
                lock(&order).push(i);
                tokio::time::sleep(Duration::from_millis(1)).await;
                drop(turn);
            }));
            tokio::time::sleep(Duration::from_millis(1)).await; // arrive one after another
        }
        assert!(line.try_turn().is_none(), "the head's place was free twice");
        drop(first);
        for w in waiters {
            w.await.unwrap();
        }
        assert_eq!(*lock(&order), vec![0, 1, 2, 3, 4]);
        // Another key, or another table, is another line.
        assert!(of(&space, "other").try_turn().is_some());
        assert!(of(&"db|u".into(), "k").try_turn().is_some());
    }
}
