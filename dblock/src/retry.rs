//! The one retry policy for every statement dblock sends.
//!
//! A failed statement falls in one of four classes ([`Failure`]); each backend maps its own
//! error codes to them (`backend/<dialect>` `classify`), this module maps the transport errors
//! and decides what happens next:
//!
//! | class | meaning | what [`run`] does |
//! |---|---|---|
//! | `NotCommitted` | the server rolled it back: it changed nothing | send it again after a short jittered pause, up to [`Policy::rolled_back`] times |
//! | `Unknown` | the connection broke: it may or may not have committed | send the *same* statement again (same attempt / release id) after a growing pause, up to [`Policy::unknown`] times, and tell the caller an earlier send may have taken effect |
//! | `NotSent` | no connection could be had: nothing was sent this time | final, unless an earlier send was `Unknown`: then keep resolving that one |
//! | `Fatal` | bad SQL, missing table, permissions, ... | return the error |
//!
//! This is where "unknown outcomes never count twice" lives: only statements whose repeat is
//! recognised (acquire and release carry an id that the row keeps) or harmless (reads, extend)
//! are run through here, and the caller learns with [`Tried::after_unknown`] that the answer it
//! gets may describe its own earlier, unacknowledged success.

use std::future::Future;
use std::time::Duration;

/// What a failed statement says about its effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The server rolled the statement back (serialization failure, deadlock, lock wait timeout,
    /// Galera certification conflict, a cancelled statement): it changed nothing.
    NotCommitted,
    /// The connection broke while the statement was (or may have been) on its way: it may or
    /// may not have committed.
    Unknown,
    /// No connection could be had (the pool timed out): nothing was sent this time.
    NotSent,
    /// Anything else: sending it again will not help.
    Fatal,
}

/// How often each class of failure is retried.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Policy {
    /// Sends after a rollback.
    pub(crate) rolled_back: u32,
    /// Sends after an unknown outcome (or, once one happened, after a failure to get a
    /// connection).
    pub(crate) unknown: u32,
}

impl Policy {
    /// Every statement: ten sends after rollbacks, ten after unknown outcomes.
    pub(crate) const STATEMENT: Policy = Policy {
        rolled_back: 10,
        unknown: 10,
    };
}

/// A statement's final result, and whether an earlier send of it had an unknown outcome.
#[derive(Debug)]
pub(crate) struct Tried<T> {
    pub(crate) result: Result<T, sqlx::Error>,
    /// An earlier send failed with an unknown outcome: it may have committed, so the final
    /// answer may describe that earlier effect (a release then finds nothing left to release).
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

/// Pause before the `n`th resend after an unknown outcome (n ≥ 1): 5 ms doubling to 250 ms,
/// jittered over the upper half, so a reconnect storm does not spend the budget in milliseconds.
fn unknown_pause(n: u32) -> Duration {
    let step = Duration::from_millis(5)
        .saturating_mul(1 << n.saturating_sub(1).min(6))
        .min(Duration::from_millis(250));
    step / 2 + step.mul_f64(fastrand::f64() / 2.0)
}

/// Runs `op` until it succeeds or the policy gives up, classing each failure with `classify`.
pub(crate) async fn run<T, Op, Fut>(
    policy: Policy,
    classify: impl Fn(&sqlx::Error) -> Failure,
    mut op: Op,
) -> Tried<T>
where
    Op: FnMut() -> Fut,
    Fut: Future<Output = Result<T, sqlx::Error>>,
{
    let (mut rolled_back, mut unknown) = (0, 0);
    let mut after_unknown = false;
    loop {
        let error = match op().await {
            Ok(value) => {
                return Tried {
                    result: Ok(value),
                    after_unknown,
                }
            }
            Err(e) => e,
        };
        let failure = classify(&error);
        let pause = match failure {
            Failure::NotCommitted if rolled_back < policy.rolled_back => {
                rolled_back += 1;
                rollback_pause()
            }
            Failure::Unknown if unknown < policy.unknown => {
                unknown += 1;
                after_unknown = true;
                unknown_pause(unknown)
            }
            // Nothing was sent this time, but an earlier send may have committed: resolving
            // that is worth another try once a connection can be had.
            Failure::NotSent if after_unknown && unknown < policy.unknown => {
                unknown += 1;
                unknown_pause(unknown)
            }
            _ => {
                return Tried {
                    result: Err(error),
                    after_unknown,
                }
            }
        };
        tracing::debug!(%error, ?failure, ?pause, "statement failed; sending it again");
        tokio::time::sleep(pause).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::Mutex;
    use tokio::time::Instant;

    /// Scripted failures: a `Protocol` error whose text names its class.
    fn fail(class: &str) -> sqlx::Error {
        sqlx::Error::Protocol(class.into())
    }

    fn classify(e: &sqlx::Error) -> Failure {
        match e.to_string() {
            s if s.contains("rolled-back") => Failure::NotCommitted,
            s if s.contains("unknown") => Failure::Unknown,
            s if s.contains("not-sent") => Failure::NotSent,
            _ => Failure::Fatal,
        }
    }

    /// Runs a script of outcomes (`Ok(n)` or a failure class) through the policy; returns what
    /// `run` returned and how many sends it made.
    async fn script(policy: Policy, steps: &[Result<u32, &str>]) -> (Tried<u32>, usize) {
        let steps: Mutex<VecDeque<Result<u32, &str>>> = Mutex::new(steps.iter().copied().collect());
        let sends = Mutex::new(0);
        let tried = run(policy, classify, || {
            *sends.lock().unwrap() += 1;
            let next = steps.lock().unwrap().pop_front().expect("script ran out");
            async move { next.map_err(fail) }
        })
        .await;
        let n = *sends.lock().unwrap();
        (tried, n)
    }

    #[tokio::test(start_paused = true)]
    async fn rolled_back_statements_are_sent_again_as_they_are() {
        let (tried, sends) = script(
            Policy::STATEMENT,
            &[Err("rolled-back"), Err("rolled-back"), Ok(7)],
        )
        .await;
        assert_eq!(tried.result.unwrap(), 7);
        assert!(!tried.after_unknown, "a rollback changed nothing");
        assert_eq!(sends, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn an_unknown_outcome_is_resent_and_reported_to_the_caller() {
        let (tried, sends) = script(Policy::STATEMENT, &[Err("unknown"), Ok(1)]).await;
        assert_eq!(tried.result.unwrap(), 1);
        assert!(
            tried.after_unknown,
            "the caller must learn an earlier send may have committed"
        );
        assert_eq!(sends, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn fatal_errors_are_returned_at_once() {
        let (tried, sends) = script(Policy::STATEMENT, &[Err("bad sql"), Ok(1)]).await;
        assert!(tried.result.is_err());
        assert!(!tried.after_unknown);
        assert_eq!(sends, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn budgets_bound_each_class() {
        let policy = Policy {
            rolled_back: 3,
            unknown: 2,
        };
        let (tried, sends) = script(policy, &[Err("rolled-back"); 10]).await;
        assert!(tried.result.is_err());
        assert_eq!(sends, 4, "first send + 3 after rollbacks");

        let (tried, sends) = script(policy, &[Err("unknown"); 10]).await;
        assert!(tried.result.is_err());
        assert!(tried.after_unknown);
        assert_eq!(sends, 3, "first send + 2 after unknown outcomes");

        // The budgets are separate: rollbacks do not use up the unknown-outcome budget.
        let (tried, sends) = script(
            policy,
            &[
                Err("unknown"),
                Err("rolled-back"),
                Err("rolled-back"),
                Err("unknown"),
                Ok(5),
            ],
        )
        .await;
        assert_eq!(tried.result.unwrap(), 5);
        assert!(tried.after_unknown);
        assert_eq!(sends, 5);
    }

    #[tokio::test(start_paused = true)]
    async fn no_connection_is_final_unless_an_earlier_send_is_unresolved() {
        let (tried, sends) = script(Policy::STATEMENT, &[Err("not-sent"), Ok(1)]).await;
        assert!(matches!(tried.result, Err(sqlx::Error::Protocol(_))));
        assert_eq!(sends, 1, "nothing was sent: nothing to resolve");

        let (tried, sends) = script(
            Policy::STATEMENT,
            &[Err("unknown"), Err("not-sent"), Err("not-sent"), Ok(3)],
        )
        .await;
        assert_eq!(tried.result.unwrap(), 3, "kept resolving the unknown send");
        assert!(tried.after_unknown);
        assert_eq!(sends, 4);
    }

    #[tokio::test(start_paused = true)]
    async fn unknown_outcomes_back_off_instead_of_spinning() {
        let started = Instant::now();
        let (_, sends) = script(Policy::STATEMENT, &[Err("unknown"); 11]).await;
        assert_eq!(sends, 11);
        let spent = started.elapsed();
        // 5, 10, 20, 40, 80, 160, then 250 ms steps, each jittered over its upper half.
        assert!(
            spent >= Duration::from_millis(5 + 10 + 20 + 40 + 80 + 160 + 4 * 250) / 2,
            "ten resends in {spent:?}"
        );
        assert!(spent <= Duration::from_millis(5 + 10 + 20 + 40 + 80 + 160 + 4 * 250));
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
