//! The private core a [`Locker`](crate::Locker) shares with its guards and its renewal task: the
//! backend, the renewal set, the holder label, and the owner-checked operations (acquire
//! statement, release, extend) run under the retry policy and the per-(owner, key)
//! serialisation that makes those retries exact.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::coalesce::Coalescer;
use crate::backend::{Acquire, Attempt, Backend, Extension, Failed, LastWrite, Outcome, Released};
use crate::connect::ConnectOptions;
use crate::error::LockError;
use crate::hold::{Caller, Hold};
use crate::owner::Owner;
use crate::registry::{serialise, Serial, Tracked};
use crate::renew::Renewer;
use crate::retry::{self, Policy, Tried};
use crate::sync::lock;
use crate::validate;

mod lifecycle;
mod purging;
mod release;

use lifecycle::Lifecycle;
pub(crate) use lifecycle::Releasing;
pub(crate) use release::settle_lost_reply;

pub(crate) struct Shared {
    /// `Err` when `table()` was given a bad name: every call then reports it.
    backend: Result<Backend, String>,
    /// The leases this locker keeps alive, and its one renewal task.
    pub(crate) renewer: Arc<Renewer>,
    pub(crate) table: String,
    /// The database and table: where an owner's holds of a key are tracked (two lockers of one
    /// table share it; the same key in two tables or databases is two locks).
    space: Arc<str>,
    /// `host/pid`: the start of every `holder` value this locker writes (shared by every
    /// lock taken without a label).
    pub(crate) holder: Arc<str>,
    /// Longest time one statement may take (`ConnectOptions::statement_timeout`).
    pub(crate) statement_timeout: Duration,
    /// The default lock-delay of its requests (`ConnectOptions::lock_delay`).
    pub(crate) lock_delay: Duration,
    /// Whether concurrent statements share a round trip (`ConnectOptions::coalesce`).
    coalesce: bool,
    /// Where they do (`backend/coalesce/`): one per table copy, since a statement writes one
    /// table.
    pub(crate) coalescer: Coalescer,
    /// Shared with every `table()` copy: shut down together.
    lifecycle: Arc<Lifecycle>,
    /// `ConnectOptions::auto_purge`: rows free for longer are deleted in the background
    /// (`purging.rs`); `None` on the permits' copy, which its locker's purge covers.
    auto_purge: Option<Duration>,
    /// The copy on this table's semaphore permits (`backend::permits_table`), made on first
    /// use: one per locker, so that the holds of its guards are found again (re-entry).
    permits: std::sync::OnceLock<Arc<Shared>>,
}

/// What a locker's core is built with, from its `ConnectOptions`.
#[derive(Clone, Copy)]
struct Tuning {
    statement_timeout: Duration,
    coalesce: bool,
    lock_delay: Duration,
    /// `ConnectOptions::auto_purge` (`purging.rs`).
    auto_purge: Option<Duration>,
}

impl Shared {
    pub(crate) fn new(backend: Result<Backend, String>, table: &str, holder: String) -> Arc<Self> {
        Self::with_options(backend, table, holder, &ConnectOptions::default())
    }

    /// A locker's core as `options` say (statement time-out, coalescing).
    pub(crate) fn with_options(
        backend: Result<Backend, String>,
        table: &str,
        holder: String,
        options: &ConnectOptions,
    ) -> Arc<Self> {
        let tuning = Tuning {
            statement_timeout: options.statement_timeout,
            coalesce: options.coalesce,
            lock_delay: options.lock_delay,
            auto_purge: options.auto_purge,
        };
        Self::in_lifecycle(backend, table, holder, tuning, Arc::default())
    }

    fn in_lifecycle(
        backend: Result<Backend, String>,
        table: &str,
        holder: String,
        tuning: Tuning,
        lifecycle: Arc<Lifecycle>,
    ) -> Arc<Self> {
        let Tuning {
            statement_timeout,
            coalesce,
            lock_delay,
            auto_purge,
        } = tuning;
        let coalescer = Coalescer::new(backend.as_ref().ok().cloned(), coalesce);
        let space = match &backend {
            Ok(b) => format!("{}|{table}", b.database()),
            Err(_) => String::new(),
        };
        let shared = Arc::new(Shared {
            backend,
            renewer: Arc::default(),
            table: table.to_owned(),
            space: space.into(),
            holder: holder.into(),
            statement_timeout,
            lock_delay,
            coalesce,
            coalescer,
            lifecycle,
            auto_purge,
            permits: std::sync::OnceLock::new(),
        });
        shared.lifecycle.join(&shared);
        shared
    }

    /// The database and table: where one owner's holds of a key are tracked, and where the
    /// waiters of a key line up (`line.rs`).
    pub(crate) fn space(&self) -> &Arc<str> {
        &self.space
    }

    /// Frees `key`'s row of this table now if `owner` holds it (`""`: whoever holds it; an
    /// operator's force-release, a steal; `what` names it in errors): whether a row was freed.
    /// The holds this process has of the key (of that owner), known before the statement,
    /// learn at once that they are lost (a hold taken after it is a new tenure).
    pub(crate) async fn free(&self, what: &str, key: &str, owner: &str) -> Result<bool, LockError> {
        let mut holds = self.holds_of(key);
        if !owner.is_empty() {
            holds.retain(|h| h.owner.id() == owner);
        }
        let backend = self.backend()?;
        let statement = crate::backend::ForceRelease { key, owner };
        let freed = self
            .run_bounded(what, |limit| backend.run(&statement, limit))
            .await?;
        if freed {
            holds.iter().for_each(|h| h.taken_away());
        }
        Ok(freed)
    }

    /// A core of its own on `backend`, with this one's table, holder and tuning (test hooks
    /// that change how the backend talks).
    #[cfg(feature = "_test-util")]
    pub(crate) fn on_backend(&self, backend: Backend) -> Arc<Self> {
        Self::in_lifecycle(
            Ok(backend),
            &self.table,
            self.holder.to_string(),
            self.tuning(),
            Arc::default(),
        )
    }

    /// What this core was built with: a copy of it is built the same.
    fn tuning(&self) -> Tuning {
        Tuning {
            statement_timeout: self.statement_timeout,
            coalesce: self.coalesce,
            lock_delay: self.lock_delay,
            auto_purge: self.auto_purge,
        }
    }

    /// The same database and holder, another table (checked here: a bad name makes every call
    /// on the result fail with `Config`).
    pub(crate) fn with_table(&self, name: &str) -> Arc<Self> {
        self.copy_on(name, self.tuning())
    }

    fn copy_on(&self, name: &str, tuning: Tuning) -> Arc<Self> {
        let backend = validate::table(name).and_then(|()| match &self.backend {
            Ok(b) => Ok(b.with_table(name)),
            Err(e) => Err(e.clone()),
        });
        Self::in_lifecycle(
            backend,
            name,
            self.holder.to_string(),
            tuning,
            self.lifecycle.clone(),
        )
    }

    /// The copy of this locker on its semaphore permits' table (same database, lifecycle and
    /// holder; `backend::permits_table`). It purges nothing by itself: this locker's purge
    /// covers both tables.
    pub(crate) fn permits(&self) -> &Arc<Self> {
        self.permits.get_or_init(|| {
            let tuning = Tuning {
                auto_purge: None,
                ..self.tuning()
            };
            self.copy_on(&crate::backend::permits_table(&self.table), tuning)
        })
    }

    /// The key of a live hold of this locker's guards, as `owner`, whose key is one `is_it`
    /// accepts (a semaphore's permit: re-entry takes the same one again).
    pub(crate) fn held_where(&self, owner: &Owner, is_it: impl Fn(&str) -> bool) -> Option<String> {
        self.live()
            .values()
            .filter(|(_, of)| std::ptr::eq(of.as_ptr(), self))
            .filter_map(|(h, _)| h.upgrade())
            .find(|h| !h.is_lost() && h.owner == *owner && is_it(&h.key))
            .map(|h| h.key.clone())
    }

    pub(crate) fn backend(&self) -> Result<&Backend, LockError> {
        self.backend
            .as_ref()
            .map_err(|e| LockError::Config(e.clone()))
    }

    /// The longest the locker's lock statements wait for a row lock (`Backend::row_lock_wait`);
    /// zero without a backend.
    pub(crate) fn row_lock_wait(&self) -> Duration {
        self.backend
            .as_ref()
            .map_or(Duration::ZERO, |b| b.row_lock_wait(self.statement_timeout))
    }

    /// Whether a failed statement was rolled back for a row lock not had within the lock wait
    /// ([`Failure::Locked`](crate::retry::Failure::Locked)).
    pub(crate) fn locked(&self, failed: &crate::retry::Failed) -> bool {
        self.backend
            .as_ref()
            .is_ok_and(|b| b.classify(failed) == crate::retry::Failure::Locked)
    }

    /// Whether statements on the caller's connections (`fence`) must go as simple queries with
    /// inlined values: PostgreSQL behind a transaction pooler.
    pub(crate) fn simple_statements(&self) -> bool {
        self.backend.as_ref().is_ok_and(Backend::pooler)
    }

    pub(crate) fn backend_name(&self) -> &'static str {
        self.backend.as_ref().map_or("invalid", Backend::name)
    }

    /// The holder text for a lock taken with `label` (`host/pid/label`; an empty label is no
    /// label); a label longer than 255 bytes or with a NUL byte is refused.
    pub(crate) fn holder_for(&self, label: Option<&str>) -> Result<Arc<str>, LockError> {
        Ok(match label.filter(|l| !l.is_empty()) {
            Some(label) => {
                validate::label(label)?;
                validate::holder(format!("{}/{label}", self.holder)).into()
            }
            None => self.holder.clone(),
        })
    }

    /// Runs a statement that nothing depends on resolving (a read, an operator action, an
    /// extension) for at most one statement time-out, resending within it.
    pub(crate) async fn run_bounded<T, Op, Fut>(&self, what: &str, op: Op) -> Result<T, LockError>
    where
        Op: FnMut(Instant) -> Fut,
        Fut: Future<Output = Result<T, Failed>>,
    {
        let backend = self.backend()?;
        let tried = retry::run(
            Policy::within(self.statement_timeout),
            |f| backend.classify(f),
            op,
        )
        .await;
        tried
            .result
            .map_err(|f| LockError::database(f.error, tried.after_unknown, what))
    }

    /// Sends one acquire statement for `a` under `policy`: again after rollbacks, and after an
    /// unknown outcome with the same attempt id (so an earlier, unacknowledged success is
    /// recognised, not counted twice) until the outcome is known or `policy.resolve_until`.
    /// Serialised with the owner's other statements on the key; re-entry counts only the holds
    /// this process tracks. A grant is recorded as tracked before it is returned.
    ///
    /// The owner's serialisation comes back with the result: a grant that must be given back
    /// (it arrived too late) is released under it, so no other statement of the owner on the key
    /// can come between. `no_reentry`: a key the owner holds is busy, and nothing is sent.
    pub(crate) async fn acquire(
        &self,
        owner: &Owner,
        mut a: Acquire<'_>,
        no_reentry: bool,
        policy: Policy,
    ) -> (Tried<Attempt>, Option<Serial>) {
        let backend = match self.backend() {
            Ok(b) => b,
            Err(e) => {
                let tried = Tried {
                    result: Err(Failed {
                        error: sqlx::Error::Configuration(e.to_string().into()),
                        sent: false,
                        class: None,
                    }),
                    after_unknown: false,
                };
                return (tried, None);
            }
        };
        let mut tracked = serialise(&self.space, owner, a.key).await;
        // Refused while the owner holds the key; a hold of its that is lost (the guard not given
        // back yet) no longer counts: the statement then finds the row as any owner's call would.
        if no_reentry && tracked.holds() && !self.only_lost_holds(a.key, owner) {
            let busy = Tried {
                result: Ok(Attempt::Busy { retry_after: None }),
                after_unknown: false,
            };
            return (busy, None);
        }
        tracked.fill(&mut a);
        let tried = retry::run(
            policy,
            |f| backend.classify(f),
            |limit| self.coalescer.acquire(backend, &a, limit),
        )
        .await;
        if let Ok(attempt) = &tried.result {
            tracked.note(attempt);
        }
        (tried, Some(tracked))
    }

    /// [`acquire`](Self::acquire) for several keys of one owner in one statement
    /// ([`Backend::acquire_many`]): `all` sorted by key, distinct. The owner's serialisations of
    /// every key are taken in that order (so two such calls of one owner cannot deadlock in the
    /// process) and come back with the answer, one per key. `Ok(None)`: the dialect has no such
    /// statement, or `no_reentry` and the owner holds one of the keys (taken one at a time, then,
    /// each refusing re-entry on its own).
    pub(crate) async fn acquire_all(
        &self,
        owner: &Owner,
        mut all: Vec<Acquire<'_>>,
        no_reentry: bool,
        policy: Policy,
    ) -> Result<(Tried<Option<Vec<Attempt>>>, Vec<Serial>), LockError> {
        let backend = self.backend()?;
        let mut serials = Vec::with_capacity(all.len());
        let mut holds_one = false;
        for a in &mut all {
            let tracked = serialise(&self.space, owner, a.key).await;
            holds_one |= tracked.holds();
            tracked.fill(a);
            serials.push(tracked);
        }
        if no_reentry && holds_one {
            let not_tried = Tried {
                result: Ok(None),
                after_unknown: false,
            };
            return Ok((not_tried, serials));
        }
        let Some(statement) = crate::backend::AcquireMany::of(&all) else {
            let none = Tried {
                result: Ok(Some(Vec::new())),
                after_unknown: false,
            };
            return Ok((none, serials));
        };
        let tried = backend.retried(&statement, policy).await;
        if let Ok(Some(attempts)) = &tried.result {
            for (tracked, attempt) in serials.iter_mut().zip(attempts) {
                tracked.note(attempt);
            }
        }
        Ok((tried, serials))
    }

    /// Makes the lease end no earlier than `ttl` from now (database clock); `NotHeld` when it
    /// is no longer this tenure's. An extension only moves the end, so any resend is harmless.
    pub(crate) async fn extend(&self, hold: &Hold, ttl: Duration) -> Result<(), LockError> {
        validate::ttl_micros(ttl)?;
        let backend = self.backend()?;
        let sent = Instant::now();
        // Never past the hold's `max_hold`: at the cap there is nothing left to extend.
        let Some(ttl) = hold.extension(sent, ttl) else {
            return Err(LockError::Lost {
                key: hold.name().to_owned(),
            });
        };
        let ttl_us = validate::lease_micros(ttl, hold.lock_delay())?;
        let statement = crate::backend::Extend {
            hold: hold.as_ref(),
            ttl_us,
            max_hold_us: hold.max_hold_us(),
        };
        let extended = self
            .run_bounded("extend", |limit| {
                self.coalescer.extend(backend, &statement, limit)
            })
            .await?;
        match extended {
            Extension::Extended(expires_at_us) => {
                hold.extended(sent, ttl, expires_at_us);
                tracing::trace!(key = %crate::Escaped(&hold.key), "lease extended");
                Ok(())
            }
            Extension::NotHeld if hold.deadline() > sent => {
                // The lease was still running: it was taken (stolen, force-released).
                tracing::debug!(key = %crate::Escaped(&hold.key), "extend refused: lease taken");
                hold.renewal_refused(Instant::now());
                Err(LockError::Lost {
                    key: hold.name().to_owned(),
                })
            }
            Extension::NotHeld => {
                tracing::debug!(key = %crate::Escaped(&hold.key), "extend refused: lease no longer ours");
                Err(LockError::NotHeld {
                    key: hold.name().to_owned(),
                })
            }
        }
    }
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
