//! [`LockAllRequest`]: several keys at once, all or nothing, in one canonical order.
//!
//! The keys are sorted by their bytes and deduplicated, and taken as one owner: first all in one
//! statement (`request::try_all`), then whatever is left one after the other. Two calls naming
//! the same keys in any order take them in the same order, so they cannot deadlock: whoever has
//! the first key is the only one that can be waiting for the second (the one-statement attempt
//! keeps only keys in order and waits for nothing). If a key cannot be had within `wait` (or the
//! call fails, or is dropped), the keys already taken are given back at once, recording nothing
//! about them: a partial acquisition never stays behind.

use std::borrow::Cow;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use crate::error::LockError;
use crate::guard::LockGuard;
use crate::meter;
use crate::owner::{Context, Owner};
use crate::request::{self, AllTry, LockRequest, DEFAULT_TTL};
use crate::shared::Shared;
use crate::validate;

/// Most keys one [`Locker::lock_all`](crate::Locker::lock_all) call takes: every key goes in
/// one statement, and the backends' limits on a statement's parameters (SQLite 32,766, MySQL
/// and MariaDB 65,535) are well above what 1,000 keys need. More is refused up front with
/// [`LockError::Config`].
pub const MAX_LOCK_ALL_KEYS: usize = 1_000;

/// One `locker.lock_all(keys)` call being configured; `.await` it to take every key, or none.
///
/// The first attempt takes every key in one statement where the dialect has one (PostgreSQL,
/// MariaDB, SQLite; not the MySQL 8 path): n free keys cost one round trip, and a set with a
/// busy key writes nothing. What is left is then waited for one key at a time, in the canonical
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
    ttl: Duration,
    wait: Duration,
    min_hold: Duration,
    once: bool,
    fair: bool,
    owner: Option<Owner>,
    label: Option<String>,
    metrics_key: Option<Cow<'static, str>>,
}

impl LockAllRequest {
    pub(crate) fn new(shared: Arc<Shared>, keys: Vec<String>) -> Self {
        LockAllRequest {
            shared,
            keys,
            ttl: DEFAULT_TTL,
            wait: Duration::ZERO,
            min_hold: Duration::ZERO,
            once: false,
            fair: false,
            owner: None,
            label: None,
            metrics_key: None,
        }
    }

    /// The `key` label of this call's metrics (see [`LockRequest::metrics_key`]); the attribute
    /// passes its key templates (`acct:{from}, acct:{to}`).
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guards = locker.lock_all(["acct:1", "acct:2"]).metrics_key("acct:{a}, acct:{b}").await?;
    /// # Ok(()) }
    /// ```
    pub fn metrics_key(mut self, template: impl Into<Cow<'static, str>>) -> Self {
        self.metrics_key = Some(template.into());
        self
    }

    /// Lease length of every key (see [`LockRequest::ttl`]).
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guards = locker.lock_all(["a", "b"]).ttl(std::time::Duration::from_secs(5)).await?;
    /// # Ok(()) }
    /// ```
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long to keep trying for the whole set; zero (the default) means one attempt per key.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guards = locker.lock_all(["a", "b"]).wait(std::time::Duration::from_secs(2)).await?;
    /// # Ok(()) }
    /// ```
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Keeps every key unavailable to others until this long after it was taken (see
    /// [`LockRequest::min_hold`]).
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guards = locker.lock_all(["a", "b"]).min_hold(std::time::Duration::from_secs(1)).await?;
    /// # Ok(()) }
    /// ```
    pub fn min_hold(mut self, min_hold: Duration) -> Self {
        self.min_hold = min_hold;
        self
    }

    /// Refuses the set if any key's last hold succeeded (see [`LockRequest::once`]).
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guards = locker.lock_all(["a", "b"]).once().await?;
    /// # Ok(()) }
    /// ```
    pub fn once(mut self) -> Self {
        self.once = true;
        self
    }

    /// Waits for each key in arrival order across processes (see [`LockRequest::fair`]). The
    /// keys are then taken one at a time in canonical order, each in its own queue, never all
    /// in one statement ahead of those queues.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guards = locker.lock_all(["a", "b"]).fair().await?;
    /// # Ok(()) }
    /// ```
    pub fn fair(mut self) -> Self {
        self.fair = true;
        self
    }

    /// Acquires as this owner instead of the scope's (or a fresh) one.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let me = dblock::Owner::new();
    /// let guards = locker.lock_all(["a", "b"]).owner(&me).await?;
    /// # Ok(()) }
    /// ```
    pub fn owner(mut self, owner: &Owner) -> Self {
        self.owner = Some(owner.clone());
        self
    }

    /// A label stored in the `holder` column after `host/pid`, for operators.
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let guards = locker.lock_all(["a", "b"]).holder("transfer").await?;
    /// # Ok(()) }
    /// ```
    pub fn holder(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }
}

impl IntoFuture for LockAllRequest {
    /// The guards, in canonical key order.
    type Output = Result<Vec<LockGuard>, LockError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 'static>>;

    fn into_future(mut self) -> Self::IntoFuture {
        Box::pin(async move {
            let owner = self
                .owner
                .take()
                .or_else(|| Context::get().map(|c| c.owner))
                .unwrap_or_default();
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
                    keys = ?self.keys,
                    backend = self.shared.backend_name(),
                    owner = %owner,
                )
            };
            let started = Instant::now();
            let meter = meter::Label::new(
                self.metrics_key.as_ref(),
                self.shared.backend_name(),
                "lock",
            );
            // One key: that key's request reports the call, with its own wait.
            let report = self.keys.len() > 1;
            let mut waiting_since = None;
            let result = self
                .acquire(owner, &mut waiting_since)
                .instrument(span)
                .await;
            if report {
                meter::call_ended(
                    &meter,
                    meter::CallOutcome::of(&result),
                    started.elapsed(),
                    waiting_since.map(|t: Instant| t.elapsed()),
                );
            }
            result
        })
    }
}

impl LockAllRequest {
    /// The request for one of the keys, with what is left of the wait.
    fn request(&self, key: &str, until: Instant, owner: &Owner) -> LockRequest {
        let mut request = LockRequest::new(self.shared.clone(), key.to_owned())
            .part_of(self.metrics_key.as_ref(), self.keys.len() == 1)
            .ttl(self.ttl)
            .wait(until.saturating_duration_since(Instant::now()))
            .min_hold(self.min_hold)
            .owner(owner);
        if self.once {
            request = request.once();
        }
        if self.fair {
            request = request.fair();
        }
        if let Some(label) = &self.label {
            request = request.holder(label.clone());
        }
        request
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
        let until = crate::timing::after(started, self.wait);
        let mut guards: Vec<LockGuard> = Vec::with_capacity(self.keys.len());
        if self.keys.len() > 1 && !self.fair {
            // First every key in one statement (one round trip when they are free); what is
            // left after the first key not taken is waited for one key at a time, in order.
            let call_until =
                crate::timing::call_until(started, self.wait, self.shared.statement_timeout);
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
