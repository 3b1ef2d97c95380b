//! The options core every request builder embeds: what any kind of hold takes (ttl, wait,
//! owner, holder label, metrics key) in [`Options`], what the exclusive lock adds (min_hold,
//! once, fair) in [`LockOptions`], their setters written once ([`setters!`]), and the one
//! place a call's owner is resolved.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use crate::error::LockError;
use crate::owner::{Context, Owner};
use crate::shared::Shared;
use crate::validate;

/// How long a lease lasts unless the call says otherwise: 30 s (renewed while the work runs,
/// so a short ttl only matters when the holder dies).
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// What every kind of request takes.
#[derive(Clone, Debug)]
pub(crate) struct Options {
    pub(crate) ttl: Duration,
    pub(crate) wait: Duration,
    pub(crate) owner: Option<Owner>,
    pub(crate) label: Option<String>,
    pub(crate) metrics_key: Option<Cow<'static, str>>,
    /// A hard cap on holding: renewal and `extend` never carry a lease past this long after
    /// its acquisition.
    pub(crate) max_hold: Option<Duration>,
    /// After a lease that ends without a release, how long its key stays unavailable (`None`:
    /// the locker's default).
    pub(crate) lock_delay: Option<Duration>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            ttl: DEFAULT_TTL,
            wait: Duration::ZERO,
            owner: None,
            label: None,
            metrics_key: None,
            max_hold: None,
            lock_delay: None,
        }
    }
}

impl Options {
    /// The owner the call acquires as, resolved when the call is first polled, in the task
    /// that awaits it: the one it was given, else the running locked scope's, else a fresh one.
    pub(crate) fn owner(&self) -> Owner {
        self.owner
            .clone()
            .or_else(|| Context::get().map(|c| c.owner))
            .unwrap_or_default()
    }

    /// The holder label for the row (`host/pid[/label]`) after checking what the caller gave
    /// that shares a statement with other callers' rows (label: at most 255 bytes and no NUL;
    /// metrics key: no NUL).
    pub(crate) fn holder(&self, shared: &Shared) -> Result<Arc<str>, LockError> {
        if let Some(key) = &self.metrics_key {
            validate::text("metrics key", key)?;
        }
        shared.holder_for(self.label.as_deref())
    }
}

impl Options {
    /// The lock-delay of the request: its own, else the locker's default.
    pub(crate) fn lock_delay(&self, shared: &Shared) -> Duration {
        self.lock_delay.unwrap_or(shared.lock_delay)
    }

    /// The ttl a grant asks for: the ttl, but never more than `max_hold` (a cap shorter than
    /// the ttl is the lease: the hold ends at the cap, as it would under renewal).
    pub(crate) fn capped_ttl(&self) -> Duration {
        self.max_hold.map_or(self.ttl, |cap| self.ttl.min(cap))
    }

    /// Refuses a `max_hold` of zero, and one shorter than `min_hold` (the key would have to
    /// stay unavailable past the cap).
    pub(crate) fn check_max_hold(&self, min_hold: Duration) -> Result<(), LockError> {
        match self.max_hold {
            Some(max_hold) if max_hold.is_zero() => Err(LockError::Config(
                "max_hold must be greater than zero".into(),
            )),
            Some(max_hold) if max_hold < min_hold => Err(LockError::Config(format!(
                "max_hold {max_hold:?} is shorter than min_hold {min_hold:?}: the key would stay \
                 unavailable past the cap; set a min_hold of at most max_hold"
            ))),
            _ => Ok(()),
        }
    }
}

/// A call's options resolved against its locker before the first attempt, the same for every
/// kind: what each attempt asks for and what the hold it makes keeps.
#[derive(Clone)]
pub(crate) struct Terms {
    /// The ttl, capped by `max_hold` ([`Options::capped_ttl`]).
    pub(crate) ttl: Duration,
    /// The lease each statement asks for, in µs: `ttl` plus the lock-delay.
    pub(crate) ttl_us: i64,
    /// `host/pid[/label]`.
    pub(crate) holder: Arc<str>,
    max_hold: Option<Duration>,
    lock_delay: Duration,
}

impl Options {
    /// This call's [`Terms`] on `shared`'s locker, after checking the holder label (and
    /// metrics key), `max_hold` against `min_hold` (the lock's; zero for the other kinds) and
    /// the ttl, in that order.
    pub(crate) fn terms(&self, shared: &Shared, min_hold: Duration) -> Result<Terms, LockError> {
        let holder = self.holder(shared)?;
        self.check_max_hold(min_hold)?;
        let lock_delay = self.lock_delay(shared);
        Ok(Terms {
            ttl: self.capped_ttl(),
            ttl_us: validate::lease_micros(self.capped_ttl(), lock_delay)?,
            holder,
            max_hold: self.max_hold,
            lock_delay,
        })
    }
}

impl Terms {
    /// Gives a hold just granted on these terms their cap (`max_hold`) and lock-delay.
    pub(crate) fn keep(&self, hold: &crate::hold::Hold) {
        hold.cap(self.max_hold);
        hold.delay(self.lock_delay);
    }
}

/// What the exclusive lock (one key or several) adds.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LockOptions {
    pub(crate) min_hold: Duration,
    pub(crate) once: bool,
    pub(crate) fair: bool,
    /// `reentrant(false)`: a call of an owner that holds the key waits for that hold to end
    /// (busy, as for any other owner) instead of re-entering it.
    pub(crate) no_reentry: bool,
    /// A steal's attempt: the key now, never behind the process's waiters for it (who wait on
    /// for the thief).
    pub(crate) jumps_line: bool,
}

impl LockOptions {
    /// The lease a grant gets: the ttl, or min_hold if that is longer.
    pub(crate) fn lease(&self, ttl: Duration) -> Duration {
        ttl.max(self.min_hold)
    }
}

/// The public setters of the options a builder takes (its `options: Options` field, and
/// `lock: LockOptions` for the lock's), written once for every builder. `$call` is an
/// expression that makes the builder from `locker`, for the examples.
macro_rules! setters {
    ($builder:ty, $call:literal: $($setter:ident),+ $(,)?) => {
        impl $builder {
            $( $crate::options::setters!(@ $setter, $call); )+
        }
    };
    (@ ttl, $call:literal) => {
        /// Lease length: the hold is free for others once it runs out unless renewed or
        /// extended. Greater than zero, at most 100 years (else `LockError::Config`). Default
        /// 30 s ([`DEFAULT_TTL`](crate::DEFAULT_TTL)).
        ///
        #[doc = concat!("```\n# async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {\nlet request = ", $call, ".ttl(std::time::Duration::from_secs(10));\n# Ok(()) }\n```")]
        pub fn ttl(mut self, ttl: ::std::time::Duration) -> Self {
            self.options.ttl = ttl;
            self
        }
    };
    (@ wait, $call:literal) => {
        /// How long to keep trying while the key is taken; zero (the default) means one attempt.
        /// Attempts back off exponentially with jitter and never sleep past the deadline; any
        /// `Duration` up to `Duration::MAX` ("as long as it takes") is accepted.
        ///
        #[doc = concat!("```\n# async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {\nlet request = ", $call, ".wait(std::time::Duration::from_secs(5));\n# Ok(()) }\n```")]
        pub fn wait(mut self, wait: ::std::time::Duration) -> Self {
            self.options.wait = wait;
            self
        }
    };
    (@ owner, $call:literal) => {
        /// Acquires as this owner instead of the running scope's (or a fresh) one: a second
        /// hold of the same owner is a re-entry.
        ///
        #[doc = concat!("```\n# async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {\nlet me = dblock::Owner::new();\nlet request = ", $call, ".owner(&me);\n# Ok(()) }\n```")]
        pub fn owner(mut self, owner: &$crate::Owner) -> Self {
            self.options.owner = Some(owner.clone());
            self
        }
    };
    (@ holder, $call:literal) => {
        /// A label stored in the `holder` column after `host/pid`, for operators. Validated
        /// like a key: a label longer than 255 bytes or with a NUL byte is refused with
        /// `LockError::Config` before anything is sent; an empty label is no label.
        ///
        #[doc = concat!("```\n# async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {\nlet request = ", $call, ".holder(\"billing::settle\");\n# Ok(()) }\n```")]
        pub fn holder(mut self, label: impl Into<String>) -> Self {
            self.options.label = Some(label.into());
            self
        }
    };
    (@ metrics_key, $call:literal) => {
        /// The `key` label of this call's metrics (feature `metrics`): a template such as
        /// `"order:{id}"` that names a family of keys, never the key itself unless the set of
        /// keys is small, so the number of metric series stays bounded. Default `(handle)`;
        /// the attribute passes its key template. Without the `metrics` feature it does
        /// nothing.
        ///
        #[doc = concat!("```\n# async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {\nlet request = ", $call, ".metrics_key(\"exports:{tenant}\");\n# Ok(()) }\n```")]
        pub fn metrics_key(mut self, template: impl Into<::std::borrow::Cow<'static, str>>) -> Self {
            self.options.metrics_key = Some(template.into());
            self
        }
    };
    (@ max_hold, $call:literal) => {
        /// A hard cap on holding (ShedLock's "lock at most for", enforced): renewal and
        /// [`extend`](crate::LockGuard::extend) never carry the lease past this long after the
        /// acquisition (measured from when the acquire was sent, so never past
        /// `acquired_at + max_hold` on the database clock). At the cap renewal stops, the lease
        /// ends, [`lost`](crate::LockGuard::lost) resolves, and a locked body ends with
        /// `Err(Lost)` (its hold recording `Failed`); `extend` then returns `Lost`. A `max_hold`
        /// shorter than the ttl is the first lease itself (the hold ends at the cap); zero, or
        /// shorter than `min_hold`, is `LockError::Config`. Default: none (a renewed lease lives
        /// as long as its guard).
        ///
        #[doc = concat!("```
# async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
use std::time::Duration;
// Renewed while the work runs, but never held for more than ten minutes.
let request = ", $call, ".ttl(Duration::from_secs(30)).max_hold(Duration::from_secs(600));
# Ok(()) }
```")]
        pub fn max_hold(mut self, max_hold: ::std::time::Duration) -> Self {
            self.options.max_hold = Some(max_hold);
            self
        }
    };
    (@ lock_delay, $call:literal) => {
        /// Lock-delay (Chubby's and Consul's): if this hold's lease ends without a release (its
        /// holder crashed, stalled or was cut off), the key stays unavailable to every owner for
        /// this long more, on the database clock, so the vanished holder's writes in flight land
        /// before anyone else starts — for resources that cannot check a fencing token. A
        /// release, `force_release` or `steal` ends it at once. The row's lease end
        /// ([`LockInfo::expires_at`](crate::LockInfo::expires_at), the guard's
        /// [`expires_at`](crate::LockGuard::expires_at)) includes it; the holder's own view of
        /// its lease ([`is_lost`](crate::LockGuard::is_lost), renewal) does not. Default: the
        /// locker's ([`ConnectOptions::lock_delay`](crate::ConnectOptions::lock_delay), zero).
        ///
        #[doc = concat!("```
# async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
let request = ", $call, ".lock_delay(std::time::Duration::from_secs(15));
# Ok(()) }
```")]
        pub fn lock_delay(mut self, delay: ::std::time::Duration) -> Self {
            self.options.lock_delay = Some(delay);
            self
        }
    };
    (@ min_hold, $call:literal) => {
        /// Keeps the key (every key of the call) unavailable to every other owner until this
        /// long after it was acquired (database clock), even if it is released sooner: a job
        /// started on every instance each period runs once a period, not once per instance
        /// (ShedLock's "lock at least for"). The holder's own release still returns at once;
        /// from then on the rest of the time holds for that owner too (a later call of the
        /// same owner is a new hold, not a re-entry: the work is not run again early).
        /// The lease is at least this long, so a crashed holder's key waits for it too.
        /// Default: none.
        ///
        #[doc = concat!("```\n# async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {\n// Every instance tries each minute; one runs the report, the others find it busy.\nlet request = ", $call, ".min_hold(std::time::Duration::from_secs(50));\n# Ok(()) }\n```")]
        pub fn min_hold(mut self, min_hold: ::std::time::Duration) -> Self {
            self.lock.min_hold = min_hold;
            self
        }
    };
    (@ once, $call:literal) => {
        /// Runs the work until it succeeds once: a key whose last hold ended in success
        /// (released with [`LockGuard::release`](crate::LockGuard::release), or
        /// [`succeed_in`](crate::LockGuard::succeed_in)) is not acquired again; the call
        /// returns [`LockError::AlreadyDone`](crate::LockError::AlreadyDone). After a failure
        /// ([`release_failed`](crate::LockGuard::release_failed), a lease that ran out) or a
        /// guard simply dropped ([`Outcome::Dropped`](crate::Outcome::Dropped)) it can be
        /// acquired again. [`Locker::reset`](crate::Locker::reset) makes a done key runnable
        /// again, and [`Locker::purge`](crate::Locker::purge) never deletes a done key's record.
        ///
        /// The release records the success after the work: a crash in between runs the work
        /// again (at-least-once). For work in the lock's own database, record the success in
        /// the work's own transaction with [`LockGuard::succeed_in`](crate::LockGuard::succeed_in):
        /// then it is exactly-once.
        ///
        #[doc = concat!("```\n# async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {\nmatch ", $call, ".once().await {\n    Ok(held) => drop(held), // ... pay, then record the success with release() ...\n    Err(dblock::LockError::AlreadyDone { .. }) => {} // paid before\n    Err(e) => return Err(e),\n}\n# Ok(()) }\n```")]
        pub fn once(mut self) -> Self {
            self.lock.once = true;
            self
        }
    };
    (@ fair, $call:literal) => {
        /// Waits in arrival order across processes: callers of one key that use `fair()` get it
        /// first come, first served, whichever process they run in (without it, arrival order
        /// holds among the waiters of one process, and across processes whoever asks first
        /// after a release wins). Several keys are then taken one at a time in canonical
        /// order, each in its own queue.
        ///
        /// A fair caller first reads the key's queue (a table beside the lock table, created by
        /// [`Locker::migrate`](crate::Locker::migrate)): if nobody is queued it attempts at
        /// once; if the key is busy, or others are queued, it takes a ticket and attempts only
        /// once every earlier ticket is gone. The cost: one more read per call, and under
        /// contention a ticket written and deleted per waiter. A ticket is a lease of 5 s,
        /// renewed while its caller waits: a waiter that dies holds the queue up for at most
        /// that long. With `wait` zero (one attempt), a fair call finds the key busy as long as
        /// others are queued for it.
        ///
        /// Fairness holds among callers that use it: a call without `fair()` does not read the
        /// queue and can take a free key ahead of it. A re-entry (the owner holds the key)
        /// never queues. Mutual exclusion never depends on the queue: it only orders attempts.
        ///
        #[doc = concat!("```\n# async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {\nlet request = ", $call, ".fair().wait(std::time::Duration::from_secs(30));\n# Ok(()) }\n```")]
        pub fn fair(mut self) -> Self {
            self.lock.fair = true;
            self
        }
    };
    (@ reentrant_permit, $call:literal) => {
        /// Whether a call of an owner that already holds a permit of the semaphore takes that
        /// permit again (`true`, the default: the same slot, `hold_count` one higher, no second
        /// permit used) or a permit of its own (`false`: another free one, waiting within
        /// `wait` while none is). The owner is the task's or the scope's, not the future's:
        /// sibling futures of one locked body (`join_all` over work items) share one permit by
        /// default; with `reentrant(false)` each counts as one.
        ///
        #[doc = concat!("```\n# async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {\nlet me = dblock::Owner::new();\nlet first = ", $call, ".owner(&me).await?;\nlet second = ", $call, ".owner(&me).reentrant(false).await?;\nassert_eq!(second.hold_count(), 1); // a permit of its own, not `first` again\n# drop((first, second));\n# Ok(()) }\n```")]
        pub fn reentrant(mut self, reentrant: bool) -> Self {
            self.no_reentry = !reentrant;
            self
        }
    };
    (@ reentrant, $call:literal) => {
        /// Whether a call of an owner that already holds the key re-enters it: `true` (the
        /// default) takes it at once, `hold_count` one higher; `false` finds it busy, as
        /// another owner's call would, and waits (within `wait`) for that hold to end.
        ///
        /// The owner is the task's, not the future's: futures run side by side in one task or
        /// one owner scope (`join!`, `join_all`, `select!`) re-enter each other's keys, so
        /// their critical sections overlap. `reentrant(false)` makes them exclude each other
        /// while keeping the scope's owner (its body's nested calls on other keys, `current()`
        /// and fencing are unchanged). Inside a locked body that holds the key itself the wait
        /// could only end at its deadline: such a call returns
        /// [`LockError::WouldWaitForItself`](crate::LockError::WouldWaitForItself) at once.
        /// Re-entry is decided from the holds this process tracks, under the owner's
        /// serialisation of the key: a refused re-entry sends no acquire statement (a waiting
        /// call still does what any waiter does: a writer's intent behind readers, a fair
        /// ticket). A hold of the owner that is lost (its lease ran out, or it was taken) no
        /// longer counts, though its guard is not given back yet. Only this call refuses: a
        /// later call of the owner without `reentrant(false)` re-enters its hold as usual. A
        /// steal ([`Locker::steal`](crate::Locker::steal)) ignores it.
        ///
        #[doc = concat!("```\n# async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {\nlet me = dblock::Owner::new();\nlet first = ", $call, ".owner(&me).await?;\n// The same owner again, not re-entering: busy while `first` holds the key.\nlet again = ", $call, ".owner(&me).reentrant(false).await;\nassert!(matches!(again, Err(dblock::LockError::Busy { .. })));\ndrop(first); // released in the background\n# Ok(()) }\n```")]
        pub fn reentrant(mut self, reentrant: bool) -> Self {
            self.lock.no_reentry = !reentrant;
            self
        }
    };
}

pub(crate) use setters;

/// The span of one call of a builder that embeds the options core (`$req.options`, with
/// `$req.key` and `$req.shared`), named `$name`, with the call's owner and any fields of the
/// kind's own after the key: every kind's span carries the same fields in the same order.
macro_rules! call_span {
    ($name:literal, $req:expr, $owner:expr $(, $field:ident = $value:expr)* $(,)?) => {
        tracing::debug_span!(
            $name,
            key = %$crate::Escaped(&$req.key),
            $($field = $value,)*
            backend = $req.shared.backend_name(),
            owner = %$owner,
            ttl_ms = $req.options.ttl.as_millis() as u64,
            wait_ms = $req.options.wait.as_millis() as u64,
        )
    };
}

pub(crate) use call_span;

/// `IntoFuture` for a builder that embeds the options core: awaiting it runs the builder's
/// `async fn call(self, owner: Owner) -> Result<$output, LockError>`, with the owner resolved
/// when the future is first polled, in the awaiting task (the scope's owner if any, see
/// [`owner::scope`](crate::owner::scope)). Every builder's future is `Send + 'static`, boxed.
macro_rules! into_future {
    ($builder:ty => $output:ty $(, #[doc = $doc:literal])?) => {
        impl ::std::future::IntoFuture for $builder {
            $(#[doc = $doc])?
            type Output = ::std::result::Result<$output, $crate::LockError>;
            type IntoFuture = ::std::pin::Pin<
                ::std::boxed::Box<dyn ::std::future::Future<Output = Self::Output> + Send + 'static>,
            >;

            fn into_future(self) -> Self::IntoFuture {
                ::std::boxed::Box::pin(async move {
                    let owner = self.options.owner();
                    self.call(owner).await
                })
            }
        }
    };
}

pub(crate) use into_future;
