//! [`LockAllRequest`]: several keys at once, all or nothing, in one canonical order.
//!
//! The keys are sorted by their bytes and deduplicated, and taken as one owner: first all in one
//! statement (`request::try_all`), then whatever is left one after the other. Two calls naming
//! the same keys in any order take them in the same order, so they cannot deadlock: whoever has
//! the first key is the only one that can be waiting for the second (the one-statement attempt
//! keeps only keys in order and waits for nothing). If a key cannot be had within `wait` (or the
//! call fails, or is dropped), the keys already taken are given back at once, recording nothing
//! about them: a partial acquisition never stays behind.

use std::sync::Arc;

use tokio::time::Instant;
use tracing::Instrument;

use crate::error::LockError;
use crate::guard::LockGuard;
use crate::meter;
use crate::options::{LockOptions, Options};
use crate::owner::Owner;
use crate::request::{self, AllTry, LockRequest};
use crate::shared::Shared;
use crate::validate;

/// This kind's entry point.
impl crate::Locker {
    /// Starts a request for several keys at once, all or nothing: they are taken in one
    /// canonical order (sorted bytes, duplicates merged) as one owner, so two calls naming the
    /// same keys in any order cannot deadlock; `wait` bounds the whole set; whatever was taken
    /// when one key cannot be had is given back at once. Keys are anything `AsRef<str>`: an
    /// array or slice of `&str`, a `Vec<String>`. See [`LockAllRequest`].
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guards = locker.lock_all(["acct:2", "acct:1"]).wait(std::time::Duration::from_secs(5)).await?;
    /// assert_eq!(guards.len(), 2);
    /// # Ok(()) }
    /// ```
    pub fn lock_all<I>(&self, keys: I) -> LockAllRequest
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        LockAllRequest::new(
            self.shared().clone(),
            keys.into_iter().map(|k| k.as_ref().to_owned()).collect(),
        )
    }
}

/// Most keys one [`Locker::lock_all`](crate::Locker::lock_all) call takes: every key goes in
/// one statement, and the backends' limits on a statement's parameters (SQLite 32,766, MySQL
/// and MariaDB 65,535) are well above what 1,000 keys need. More is refused up front with
/// [`LockError::Config`].
pub const MAX_LOCK_ALL_KEYS: usize = 1_000;

/// One `locker.lock_all(keys)` call being configured; `.await` it to take every key, or none.
///
/// The first attempt takes every key in one statement where the dialect has one (PostgreSQL,
/// MariaDB, SQLite; not the MySQL 8 path, nor `reentrant(false)` when the owner holds one of
/// the keys): n free keys cost one round trip, and a set with a busy key writes nothing. What
/// is left is then waited for one key at a time, in the canonical
/// order, with what is left of the wait. The guards come back in that order, all as one owner;
/// release them in any order (or drop them).
///
/// ```
/// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
/// use std::time::Duration;
/// // Either order names the same locks, taken in one order: no deadlock between transfers.
/// let guards = locker
///     .lock_all(["acct:9", "acct:2"])
///     .ttl(Duration::from_secs(10))
///     .wait(Duration::from_secs(5))
///     .await?;
/// assert_eq!(guards[0].key(), "acct:2"); // canonical order: sorted bytes
/// for g in guards {
///     g.release().await?;
/// }
/// # Ok(()) }
/// ```
#[must_use = "a lock request does nothing until it is awaited"]
pub struct LockAllRequest {
    shared: Arc<Shared>,
    keys: Vec<String>,
    options: Options,
    lock: LockOptions,
}

impl LockAllRequest {
    pub(crate) fn new(shared: Arc<Shared>, keys: Vec<String>) -> Self {
        LockAllRequest {
            shared,
            keys,
            options: Options::default(),
            lock: LockOptions::default(),
        }
    }
}

crate::options::setters!(LockAllRequest, "locker.lock_all([\"a\", \"b\"])": ttl, wait, owner, holder, metrics_key, max_hold, lock_delay, min_hold, once, fair, reentrant);

crate::options::into_future!(LockAllRequest => Vec<LockGuard>, #[doc = "The guards, in canonical key order."]);

impl LockAllRequest {
    async fn call(mut self, owner: Owner) -> Result<Vec<LockGuard>, LockError> {
        self.keys.sort();
        self.keys.dedup();
        // The span is named after the call: several keys are a `dblock.lock_all`; one key
        // (a one-key attribute, which comes through here too) is that key's request, whose
        // own `dblock.lock` span (key, backend, owner, ttl_ms, wait_ms) is the call's.
        let span = if self.keys.len() == 1 {
            tracing::Span::none()
        } else {
            tracing::debug_span!(
                "dblock.lock_all",
                keys = %crate::escape::Keys(self.keys.iter().map(String::as_str).collect()),
                backend = self.shared.backend_name(),
                owner = %owner,
            )
        };
        let started = Instant::now();
        let meter = meter::Label::new(
            self.options.metrics_key.as_ref(),
            self.shared.backend_name(),
            meter::Kind::LOCK,
        );
        // One key: that key's request reports the call, with its own wait.
        let report = self.keys.len() > 1;
        let mut waiting_since = None;
        let result = self
            .acquire(owner, &mut waiting_since)
            .instrument(span)
            .await;
        if report {
            meter::call_ended(&meter, &result, started, waiting_since);
        }
        result
    }

    /// The request for one of the keys, with what is left of the wait.
    fn request(&self, key: &str, until: Instant, owner: &Owner) -> LockRequest {
        let options = Options {
            wait: until.saturating_duration_since(Instant::now()),
            owner: Some(owner.clone()),
            ..self.options.clone()
        };
        LockRequest::with(self.shared.clone(), key.to_owned(), options, self.lock)
            .part_of(self.options.metrics_key.as_ref(), self.keys.len() == 1)
    }

    /// Takes the keys; `waiting_since` is set when the first attempt could not take them all.
    async fn acquire(
        self,
        owner: Owner,
        waiting_since: &mut Option<Instant>,
    ) -> Result<Vec<LockGuard>, LockError> {
        LockError::require_runtime()?;
        self.shared.check_open()?;
        if self.keys.is_empty() {
            return Err(LockError::invalid_key(
                "",
                "lock_all needs at least one key",
            ));
        }
        if self.keys.len() > MAX_LOCK_ALL_KEYS {
            return Err(LockError::Config(format!(
                "lock_all of {} keys: at most {MAX_LOCK_ALL_KEYS} keys are taken in one call",
                self.keys.len()
            )));
        }
        for key in &self.keys {
            validate::key(key)?;
        }
        let started = Instant::now();
        let until = crate::timing::after(started, self.options.wait);
        let mut guards: Vec<LockGuard> = Vec::with_capacity(self.keys.len());
        let draining = self.shared.check_taking().is_err();
        if self.keys.len() > 1 && !self.lock.fair && !draining {
            // First every key in one statement (one round trip when they are free); what is
            // left after the first key not taken is waited for one key at a time, in order.
            let call_until = crate::timing::call_until(
                started,
                self.options.wait,
                self.shared.statement_timeout,
                self.shared.row_lock_wait(),
            );
            let requests = self
                .keys
                .iter()
                .map(|k| self.request(k, until, &owner))
                .collect();
            let tried = match request::try_all(requests, &owner, call_until).await {
                AllTry::Prefix(taken) => {
                    guards = taken;
                    true
                }
                AllTry::NotTried => false,
                AllTry::Failed(e) => return Err(e),
            };
            if guards.len() == self.keys.len() {
                tracing::debug!(keys = guards.len(), "acquired all in one statement");
                return Ok(guards);
            }
            if tried && Instant::now() >= until {
                // No time left to wait (`wait` zero: this was the one attempt): give back what
                // was taken, at once, instead of taking the rest one by one only to give it
                // all back at the busy key. The error names the first key not taken.
                let key = self.keys[guards.len()].clone();
                give_back(guards).await;
                tracing::debug!(key = %crate::Escaped(&key), "lock_all: not every key; gave the others back");
                return Err(LockError::Busy {
                    key,
                    waited: started.elapsed(),
                });
            }
            *waiting_since = Some(Instant::now());
            for g in &mut guards {
                // Dropped half-way (this call cancelled), it gives the key back unused.
                g.set_used(false);
            }
        }
        for key in &self.keys[guards.len()..] {
            let request = self.request(key, until, &owner);
            match request.await {
                Ok(mut g) => {
                    // Dropped half-way (this call cancelled), it gives the key back unused.
                    g.set_used(false);
                    guards.push(g);
                }
                Err(e) => {
                    give_back(guards).await;
                    tracing::debug!(key = %crate::Escaped(key), error = %e, "lock_all: not every key; gave the others back");
                    return Err(match e {
                        LockError::Busy { key, .. } => LockError::Busy {
                            key,
                            waited: started.elapsed(),
                        },
                        other => other,
                    });
                }
            }
        }
        for g in &mut guards {
            g.set_used(true);
        }
        tracing::debug!(keys = guards.len(), "acquired all");
        Ok(guards)
    }
}

/// All or nothing: gives back what was taken, recording nothing, all at once (the locker
/// coalesces the releases into a few statements instead of a round trip per key).
async fn give_back(guards: Vec<LockGuard>) {
    futures_util::future::join_all(guards.into_iter().map(LockGuard::give_back_unused)).await;
}
