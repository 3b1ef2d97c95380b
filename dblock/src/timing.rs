//! Every timing rule of a waiting call in one place: the backoff between attempts and its
//! jitter, the floor of a call's time, the grace for a last answer, the margin a grant must
//! have left to be returned, and deadlines from durations a caller gives (any `Duration` up to
//! `Duration::MAX`, never an `Instant` overflow).

use std::time::Duration;

use tokio::time::Instant;

/// Longer than any wait anyone means: a `wait` (or any other bound) beyond it is taken as it.
/// 100 years: still far inside what an `Instant` can hold on every platform.
pub(crate) const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// A call with a shorter `wait` (zero: one attempt) still gets this long for its attempt (at most
/// the statement time-out).
pub(crate) const ATTEMPT_FLOOR: Duration = Duration::from_secs(1);

/// How long past its deadline a call waits for its last attempt's own answer (an error that
/// names the cause), before it reports "no answer".
pub(crate) const ANSWER_GRACE: Duration = Duration::from_millis(50);

/// How often a waiting writer looks whether readers hold the key, and renews its intent while
/// they do: well within the intent's lease (`backend/read.rs`).
pub(crate) const INTENT_EVERY: Duration = Duration::from_millis(400);

/// How long a writer's intent lasts unless renewed (it is renewed at each attempt, and a
/// waiting writer attempts at least every 250 ms): a writer that dies holds new readers back
/// for at most this long.
pub(crate) const INTENT_LEASE: Duration = Duration::from_secs(2);

/// How long a fair caller's ticket stays in its key's queue without its waiter renewing it
/// (`fair.rs`).
pub(crate) const WAITER_LEASE: Duration = Duration::from_secs(5);

/// A fair caller renews its ticket once this much of its lease has passed. Its looks at the
/// queue come at most the longest backoff (250 ms) apart, well inside the lease.
pub(crate) const TOUCH_AFTER: Duration = Duration::from_secs(1);

/// How long a leader's campaign pauses after a failed attempt (the database unreachable, say)
/// before it asks again.
pub(crate) const CAMPAIGN_RETRY: Duration = Duration::from_millis(500);

/// The longest `Locker::purge` waits for rows it kept for their fencing token alone (freed
/// within the database clock's current tick, on SQLite a millisecond): it purges again once a
/// new row of their key would start above their token. Rows held back longer (a key taken over
/// faster than the clock moves, a clock stepped back) wait for a later purge.
pub(crate) const PURGE_HELD_BACK: Duration = Duration::from_secs(1);

/// How often `Locker::drain` looks whether the holds it waits for have ended.
pub(crate) const DRAIN_POLL: Duration = Duration::from_millis(10);

/// First and largest pause between attempts while waiting for a busy key.
const FIRST_BACKOFF: Duration = Duration::from_millis(5);
const MAX_BACKOFF: Duration = Duration::from_millis(250);

/// A grant is returned only while its lease has at least a tenth of its length left (by the
/// local monotonic clock, counted from the send), at most a second.
const MARGIN_DIVISOR: u32 = 10;
const MAX_MARGIN: Duration = Duration::from_secs(1);

/// `start + d`, with `d` cut to [`FOREVER`].
pub(crate) fn after(start: Instant, d: Duration) -> Instant {
    let d = d.min(FOREVER);
    start
        .checked_add(d)
        .or_else(|| start.checked_add(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(start)
}

/// The end of a call's whole time: its `wait`, or one attempt's floor — [`ATTEMPT_FLOOR`], or
/// longer where the backend's lock statements may wait longer for a row lock (`row_lock_wait`:
/// MySQL's 1 s), so that an attempt held up by a transaction that holds the key answers "busy"
/// itself instead of running out of time: 500 ms past that wait. At most the statement
/// time-out.
pub(crate) fn call_until(
    started: Instant,
    wait: Duration,
    statement_timeout: Duration,
    row_lock_wait: Duration,
) -> Instant {
    let floor = ATTEMPT_FLOOR.max(row_lock_wait + Duration::from_millis(500));
    after(started, wait).max(started + floor.min(statement_timeout))
}

/// Whether a grant whose lease (of length `lease`) ends at `deadline` is live enough to return.
pub(crate) fn live(deadline: Instant, lease: Duration) -> bool {
    Instant::now() + (lease / MARGIN_DIVISOR).min(MAX_MARGIN) < deadline
}

/// The `n`th pause (n ≥ 1) of a [`Backoff`] left alone: 5 ms doubling to 250 ms, jittered.
/// (A statement's resends after a failed connection: a reconnect storm does not spin.)
pub(crate) fn nth_backoff(n: u32) -> Duration {
    let step = FIRST_BACKOFF
        .saturating_mul(1 << n.saturating_sub(1).min(6))
        .min(MAX_BACKOFF);
    jittered(step)
}

/// `step`, jittered over its upper half (0.5 to 1.0 times): waiters spread out instead of
/// arriving together.
pub(crate) fn jittered(step: Duration) -> Duration {
    step / 2 + step.mul_f64(fastrand::f64() / 2.0)
}

/// The pause between a waiter's attempts: 5 ms doubling to 250 ms, jittered, never past the
/// call's deadline nor (much) past the holder's lease end.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Backoff {
    step: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            step: FIRST_BACKOFF,
        }
    }
}

impl Backoff {
    /// Back to the first step: something changed (the waiter reached the head of its line, or
    /// was woken by a release).
    pub(crate) fn reset(&mut self) {
        self.step = FIRST_BACKOFF;
    }

    /// The step for a waiter `ahead` places behind the head of a queue (1: next in line).
    pub(crate) fn behind(&mut self, ahead: u32) {
        self.step = FIRST_BACKOFF
            .saturating_mul(1 << ahead.saturating_sub(1).min(16))
            .min(MAX_BACKOFF);
    }

    /// The next pause (jittered; at most until `until`, and at most 1 ms past `retry_after`,
    /// what is left of the holder's lease where the backend said), doubling the step after it.
    pub(crate) fn next(&mut self, until: Instant, retry_after: Option<Duration>) -> Duration {
        let mut pause = jittered(self.step).min(until.saturating_duration_since(Instant::now()));
        if let Some(left) = retry_after {
            pause = pause.min(left + Duration::from_millis(1));
        }
        self.step = (self.step * 2).min(MAX_BACKOFF);
        pause
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_duration_overflows() {
        let now = Instant::now();
        assert_eq!(after(now, Duration::MAX), now + FOREVER);
        assert_eq!(
            after(now, Duration::from_secs(1)),
            now + Duration::from_secs(1)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn backoff_doubles_with_jitter_and_keeps_to_its_bounds() {
        let mut b = Backoff::default();
        let far = Instant::now() + Duration::from_secs(60);
        let pauses: Vec<Duration> = (0..10).map(|_| b.next(far, None)).collect();
        for (i, p) in pauses.iter().enumerate() {
            let step = (FIRST_BACKOFF * (1 << i)).min(MAX_BACKOFF);
            assert!(
                *p >= step / 2 && *p <= step,
                "{i}: {p:?} for a step of {step:?}"
            );
        }
        assert!(b.next(far, Some(Duration::from_millis(2))) <= Duration::from_millis(3));
        assert_eq!(b.next(Instant::now(), None), Duration::ZERO);
        b.behind(3);
        assert!(b.next(far, None) <= FIRST_BACKOFF * 4);
        b.reset();
        assert!(b.next(far, None) <= FIRST_BACKOFF);
    }
}
