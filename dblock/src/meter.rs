//! What dblock reports through the [`metrics`](https://docs.rs/metrics) facade, with the
//! `metrics` feature (off by default; without it every function here is empty).
//!
//! | metric | kind | what |
//! |---|---|---|
//! | `dblock_acquire_seconds` | histogram | one acquiring call (`lock`, `lock_all`, `read`, `semaphore`, a locked body's), from its start until it returns; label `outcome`: `acquired`, `busy`, `lost` (the grant came too late), `done` (`once`), `error` |
//! | `dblock_wait_seconds` | histogram | of a call that found the key busy: from the first busy answer until it returned |
//! | `dblock_busy_total` | counter | calls that gave up because the key stayed busy |
//! | `dblock_hold_seconds` | histogram | from the grant until the guard gave the lock back (or was dropped) |
//! | `dblock_held` | gauge | locks held by this process's guards now |
//! | `dblock_lost_total` | counter | holds found lost while held: renewal found them gone or failed until their lease ran out, a locked body ended a margin before its lease's end, a guard's `lost()` saw the ttl run out, a shutdown (a handle guard without renewal whose lease quietly runs out, never asked, is not counted) |
//! | `dblock_max_hold_reached_total` | counter | holds whose renewal stopped at their `max_hold` (the lease then ends, and the hold is lost) |
//! | `dblock_renewal_failures_total` | counter | renewal statements that failed (retried while the leases last) |
//!
//! Every metric has the labels `key` — the key **template** (`order:{order_id}`, as the
//! attribute writes it; for the handle API what [`LockRequest::metrics_key`] gave, else
//! `(handle)`), never the concrete key, so the number of series stays bounded — `backend`
//! (`postgres`, `mysql`, `sqlite`) and `kind` (`lock`, `read`, `permit` for a semaphore's,
//! `leader`); the
//! renewal counter has `backend` only.
//!
//! [`LockRequest::metrics_key`]: crate::LockRequest::metrics_key

use std::borrow::Cow;
use std::time::Duration;

use tokio::time::Instant;

/// What a call's metrics are labelled with.
#[derive(Clone, Debug)]
pub(crate) struct Label {
    #[cfg(feature = "metrics")]
    key: Cow<'static, str>,
    #[cfg(feature = "metrics")]
    backend: &'static str,
    #[cfg(feature = "metrics")]
    kind: Kind,
}

/// The `key` label of calls that did not name one.
#[cfg(feature = "metrics")]
pub(crate) const UNNAMED: &str = "(handle)";

/// The kind of hold a call takes, as its metrics are labelled (`kind`). Each kind names its own
/// in its file (`read.rs`: "read", `semaphore.rs`: "permit", `leader.rs`: "leader"); the
/// exclusive lock's, the builders' default, is [`Kind::LOCK`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Kind(&'static str);

impl Kind {
    /// An exclusive lock ([`Locker::lock`](crate::Locker::lock), `lock_all`, the attribute).
    pub(crate) const LOCK: Kind = Kind::named("lock");

    /// The kind labelled `label` (lower case, one word: the label's value as documented in
    /// `docs/production.md`).
    pub(crate) const fn named(label: &'static str) -> Kind {
        Kind(label)
    }

    /// The label's value.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) fn label(self) -> &'static str {
        self.0
    }
}

impl Label {
    pub(crate) fn new(key: Option<&Cow<'static, str>>, backend: &'static str, kind: Kind) -> Label {
        #[cfg(not(feature = "metrics"))]
        let _ = (key, backend, kind);
        Label {
            #[cfg(feature = "metrics")]
            key: key.cloned().unwrap_or(Cow::Borrowed(UNNAMED)),
            #[cfg(feature = "metrics")]
            backend,
            #[cfg(feature = "metrics")]
            kind,
        }
    }

    #[cfg(feature = "metrics")]
    fn labels(&self) -> Vec<metrics::Label> {
        let key = match &self.key {
            Cow::Borrowed(s) => metrics::SharedString::const_str(s),
            Cow::Owned(s) => metrics::SharedString::from(s.clone()),
        };
        vec![
            metrics::Label::new("key", key),
            metrics::Label::new("backend", self.backend),
            metrics::Label::new("kind", self.kind.label()),
        ]
    }
}

/// How a lock call ended, for the `outcome` label.
#[cfg(feature = "metrics")]
#[derive(Clone, Copy, Debug)]
enum CallOutcome {
    Acquired,
    Busy,
    Lost,
    Done,
    Error,
}

#[cfg(feature = "metrics")]
impl CallOutcome {
    fn of<T>(result: &Result<T, crate::LockError>) -> CallOutcome {
        use crate::LockError;
        match result {
            Ok(_) => CallOutcome::Acquired,
            Err(LockError::Busy { .. }) => CallOutcome::Busy,
            Err(LockError::Lost { .. }) => CallOutcome::Lost,
            Err(LockError::AlreadyDone { .. }) => CallOutcome::Done,
            Err(_) => CallOutcome::Error,
        }
    }

    fn name(self) -> &'static str {
        match self {
            CallOutcome::Acquired => "acquired",
            CallOutcome::Busy => "busy",
            CallOutcome::Lost => "lost",
            CallOutcome::Done => "done",
            CallOutcome::Error => "error",
        }
    }
}

/// A lock call that began at `started` ended with `result`; `first_busy`: when it was first
/// told the key is busy, if it was (its wait time).
pub(crate) fn call_ended<T>(
    label: &Label,
    result: &Result<T, crate::LockError>,
    started: Instant,
    first_busy: Option<Instant>,
) {
    #[cfg(feature = "metrics")]
    {
        let outcome = CallOutcome::of(result);
        let mut with_outcome = label.labels();
        with_outcome.push(metrics::Label::new("outcome", outcome.name()));
        metrics::histogram!("dblock_acquire_seconds", with_outcome)
            .record(started.elapsed().as_secs_f64());
        if let Some(busy) = first_busy {
            metrics::histogram!("dblock_wait_seconds", label.labels())
                .record(busy.elapsed().as_secs_f64());
        }
        if matches!(outcome, CallOutcome::Busy) {
            metrics::counter!("dblock_busy_total", label.labels()).increment(1);
        }
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (label, result, started, first_busy);
}

/// A guard now holds a lock.
pub(crate) fn held(label: &Label) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("dblock_held", label.labels()).increment(1.0);
    #[cfg(not(feature = "metrics"))]
    let _ = label;
}

/// A guard gave its lock back (or was dropped) after holding it for `held_for`.
pub(crate) fn released(label: &Label, held_for: Duration) {
    #[cfg(feature = "metrics")]
    {
        metrics::gauge!("dblock_held", label.labels()).decrement(1.0);
        metrics::histogram!("dblock_hold_seconds", label.labels()).record(held_for.as_secs_f64());
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (label, held_for);
}

/// A hold was found lost while held.
pub(crate) fn lost(label: &Label) {
    #[cfg(feature = "metrics")]
    metrics::counter!("dblock_lost_total", label.labels()).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = label;
}

/// A hold's renewal reached its `max_hold`.
pub(crate) fn max_hold_reached(label: &Label) {
    #[cfg(feature = "metrics")]
    metrics::counter!("dblock_max_hold_reached_total", label.labels()).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = label;
}

/// A renewal statement failed.
pub(crate) fn renewal_failed(backend: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("dblock_renewal_failures_total", "backend" => backend).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = backend;
}
