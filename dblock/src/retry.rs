//! The one retry policy for every statement dblock sends.
//!
//! A failed statement falls in one of four classes ([`Failure`]); each backend maps its own
//! error codes to them (`backend/<dialect>` `classify`), this module maps the transport errors
//! and decides what happens next:
//!
//! | class | meaning | what [`run`] does |
//! |---|---|---|
//! | `NotCommitted` | the server rolled it back: it changed nothing | send it again after a short jittered pause, up to [`Policy::rolled_back`] times |
//! | `Locked` | rolled back because a row lock (SQLite: the file's write lock) was not had within the lock wait: someone, almost always an open transaction, holds that row | an acquire ([`Policy::locked_is_busy`]) returns it at once, to be answered "busy"; anything else is sent again after a short pause until its deadline (each send has waited the lock wait already, so the rollback budget does not apply) |
//! | `Unknown` | the connection broke, or no reply came in time: it may or may not have committed | send the *same* statement again (same attempt / release id) after a growing pause, across reconnects, until the outcome is known or [`Policy::resolve_until`] (when it no longer matters), and tell the caller an earlier send may have taken effect |
//! | `NotSent` | no connection could be had: nothing was sent this time | try again after a growing pause until [`Policy::send_until`] (the caller's deadline) — or, if an earlier send is in doubt, until `resolve_until` |
//! | `Fatal` | bad SQL, missing table, permissions, ... | return the error |
//!
//! This is where "unknown outcomes never count twice" lives: only statements whose repeat is
//! recognised (acquire and release carry an id that the row keeps) or harmless (reads, extend)
//! are run through here, and the caller learns with [`Tried::after_unknown`] that the answer it
//! gets may describe its own earlier, unacknowledged success.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::sync::lock;

/// A failed statement, and whether it was sent at all (if not, it certainly did not commit).
#[derive(Debug)]
pub(crate) struct Failed {
    pub(crate) error: sqlx::Error,
    pub(crate) sent: bool,
    /// How the failure is already classed, where it was (a row of a coalesced statement that
    /// failed: as the statement's failure was); `None`: by the backend's mapping of `error`.
    pub(crate) class: Option<Failure>,
}

impl From<sqlx::Error> for Failed {
    /// A failure of a statement that was sent (decoding a reply, a server error, ...).
    fn from(error: sqlx::Error) -> Self {
        Failed {
            error,
            sent: true,
            class: None,
        }
    }
}

/// What a failed statement says about its effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The server rolled the statement back (serialization failure, deadlock, lock wait timeout,
    /// Galera certification conflict, a cancelled statement): it changed nothing.
    NotCommitted,
    /// The server rolled the statement back because a row lock (SQLite: the file's write
    /// lock) was not had within the lock wait (`lock_timeout`, `innodb_lock_wait_timeout`, the
    /// busy timeout): it changed nothing, and the row is held, almost always by an open
    /// transaction (a fenced one, or a key taken with `lock_in`).
    Locked,
    /// The connection broke, or no reply came in time, while the statement was (or may have
    /// been) on its way: it may or may not have committed.
    Unknown,
    /// Nothing was sent: no connection could be had (refused, the pool timed out, ...).
    NotSent,
    /// Anything else: sending it again will not help.
    Fatal,
}

/// How long, and how often, a statement is sent again.
#[derive(Clone, Debug)]
pub(crate) struct Policy {
    /// Sends after rollbacks, at most.
    pub(crate) rolled_back: u32,
    /// Longest time one send may take (waiting for a connection and for the reply).
    pub(crate) per_send: Duration,
    /// While nothing is in doubt (every failure so far left the row untouched), sends go on
    /// until here: the caller's deadline.
    pub(crate) send_until: Instant,
    /// Once a send's outcome was unknown, the same statement goes on being sent until its
    /// outcome is known or this instant: when what it may have done no longer matters (for a
    /// lock statement, when the lease it may have written has surely ended).
    pub(crate) resolve_until: Instant,
    /// Where each failed send is noted as it happens, for a caller that stops waiting before
    /// the outcome is settled: its error can then name the real cause.
    pub(crate) report: Option<LastFailure>,
    /// A [`Failure::Locked`] ends the run at once (an acquire: the key is busy, and the wait
    /// loop's backoff, not a resend, is what comes next) — unless an earlier send's outcome is
    /// unknown, which is resolved first; otherwise it is sent again until the deadline.
    pub(crate) locked_is_busy: bool,
}

/// The latest failure of a statement still being sent: its I/O kind (if an I/O error) and text.
#[derive(Clone, Debug, Default)]
pub(crate) struct LastFailure(Arc<Mutex<Option<(std::io::ErrorKind, String)>>>);

impl LastFailure {
    fn note(&self, failed: &Failed) {
        let kind = match &failed.error {
            sqlx::Error::Io(io) => io.kind(),
            _ => std::io::ErrorKind::Other,
        };
        *lock(&self.0) = Some((kind, failed.error.to_string()));
    }

    /// The latest failure noted, if any.
    pub(crate) fn get(&self) -> Option<(std::io::ErrorKind, String)> {
        lock(&self.0).clone()
    }
}

impl Policy {
    /// A statement that nothing depends on resolving (a read, an idempotent write): tried for
    /// `per_send`, resends within that.
    pub(crate) fn within(per_send: Duration) -> Policy {
        Policy::until(per_send, Instant::now() + per_send)
    }

    /// A release or another write that must be resolved by `until` (the caller's deadline):
    /// sent and resolved until then, each send at most `per_send`.
    pub(crate) fn until(per_send: Duration, until: Instant) -> Policy {
        Policy {
            rolled_back: ROLLBACK_RESENDS,
            per_send,
            send_until: until,
            resolve_until: until,
            report: None,
            locked_is_busy: false,
        }
    }

    /// An acquire: sent while the caller waits (`call_until`), a lock wait ends the run (the
    /// key is busy), and an unknown outcome is resolved until `resolve_until` (when the lease
    /// it may have written has surely ended).
    pub(crate) fn acquire(
        per_send: Duration,
        call_until: Instant,
        resolve_until: Instant,
    ) -> Policy {
        Policy {
            rolled_back: ROLLBACK_RESENDS,
            per_send,
            send_until: call_until,
            resolve_until,
            report: None,
            locked_is_busy: true,
        }
    }
}

/// Sends after rollbacks, at most, unless a policy says otherwise.
pub(crate) const ROLLBACK_RESENDS: u32 = 10;

/// A statement's final result, and whether an earlier send of it had an unknown outcome.
#[derive(Debug)]
pub(crate) struct Tried<T> {
    pub(crate) result: Result<T, Failed>,
    /// An earlier send failed with an unknown outcome: it may have committed, so the final
    /// answer may describe that earlier effect (a release then finds nothing left to release),
    /// and a final error leaves the outcome unknown.
    pub(crate) after_unknown: bool,
}

/// How the transport-level errors (not the server's own error codes) are classed.
pub(crate) fn transport(e: &sqlx::Error) -> Failure {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => Failure::Unknown,
        // The pool waited its whole time-out for a connection: nothing was sent.
        sqlx::Error::PoolTimedOut => Failure::NotSent,
        _ => Failure::Fatal,
    }
}

/// Pause before resending after a rollback: short, jittered, so colliding writers spread out.
fn rollback_pause() -> Duration {
    Duration::from_micros(fastrand::u64(100..2000))
}

/// Runs `op` until it succeeds or the policy gives up, classing each failure with `classify`.
/// `op` gets the instant its send must be done by.
pub(crate) async fn run<T, Op, Fut>(
    policy: Policy,
    classify: impl Fn(&Failed) -> Failure,
    mut op: Op,
) -> Tried<T>
where
    Op: FnMut(Instant) -> Fut,
    Fut: Future<Output = Result<T, Failed>>,
{
    let (mut rolled_back, mut reconnects) = (0, 0);
    let mut after_unknown = false;
    // The last send that found no connection and said why before its time was up: a last send
    // that ran out of time (the pause before it overran, on a loaded machine) tells nothing,
    // and the caller hears this one's cause instead ("connection refused", not "timed out").
    let mut cause: Option<Failed> = None;
    loop {
        let until = if after_unknown {
            policy.resolve_until
        } else {
            policy.send_until
        };
        let limit = (Instant::now() + policy.per_send).min(until);
        let failed = match op(limit).await {
            Ok(value) => {
                return Tried {
                    result: Ok(value),
                    after_unknown,
                }
            }
            Err(failed) => failed,
        };
        let failure = classify(&failed);
        if let Some(report) = &policy.report {
            report.note(&failed);
        }
        let pause = match failure {
            // An acquire hears "busy" at once, unless an earlier send is in doubt: that one may
            // have taken the key, and only a resend that gets through can tell (a chaos run on
            // Galera left a grant orphaned for its whole lease when this stopped resolving).
            Failure::Locked if policy.locked_is_busy && !after_unknown => None,
            // It already waited for the row (the lock wait): sent again while the deadline
            // lasts, not counted against the rollbacks (a transaction may hold the row a while).
            Failure::Locked => Some(rollback_pause()),
            Failure::NotCommitted if rolled_back < policy.rolled_back => {
                rolled_back += 1;
                Some(rollback_pause())
            }
            Failure::Unknown => {
                after_unknown = true;
                reconnects += 1;
                Some(crate::timing::nth_backoff(reconnects))
            }
            // Nothing was sent this time; if an earlier send is in doubt, resolving it is worth
            // another try once a connection can be had.
            Failure::NotSent => {
                reconnects += 1;
                Some(crate::timing::nth_backoff(reconnects))
            }
            _ => None,
        };
        let until = if after_unknown {
            policy.resolve_until
        } else {
            policy.send_until
        };
        let out_of_time = Instant::now() >= limit;
        match pause {
            Some(pause) if Instant::now() + pause < until => {
                tracing::debug!(error = %failed.error, ?failure, ?pause, "statement failed; sending it again");
                if failure == Failure::NotSent && !out_of_time {
                    cause = Some(failed);
                }
                tokio::time::sleep(pause).await;
            }
            _ => {
                let failed = match cause {
                    Some(cause) if failure == Failure::NotSent && out_of_time => cause,
                    _ => failed,
                };
                return Tried {
                    result: Err(failed),
                    after_unknown,
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::Mutex;

    /// Scripted failures: a `Protocol` error whose text names its class.
    fn fail(class: &str) -> Failed {
        Failed {
            error: sqlx::Error::Protocol(class.into()),
            sent: class != "not-sent",
            class: None,
        }
    }

    fn classify(f: &Failed) -> Failure {
        match f.error.to_string() {
            s if s.contains("rolled-back") => Failure::NotCommitted,
            s if s.contains("locked") => Failure::Locked,
            s if s.contains("unknown") => Failure::Unknown,
            s if s.contains("not-sent") => Failure::NotSent,
            _ => Failure::Fatal,
        }
    }

    fn policy(send_for: u64, resolve_for: u64) -> Policy {
        let now = Instant::now();
        Policy {
            rolled_back: ROLLBACK_RESENDS,
            per_send: Duration::from_millis(500),
            send_until: now + Duration::from_millis(send_for),
            resolve_until: now + Duration::from_millis(resolve_for),
            report: None,
            locked_is_busy: false,
        }
    }

    /// Runs a script of outcomes (`Ok(n)` or a failure class; the last one repeats) through the
    /// policy; returns what `run` returned and the limit each send was given.
    async fn script(policy: Policy, steps: &[Result<u32, &str>]) -> (Tried<u32>, Vec<Instant>) {
        let steps: Mutex<VecDeque<Result<u32, &str>>> = Mutex::new(steps.iter().copied().collect());
        let limits = Mutex::new(Vec::new());
        let tried = run(policy, classify, |limit| {
            limits.lock().unwrap().push(limit);
            let mut steps = steps.lock().unwrap();
            let next = if steps.len() > 1 {
                steps.pop_front().unwrap()
            } else {
                steps[0]
            };
            async move { next.map_err(fail) }
        })
        .await;
        let limits = limits.into_inner().unwrap();
        (tried, limits)
    }

    /// Written for a CI flake: a closed port refused every connect, and the last resend, begun
    /// just before the deadline after an overrun pause, timed out before its connect was
    /// refused. The caller heard "timed out (server unreachable?)"; it is told "refused".
    #[tokio::test(start_paused = true)]
    async fn a_last_send_out_of_time_does_not_hide_why_the_others_failed() {
        let sends = Mutex::new(0);
        let tried = run(policy(1000, 1000), classify, |limit| {
            *sends.lock().unwrap() += 1;
            let first = *sends.lock().unwrap() < 3;
            async move {
                if first {
                    Err::<(), _>(fail("not-sent: refused"))
                } else {
                    tokio::time::sleep_until(limit).await;
                    Err(fail("not-sent: timed out"))
                }
            }
        })
        .await;
        let e = tried.result.unwrap_err().error.to_string();
        assert!(e.contains("refused"), "{e}");
        assert!(*sends.lock().unwrap() >= 3);

        // Only the sends that ran out of time give way: a send that failed in time is the cause.
        let (tried, _) = script(
            policy(1000, 1000),
            &[Err("not-sent: refused"), Err("not-sent: full")],
        )
        .await;
        let e = tried.result.unwrap_err().error.to_string();
        assert!(e.contains("full"), "{e}");
    }

    #[tokio::test(start_paused = true)]
    async fn rolled_back_statements_are_sent_again_as_they_are() {
        let (tried, sends) = script(
            policy(1000, 1000),
            &[Err("rolled-back"), Err("rolled-back"), Ok(7)],
        )
        .await;
        assert_eq!(tried.result.unwrap(), 7);
        assert!(!tried.after_unknown, "a rollback changed nothing");
        assert_eq!(sends.len(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn an_unknown_outcome_is_resent_and_reported_to_the_caller() {
        let (tried, sends) = script(policy(1000, 1000), &[Err("unknown"), Ok(1)]).await;
        assert_eq!(tried.result.unwrap(), 1);
        assert!(
            tried.after_unknown,
            "the caller must learn an earlier send may have committed"
        );
        assert_eq!(sends.len(), 2);
    }

    /// A row held past the lock wait: an acquire hears it at once (to answer busy); a release
    /// or an extend sends again until its deadline, past the rollback budget.
    #[tokio::test(start_paused = true)]
    async fn a_locked_row_ends_an_acquire_and_is_outwaited_by_the_rest() {
        let acquire = Policy {
            locked_is_busy: true,
            ..policy(1000, 1000)
        };
        let (tried, sends) = script(acquire, &[Err("locked"), Ok(1)]).await;
        assert!(tried.result.is_err());
        assert_eq!(sends.len(), 1, "an acquire is not sent again");

        let mut steps = vec![Err("locked"); ROLLBACK_RESENDS as usize + 5];
        steps.push(Ok(3));
        let (tried, sends) = script(policy(60_000, 60_000), &steps).await;
        assert_eq!(tried.result.unwrap(), 3);
        assert_eq!(sends.len(), ROLLBACK_RESENDS as usize + 6);

        // While an earlier send is in doubt, an acquire goes on resolving it.
        let acquire = Policy {
            locked_is_busy: true,
            ..policy(1000, 1000)
        };
        let (tried, sends) = script(acquire, &[Err("unknown"), Err("locked"), Ok(2)]).await;
        assert_eq!(tried.result.unwrap(), 2);
        assert!(tried.after_unknown);
        assert_eq!(sends.len(), 3);

        let started = Instant::now();
        let (tried, _) = script(policy(500, 500), &[Err("locked")]).await;
        assert!(tried.result.is_err());
        assert!(
            started.elapsed() <= Duration::from_millis(500),
            "bounded by its deadline"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn fatal_errors_are_returned_at_once() {
        let (tried, sends) = script(policy(1000, 1000), &[Err("bad sql"), Ok(1)]).await;
        assert!(tried.result.is_err());
        assert!(!tried.after_unknown);
        assert_eq!(sends.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn rollbacks_have_a_budget() {
        let mut p = policy(60_000, 60_000);
        p.rolled_back = 3;
        let (tried, sends) = script(p, &[Err("rolled-back")]).await;
        assert!(tried.result.is_err());
        assert_eq!(sends.len(), 4, "first send + 3 after rollbacks");
    }

    #[tokio::test(start_paused = true)]
    async fn an_unknown_outcome_is_resolved_until_it_no_longer_matters() {
        // The caller's deadline is 1 s away, the lease could last 10 s: resends go on, with
        // growing pauses, until the outcome is known...
        let start = Instant::now();
        let mut steps = vec![Err("unknown"); 12];
        steps.extend([Err("not-sent"), Err("not-sent"), Ok(9)]);
        let (tried, sends) = script(policy(1000, 10_000), &steps).await;
        assert_eq!(tried.result.unwrap(), 9, "resolved across reconnects");
        assert!(tried.after_unknown);
        assert_eq!(sends.len(), 15);
        assert!(
            start.elapsed() > Duration::from_secs(1),
            "gave up at the caller's deadline"
        );

        // ... or until the lease it may have written has surely ended.
        let start = Instant::now();
        let (tried, sends) = script(policy(1000, 10_000), &[Err("unknown")]).await;
        assert!(tried.result.is_err() && tried.after_unknown);
        let spent = start.elapsed();
        assert!(
            spent > Duration::from_secs(9) && spent <= Duration::from_secs(10),
            "{spent:?}"
        );
        // 5, 10, 20, 40, 80, 160, then 250 ms steps, each at least half that (125 ms): at most
        // 7 + 9.7 s / 125 ms sends, no spinning.
        assert!(sends.len() <= 85, "{} sends in {spent:?}", sends.len());
        assert!(
            sends
                .iter()
                .all(|limit| *limit <= start + Duration::from_secs(10)),
            "a send outlived the resolution deadline"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn no_connection_is_retried_until_the_callers_deadline_only() {
        let start = Instant::now();
        let (tried, sends) = script(policy(1000, 10_000), &[Err("not-sent")]).await;
        assert!(matches!(tried.result, Err(Failed { sent: false, .. })));
        assert!(!tried.after_unknown, "nothing was ever sent");
        assert!(start.elapsed() <= Duration::from_secs(1));
        assert!(sends.len() > 3, "retried within the deadline");
        assert!(sends.iter().all(|l| *l <= start + Duration::from_secs(1)));
    }

    #[tokio::test(start_paused = true)]
    async fn each_send_gets_its_own_limit() {
        let start = Instant::now();
        let (_, sends) = script(policy(5000, 5000), &[Err("unknown"), Ok(1)]).await;
        assert_eq!(sends[0], start + Duration::from_millis(500), "per_send");
        assert!(sends[1] > sends[0], "a fresh limit for the resend");
    }

    #[test]
    fn transport_errors_are_classed() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(transport(&io), Failure::Unknown);
        assert_eq!(transport(&sqlx::Error::PoolTimedOut), Failure::NotSent);
        assert_eq!(transport(&sqlx::Error::RowNotFound), Failure::Fatal);
        assert_eq!(transport(&sqlx::Error::PoolClosed), Failure::Fatal);
    }
}
