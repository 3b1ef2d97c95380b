//! Shared (read) locks: the readers' statements and the writer's intent, as statement values
//! ([`Statement`]); each backend's SQL is in its `read.rs` (`postgres/`, `mysql/`, `sqlite/`).
//!
//! **The table model.** Readers and the writer of a key meet on the key's one row of the lock
//! table, so that every decision is the row's own (no check across rows, no write skew):
//! - the writer is the plain lock (`Locker::lock`), unchanged: it takes the row when its lease
//!   has ended or it is free;
//! - readers hold the row together: `owner` is the marker [`READERS`] (never an owner id),
//!   `expires_at` the latest of their leases, `hold_count` how many read holds, `readers` their
//!   ids (`,id,id,`), `fencing_token` the read tenure (a new one each time a read phase starts).
//!   To the writer's statement the row is simply held by someone else until the last reader
//!   leaves (or every reader's lease has ended);
//! - a reader takes a hold by adding its id to a live read phase, or by starting one on a free
//!   row; it gives it back by removing its id (the last one frees the row). Ids make resends
//!   exact: a resend after a lost reply finds its id there (acquire) or gone (release);
//! - **the writer's intent**: a writer that finds the row read-held records itself on it
//!   (`intent_owner`, `intent_until` — a short lease it renews while it waits — and
//!   `intent_token`, the read tenure it waits behind). While that intent is live, new readers
//!   are refused (re-entries by an owner already reading are not: it would wait on itself), so
//!   the phase drains and the writer gets the key. An intent of an older tenure is void: once
//!   the writer has taken the key, readers after it are not held back by it.

use std::time::Duration;

use super::{Arg, Grant, Outcome, Statement};

pub(crate) use crate::info::READERS;

/// One reader's attempt: join the live read phase of `key`, or start one on a free row.
pub(crate) struct ReadAcquire<'a> {
    pub key: &'a str,
    pub holder: &'a str,
    pub ttl_us: i64,
    /// The hold's id (its call's attempt id): kept among the row's readers, so that a resend
    /// after a lost reply finds itself there instead of counting twice.
    pub id: i64,
    /// The read tenure this owner already reads in (as the process tracks it): a re-entry,
    /// which a waiting writer's intent does not hold back.
    pub reentry: Option<i64>,
    /// PostgreSQL: a waiter whose LISTEN is in place asks the writer's release to NOTIFY.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub waiting: bool,
}

/// What a reader's attempt came to.
#[derive(Debug)]
pub(crate) enum ReadAttempt {
    /// A read hold: the read tenure, the readers' count and the phase's lease end.
    Granted(Grant),
    /// A writer holds the key, or waits for it (its intent); `retry_after`: what is left of the
    /// holder's lease, where the backend reports it.
    Busy { retry_after: Option<Duration> },
}

/// One reader's release: its id leaves the readers of the read tenure `token`.
pub(crate) struct ReadRelease<'a> {
    pub key: &'a str,
    pub token: i64,
    pub id: i64,
    /// Recorded as the key's last outcome when this release ends the read phase.
    pub outcome: Option<Outcome>,
}

/// What a reader's release did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ReadReleased {
    /// The last reader left: the key is free.
    Free,
    /// Other read holds remain (how many).
    StillHeld(u32),
    /// The read phase is live but the id is not among its readers: released before (a resend
    /// after a lost reply).
    Gone,
    /// The read tenure is over (its leases ran out, or the key was force-released).
    NotHeld,
}

/// A waiting writer's intent on `key` (see the module docs): `true` when the writer now holds
/// the key's intent, `false` when the row is not read-held or another writer's intent is live.
pub(crate) struct Intent<'a> {
    pub key: &'a str,
    pub owner: &'a str,
    pub lease_us: i64,
}

/// A writer that gives up withdraws its intent.
pub(crate) struct Withdraw<'a> {
    pub key: &'a str,
    pub owner: &'a str,
}

impl Statement for ReadAcquire<'_> {
    type Output = ReadAttempt;
}

impl Statement for ReadRelease<'_> {
    type Output = ReadReleased;
    const ON_RELEASE_POOL: bool = true;
}

impl Statement for Intent<'_> {
    type Output = bool;
}

impl Statement for Withdraw<'_> {
    type Output = ();
}

// Each statement's values, as every backend's text numbers them (`$n` is the n-th); times in
// µs (int8), which a backend of coarser time converts in its text. A backend's own values
// (PostgreSQL's NOTIFY channel, say) follow them.

impl ReadAcquire<'_> {
    /// `$1` key, `$2` holder, `$3` ttl, `$4` the hold's id, `$5` the read tenure re-entered.
    pub(crate) fn args(&self) -> Vec<Arg<'_>> {
        vec![
            Arg::Text(self.key),
            Arg::Text(self.holder),
            Arg::Int8(self.ttl_us),
            Arg::Int8(self.id),
            Arg::OptInt8(self.reentry),
        ]
    }
}

impl ReadRelease<'_> {
    /// `$1` key, `$2` read tenure, `$3` the hold's id, `$4` outcome code (int2, or NULL).
    pub(crate) fn args(&self) -> Vec<Arg<'_>> {
        vec![
            Arg::Text(self.key),
            Arg::Int8(self.token),
            Arg::Int8(self.id),
            Arg::OptInt2(self.outcome.map(Outcome::code)),
        ]
    }
}

impl Intent<'_> {
    /// `$1` key, `$2` the writer's owner, `$3` the intent's lease.
    pub(crate) fn args(&self) -> [Arg<'_>; 3] {
        [
            Arg::Text(self.key),
            Arg::Text(self.owner),
            Arg::Int8(self.lease_us),
        ]
    }
}

impl Withdraw<'_> {
    /// `$1` key, `$2` the writer's owner.
    pub(crate) fn args(&self) -> [Arg<'_>; 2] {
        [Arg::Text(self.key), Arg::Text(self.owner)]
    }
}
