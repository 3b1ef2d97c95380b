//! The one wait loop of every kind of hold ([`wait_for`]): attempts until one is granted or the
//! call's `wait` runs out, with the policies every kind shares — the process's line of waiters
//! for a key (`line.rs`: only the head asks the database, a release by this process wakes it),
//! NOTIFY wake-ups where the backend has them, jittered backoff capped by the deadline and the
//! holder's lease (`timing.rs`), and one rule for a call whose time ran out. What an attempt is,
//! and what a busy answer means, is the kind's ([`Kind`]): the exclusive lock (`exclusive.rs`,
//! with a fair caller's queue and a writer's intent behind readers), a read (`read.rs`), a
//! semaphore's permit (`semaphore.rs`), the key taken in the caller's transaction (`in_tx.rs`).

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::Interest;
use crate::detach::Unreceived;
use crate::error::LockError;
use crate::guard::LockGuard;
use crate::line;
use crate::shared::Shared;
use crate::timing::{self, Backoff, ANSWER_GRACE};

/// What one attempt came to, with a grant already inside what the kind gives (a lease's
/// [`LockGuard`], unless the kind says otherwise).
pub(crate) enum Try<G = LockGuard> {
    Got(G),
    /// Taken by someone else. `retry_after`: what is left of the holder's lease, where the
    /// backend says; `attempted`: `false` when the kind did not ask (a fair caller behind
    /// others in its queue, `ahead` of them).
    Busy {
        retry_after: Option<Duration>,
        behind: Option<u32>,
    },
    /// Granted, but the reply came when the lease could have ended: given back.
    Stale,
    /// Failed in a way a later attempt may get past (the database unreachable for a moment):
    /// tried again while the call's time lasts, and reported at its end unless a busy answer
    /// came after it.
    Retry(LockError),
    Failed(LockError),
}

/// An attempt nobody waits for any more gives back what it got (nothing ran under it).
impl Unreceived for Try {
    async fn unreceived(self) {
        if let Try::Got(guard) = self {
            tracing::debug!(key = %crate::Escaped(guard.key()), "granted to a call that is gone; given back");
            let _ = guard.give_back_unused().await;
        }
    }
}

impl<G> Try<G> {
    /// A busy answer to an attempt that was made.
    pub(crate) fn busy(retry_after: Option<Duration>) -> Try<G> {
        Try::Busy {
            retry_after,
            behind: None,
        }
    }
}

/// A busy answer, as the kind's [`Kind::busy`] sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Busy {
    /// The first busy answer of the call.
    pub(crate) first: bool,
    /// The kind asked the database (not a fair caller behind others).
    pub(crate) attempted: bool,
    /// The call listens for releases (NOTIFY).
    pub(crate) listening: bool,
    /// When the call gives up.
    pub(crate) wait_until: Instant,
}

/// What the attempts answered so far, for the error when the call's time runs out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Seen {
    Nothing,
    Busy,
    Stale,
}

/// One kind of hold as the wait loop drives it.
pub(crate) trait Kind: Send {
    /// What a granted attempt gives: a lease's [`LockGuard`]; `lock_in`'s fencing token.
    type Grant: Send;

    /// The key of the process's line of waiters and of NOTIFY wake-ups (a semaphore's own key,
    /// for all its permits).
    fn key(&self) -> &str;

    /// Whether the call lines up in the process's line for [`key`](Kind::key): not a re-entry
    /// (it would wait for a holder that waits for it), not a fair caller (it keeps to its
    /// queue in the database instead).
    fn lines_up(&self) -> bool {
        true
    }

    /// Whether the call re-enters a hold its owner has (it then goes on while the locker
    /// drains: part of the work already running).
    fn reentry(&self) -> bool {
        false
    }

    /// Whether a release by this process wakes the call although it is not the head of a line
    /// (a fair caller, which looks at its queue again).
    fn woken_by_releases(&self) -> bool {
        false
    }

    /// One attempt; `waiting`: the call listens for releases (PostgreSQL: the attempt asks the
    /// holder's release to NOTIFY). It stops sending at `call_until`.
    fn attempt(
        &mut self,
        waiting: bool,
        call_until: Instant,
    ) -> impl Future<Output = Try<Self::Grant>> + Send;

    /// After a busy answer, before the call waits: a reason not to wait at all (the owner would
    /// wait for itself), or a chore of the kind's while it waits (a writer records its intent;
    /// a fair caller takes a ticket; a semaphore's waiter asks the holders to notify).
    fn busy(&mut self, busy: Busy) -> impl Future<Output = Result<(), LockError>> + Send {
        let _ = busy;
        std::future::ready(Ok(()))
    }

    /// Whether the next pause starts again from the first step: something changed for the
    /// kind (a fair caller just reached the head of its queue).
    fn fresh(&mut self) -> bool {
        false
    }

    /// The row keys whose releases wake the call (NOTIFY); none: it polls.
    fn wake_keys(&self) -> Vec<String> {
        vec![self.key().to_owned()]
    }

    /// The error for a call whose time ran out: busy if that is what the database last said,
    /// the lease ended before the grant arrived, or no answer at all (the outcome unknown).
    fn gave_up(&self, seen: Seen, waited: Duration) -> LockError;

    /// As [`gave_up`](Kind::gave_up), for a call whose last attempt was still settling at the
    /// deadline: the kind may name that attempt's latest failure.
    fn unanswered(&self, seen: Seen, waited: Duration) -> LockError {
        self.gave_up(seen, waited)
    }
}

/// Takes a hold of `kind`: attempts until one is granted or `wait` (counted from `started`)
/// runs out; the call returns by `max(wait, one attempt's floor)` whatever the database does.
/// `first_busy` notes when the key was first found busy (the metrics' wait time).
pub(crate) async fn wait_for<K: Kind>(
    kind: &mut K,
    shared: &Shared,
    started: Instant,
    wait: Duration,
    first_busy: &mut Option<Instant>,
) -> Result<K::Grant, LockError> {
    let wait_until = timing::after(started, wait);
    let call_until = timing::call_until(
        started,
        wait,
        shared.statement_timeout,
        shared.row_lock_wait(),
    );
    let mut backoff = Backoff::default();
    let mut seen = Seen::Nothing;
    let mut failure: Option<LockError> = None;
    // Set once this call waits where the backend can wake it (PostgreSQL LISTEN/NOTIFY).
    let mut wake: Option<Vec<Interest>> = None;
    // This call's place at the head of the process's line for the key, taken once the key was
    // found busy: only the head asks the database.
    let mut turn: Option<line::Turn> = None;
    // The process's line for the key: looked up only when the key is busy, or when others
    // already wait in it (a lone caller never touches the lines' map).
    let mut line = line::waiting(shared.space(), kind.key());
    if let Some(l) = line.as_ref().filter(|_| kind.lines_up()) {
        // Earlier waiters of this process are in line: a newcomer goes behind them rather
        // than ahead with an attempt of its own (with no wait, the key is busy for it).
        tracing::trace!("in line behind earlier waiters before the first attempt");
        match tokio::time::timeout_at(wait_until, l.turn()).await {
            Ok(head) => turn = Some(head),
            Err(_) => return Err(kind.gave_up(Seen::Busy, started.elapsed())),
        }
    }
    loop {
        // A locker shut down (or draining, for a new hold) while this call waits: no further
        // attempt.
        if kind.reentry() {
            shared.check_open()?;
        } else {
            shared.check_taking()?;
        }
        // The attempt stops sending at `call_until`; a moment more lets it say why.
        let attempt = kind.attempt(wake.is_some(), call_until);
        let outcome = match tokio::time::timeout_at(call_until + ANSWER_GRACE, attempt).await {
            Ok(outcome) => outcome,
            Err(_) => {
                let waited = started.elapsed();
                tracing::debug!(?waited, "no answer within the call's time");
                return Err(failure
                    .take()
                    .unwrap_or_else(|| kind.unanswered(seen, waited)));
            }
        };
        let (retry_after, behind) = match outcome {
            Try::Got(guard) => return Ok(guard),
            Try::Failed(e) => return Err(e),
            Try::Stale => {
                // Ask again at once: the key may well be free.
                seen = Seen::Stale;
                if Instant::now() >= wait_until {
                    return Err(kind.gave_up(seen, started.elapsed()));
                }
                continue;
            }
            Try::Retry(e) => {
                tracing::debug!(error = %e, "attempt failed; trying again");
                failure = Some(e);
                (None, None)
            }
            Try::Busy {
                retry_after,
                behind,
            } => {
                let busy = Busy {
                    first: first_busy.is_none(),
                    attempted: behind.is_none(),
                    listening: wake.is_some(),
                    wait_until,
                };
                first_busy.get_or_insert_with(Instant::now);
                kind.busy(busy).await?;
                seen = Seen::Busy;
                failure = None;
                (retry_after, behind)
            }
        };
        let now = Instant::now();
        if now >= wait_until {
            tracing::debug!(waited = ?now - started, "busy: giving up");
            return Err(failure
                .take()
                .unwrap_or_else(|| kind.gave_up(seen, now - started)));
        }
        if kind.fresh() {
            backoff.reset();
        }
        let l = line.get_or_insert_with(|| line::of(shared.space(), kind.key()));
        match behind {
            // Behind others in a fair queue: the pause is set by the place.
            Some(ahead) => backoff.behind(ahead),
            None if turn.is_none() && kind.lines_up() => {
                if let Some(head) = l.try_turn() {
                    turn = Some(head);
                } else {
                    // Earlier waiters of this process go first, in arrival order.
                    tracing::trace!("busy: in line behind earlier waiters");
                    match tokio::time::timeout_at(wait_until, l.turn()).await {
                        Ok(head) => {
                            turn = Some(head);
                            backoff.reset();
                            continue; // at the head: ask at once
                        }
                        Err(_) => return Err(kind.gave_up(seen, started.elapsed())),
                    }
                }
            }
            None => {}
        }
        if wake.is_none() {
            // Setting LISTEN up may take a connect: never past the call's deadline.
            let keys = kind.wake_keys();
            let mut interests = Vec::with_capacity(keys.len());
            for key in &keys {
                let interest = tokio::time::timeout_at(wait_until, shared.backend()?.interest(key));
                match interest.await {
                    Ok(Some(i)) => interests.push(i),
                    _ => break,
                }
            }
            // Not (yet) listening, e.g. while the LISTEN connection is being made: poll this
            // round and look again the next.
            if !keys.is_empty() && interests.len() == keys.len() {
                wake = Some(interests);
                continue; // ask again, now asking the holders to notify
            }
        }
        let pause = backoff.next(wait_until, retry_after);
        tracing::trace!(?pause, "busy: waiting");
        // A release by this process wakes the head of its line (or a fair waiter, who looks at
        // its queue) at once.
        let woken = turn.is_some() || kind.woken_by_releases();
        let freed = async {
            match &line {
                Some(l) if woken => l.freed().await,
                _ => std::future::pending().await,
            }
        };
        // Polling stays the fallback: a lost notification costs one pause.
        let notified = async {
            match &wake {
                Some(interests) => {
                    let mut waits: Vec<_> =
                        interests.iter().map(|i| Box::pin(i.notified())).collect();
                    std::future::poll_fn(|cx| {
                        for w in &mut waits {
                            if w.as_mut().poll(cx).is_ready() {
                                return std::task::Poll::Ready(());
                            }
                        }
                        std::task::Poll::Pending
                    })
                    .await
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = notified => tracing::trace!("woken by release"),
            () = freed => tracing::trace!("woken by a release of this process"),
            () = tokio::time::sleep(pause) => {}
        }
    }
}
