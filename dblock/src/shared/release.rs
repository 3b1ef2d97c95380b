//! Giving a hold back: the release statement under the owner's serialisation, resent with its
//! release id after a lost reply, and an unknown outcome settled by the row's last release.

#[allow(unused_imports)]
use super::*;

impl Shared {
    /// Gives one hold back, recording a fresh release id in the row: a resend after a lost reply
    /// then matches nothing instead of decrementing twice, and a "not held" answer after an
    /// unknown outcome is checked (was it our release, of this tenure?) before it counts as done.
    /// Tries until `until` (past it the lease has ended anyway); the owner's statements on this
    /// key are serialised meanwhile, so no re-entry of the same owner can slip in between.
    pub(crate) async fn release(
        &self,
        hold: &Hold,
        outcome: Option<Outcome>,
        until: Instant,
    ) -> Result<Released, LockError> {
        let mut tracked = serialise(&self.space, &hold.owner, &hold.key).await;
        self.release_serialised(hold, &mut tracked, outcome, until)
            .await
    }

    /// [`release`](Self::release) with the owner's serialisation already held.
    pub(crate) async fn release_serialised(
        &self,
        hold: &Hold,
        tracked: &mut Tracked,
        outcome: Option<Outcome>,
        until: Instant,
    ) -> Result<Released, LockError> {
        if let Some(member) = hold.member() {
            // The kind's own statement (boxed by the kind: kept out of every release's future).
            let backend = self.backend()?;
            let policy = Policy::until(self.statement_timeout / 2, until);
            let giving = crate::hold::Giving {
                backend,
                hold,
                outcome,
                policy,
                statement_timeout: self.statement_timeout,
            };
            let released = member.release(giving).await;
            if matches!(released, Ok(Released::Free)) {
                crate::line::freed(&self.space, &hold.key);
            }
            return released;
        }
        let backend = self.backend()?;
        let current = tracked.tenure == Some(hold.fencing_token);
        let remaining = if current {
            tracked.holds.saturating_sub(1)
        } else {
            0
        };
        let release_id = fastrand::i64(1..i64::MAX);
        let held = hold.as_ref();
        // Half a statement time-out a send: a resend fits in what the caller waits.
        let policy = Policy::until(self.statement_timeout / 2, until);
        let statement = crate::backend::Release {
            hold: held,
            remaining,
            outcome,
            release_id,
        };
        let tried = retry::run(
            policy,
            |f| backend.classify(f),
            |limit| self.coalescer.release(backend, &statement, limit),
        )
        .await;
        if current {
            // Whatever the answer, this process no longer tracks the hold.
            tracked.holds = remaining;
            if remaining == 0 {
                tracked.tenure = None;
            }
        }
        let released = match tried.result {
            Ok(Released::NotHeld) if tried.after_unknown => {
                let took_effect = match remaining {
                    0 => Released::Free,
                    n => Released::StillHeld(n),
                };
                settle_lost_reply(
                    backend,
                    hold,
                    release_id,
                    took_effect,
                    self.statement_timeout,
                )
                .await
            }
            Ok(Released::NotHeld) => {
                if current {
                    // The tenure is over (expired and taken, or force-released): so are the
                    // other holds this process has of it.
                    tracked.holds = 0;
                    tracked.tenure = None;
                }
                Ok(Released::NotHeld)
            }
            Ok(outcome) => Ok(outcome),
            Err(f) => Err(LockError::database(f.error, tried.after_unknown, "release")),
        };
        // However it was learned (also after a lost reply), a freed key wakes this process's
        // next waiter for it.
        if matches!(released, Ok(Released::Free)) {
            crate::line::freed(&self.space, &hold.key);
            // A semaphore's permit: its waiters line up under the semaphore's key.
            if let crate::hold::HoldKind::Permit(semaphore) = &hold.kind {
                crate::line::freed(&self.space, semaphore);
            }
        }
        released
    }
}

/// A release whose reply was lost and whose resend found nothing to release (`NotHeld`): whether
/// the earlier send took effect, by the row's last release (`release_id`, of `hold`'s tenure),
/// which no acquire overwrites. `took_effect` if it did, `NotHeld` if it did not, an unknown
/// outcome if a later tenure's release has overwritten the record. Every kind's release records
/// its id so (a lock's, a read's; a permit's is a lock's). The read is bounded by
/// `statement_timeout`.
pub(crate) async fn settle_lost_reply(
    backend: &Backend,
    hold: &Hold,
    release_id: i64,
    took_effect: Released,
    statement_timeout: Duration,
) -> Result<Released, LockError> {
    let limit = Instant::now() + statement_timeout;
    let row = Box::pin(backend.run(&crate::backend::LastWriteOf(&hold.key), limit))
        .await
        .map_err(|f| LockError::database(f.error, true, "release"))?;
    match earlier_send(row, release_id, hold.fencing_token) {
        EarlierSend::TookEffect => {
            tracing::debug!(key = %crate::Escaped(&hold.key), "release after a lost reply: the earlier send took effect");
            Ok(took_effect)
        }
        EarlierSend::DidNot => Ok(Released::NotHeld),
        EarlierSend::CannotTell => Err(LockError::database(
            sqlx::Error::Io(std::io::Error::other(
                "the reply to the release was lost, and the key has since been taken and \
                 released again by others: whether this release took effect cannot be told \
                 (the lease has ended either way)",
            )),
            true,
            &format!("release of `{}`", crate::Escaped(&hold.key)),
        )),
    }
}

/// Whether a release whose reply was lost (and whose resend found nothing to release) took
/// effect, by the row's last release (id and tenure), which no acquire overwrites.
#[derive(Debug, PartialEq, Eq)]
enum EarlierSend {
    /// The row's last release is ours: it took effect (someone may have taken the key since).
    TookEffect,
    /// The last release recorded is of our tenure or an earlier one, and not ours: ours never
    /// applied; the tenure ended otherwise (its lease ran out, or it was force-released).
    DidNot,
    /// A later tenure was released since: the record of ours, if any, is overwritten.
    CannotTell,
}

fn earlier_send(row: Option<LastWrite>, release_id: i64, tenure: u64) -> EarlierSend {
    let Some(row) = row else {
        // Purged: the key was free for the purge's age, whoever freed it.
        return EarlierSend::CannotTell;
    };
    if row.release_id == Some(release_id) && row.release_token == Some(tenure as i64) {
        EarlierSend::TookEffect
    } else if row.release_token.is_none_or(|t| t <= tenure as i64) {
        EarlierSend::DidNot
    } else {
        EarlierSend::CannotTell
    }
}
