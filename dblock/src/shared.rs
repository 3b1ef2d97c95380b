//! The private core a [`Locker`](crate::Locker) shares with its guards and its renewal task: the
//! backend, the renewal set, the holder label, and the owner-checked operations (acquire
//! statement, release, extend) run under the retry policy and the per-(owner, key)
//! serialisation that makes those retries exact.

use std::collections::HashMap;
use std::future::Future;
use std::hash::BuildHasher;
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::Duration;

use tokio::sync::OwnedMutexGuard;
use tokio::time::Instant;

use crate::backend::{Acquire, Attempt, Backend, Released};
use crate::error::LockError;
use crate::hold::Hold;
use crate::renew::Renewer;
use crate::retry::{self, Policy, Tried};
use crate::validate;

pub(crate) struct Shared {
    /// `Err` when `table()` was given a bad name: every call then reports it.
    backend: Result<Backend, String>,
    /// The leases this locker keeps alive, and its one renewal task.
    pub(crate) renewer: Arc<Renewer>,
    pub(crate) table: String,
    /// `host/pid`: the start of every `holder` value this locker writes.
    pub(crate) holder: String,
}

impl Shared {
    pub(crate) fn new(backend: Result<Backend, String>, table: &str, holder: String) -> Arc<Self> {
        Arc::new(Shared {
            backend,
            renewer: Arc::default(),
            table: table.to_owned(),
            holder,
        })
    }

    /// The same database and holder, another table (checked here: a bad name makes every call
    /// on the result fail with `Config`).
    pub(crate) fn with_table(&self, name: &str) -> Arc<Self> {
        let backend = validate::table(name).and_then(|()| match &self.backend {
            Ok(b) => Ok(b.with_table(name)),
            Err(e) => Err(e.clone()),
        });
        Shared::new(backend, name, self.holder.clone())
    }

    pub(crate) fn backend(&self) -> Result<&Backend, LockError> {
        self.backend
            .as_ref()
            .map_err(|e| LockError::Config(e.clone()))
    }

    pub(crate) fn backend_name(&self) -> &'static str {
        self.backend.as_ref().map_or("invalid", Backend::name)
    }

    /// The holder label for a lock taken with `label` (`host/pid/label`).
    pub(crate) fn holder_for(&self, label: Option<&str>) -> String {
        match label {
            Some(label) => validate::holder(format!("{}/{label}", self.holder)),
            None => self.holder.clone(),
        }
    }

    /// Runs `op` (a statement whose repeat is recognised or harmless) under the retry policy,
    /// classing failures by this backend's error codes.
    pub(crate) async fn retrying<T, Op, Fut>(backend: &Backend, op: Op) -> Tried<T>
    where
        Op: FnMut() -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        retry::run(Policy::STATEMENT, |e| backend.classify(e), op).await
    }

    /// Sends one acquire statement, again after rollbacks and unknown outcomes with the same
    /// attempt id (so an earlier, unacknowledged success is recognised, not counted twice),
    /// serialised with the owner's other statements on the key.
    pub(crate) async fn acquire(&self, a: &Acquire<'_>) -> Result<Attempt, LockError> {
        let backend = self.backend()?;
        let _serial = serialise(a.owner, a.key).await;
        Self::retrying(backend, || backend.acquire(a))
            .await
            .result
            .map_err(LockError::from)
    }

    /// Gives one hold back, recording a fresh release id in the row: a resend after a lost reply
    /// then matches nothing instead of decrementing twice. The owner's statements on this key
    /// are serialised meanwhile, so no re-entry of the same owner can slip in between.
    pub(crate) async fn release(&self, hold: &Hold) -> Result<Released, LockError> {
        let backend = self.backend()?;
        let _serial = serialise(hold.owner.id(), &hold.key).await;
        let release_id = fastrand::i64(1..i64::MAX);
        let held = hold.as_ref();
        let tried = Self::retrying(backend, || backend.release(&held, release_id)).await;
        match tried.result? {
            Released::NotHeld if tried.after_unknown => {
                tracing::debug!(key = %hold.key, "release after a lost reply: earlier attempt took effect");
                Ok(Released::StillHeld(hold.hold_count.saturating_sub(1)))
            }
            outcome => Ok(outcome),
        }
    }

    /// Makes the lease end no earlier than `ttl` from now (database clock); `NotHeld` when it
    /// is no longer this tenure's. An extension only moves the end, so any resend is harmless.
    pub(crate) async fn extend(&self, hold: &Hold, ttl: Duration) -> Result<(), LockError> {
        let ttl_us = validate::ttl_micros(ttl)?;
        let backend = self.backend()?;
        let sent = Instant::now();
        let held = hold.as_ref();
        let tried = Self::retrying(backend, || backend.extend(&held, ttl_us)).await;
        match tried.result? {
            Some(expires_at_us) => {
                hold.extended(sent, ttl, Some(expires_at_us));
                tracing::trace!(key = %hold.key, "lease extended");
                Ok(())
            }
            None => {
                tracing::debug!(key = %hold.key, "extend refused: lease no longer ours");
                Err(LockError::NotHeld {
                    key: hold.key.clone(),
                })
            }
        }
    }
}

/// hash(owner, key) → the async mutex serialising that owner's statements on that key, for the
/// whole process: every `Locker` (also `locker.table(..)` copies and separately connected ones)
/// goes through the same map, since an owner's holds may be reached through any of them. A hash
/// collision only serialises two unrelated pairs, which is harmless.
static SERIAL: LazyLock<Mutex<HashMap<u64, Weak<tokio::sync::Mutex<()>>>>> =
    LazyLock::new(Mutex::default);

/// Fixed keys, so every call hashes alike (the map is in-process only).
static SERIAL_HASHER: std::hash::BuildHasherDefault<std::collections::hash_map::DefaultHasher> =
    std::hash::BuildHasherDefault::new();

/// Serialises one owner's acquire and release statements on one key (in this process, which is
/// where all of an owner's holds live). While an operation retries after a lost reply, no other
/// operation of the same owner on the key can change the row, so the repeat's "did my earlier
/// attempt commit?" check (attempt / release id in the row) is exact.
pub(crate) async fn serialise(owner: &str, key: &str) -> OwnedMutexGuard<()> {
    let mutex = {
        let mut map = SERIAL
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if map.len() > 1024 {
            map.retain(|_, m| m.strong_count() > 0);
        }
        let hash = SERIAL_HASHER.hash_one((owner, key));
        match map.get(&hash).and_then(Weak::upgrade) {
            Some(m) => m,
            None => {
                let m = Arc::new(tokio::sync::Mutex::new(()));
                map.insert(hash, Arc::downgrade(&m));
                m
            }
        }
    };
    mutex.lock_owned().await
}

/// `host/pid`, for the `holder` column.
pub(crate) fn default_holder() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".into());
    validate::holder(format!("{host}/{}", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The serialisation is per (owner, key) for the whole process, not per `Locker` value.
    #[tokio::test(start_paused = true)]
    async fn one_owners_statements_on_a_key_never_interleave_process_wide() {
        let first = serialise("owner-a", "k").await;
        // The same owner and key, whichever locker asks: waits.
        let same = tokio::spawn(async { serialise("owner-a", "k").await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !same.is_finished(),
            "a second statement of the same owner on the key ran"
        );
        // Another owner, or another key: does not wait.
        drop(
            tokio::time::timeout(Duration::from_millis(10), serialise("owner-b", "k"))
                .await
                .expect("another owner waited"),
        );
        drop(
            tokio::time::timeout(Duration::from_millis(10), serialise("owner-a", "other"))
                .await
                .expect("another key waited"),
        );
        drop(first);
        tokio::time::timeout(Duration::from_millis(10), same)
            .await
            .expect("released")
            .unwrap();
    }
}
