//! The one JSON schema of `--json` (documented in `docs/cli.md`): every command's object is
//! built from these types, so a lock row reads the same in `list`, `show` and `watch`.
//! serde_json writes the strings, escaping every control character of a key or label.

use dblock::{LockInfo, LockKind, MigrationStatus, Outcome, Waiter};
use serde::Serialize;

use crate::time::rfc3339;

/// One row: a lock, a read-held key or a semaphore's permit.
#[derive(Serialize)]
pub struct Lock {
    pub key: String,
    pub kind: Kind,
    pub held: bool,
    pub owner: Option<String>,
    pub holder: Option<String>,
    pub hold_count: u32,
    pub fencing_token: u64,
    /// While held, the lease end; when free, when it was freed.
    pub expires_at: String,
    /// Lease left in seconds (millisecond precision), measured by the database; 0 when free.
    pub time_left_secs: f64,
    pub acquired_at: String,
    /// How many times the tenure's lease was extended (renewal or `extend`).
    pub renewals: u32,
    pub last_outcome: Option<&'static str>,
    pub finished_at: Option<String>,
}

/// What kind of hold a row is: `{"type": "lock"}`, `{"type": "read", "writer_waiting": false}`,
/// `{"type": "permit", "slot": 0, "permits": 3}` (`"other"` for a kind this tool does not know).
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Kind {
    Lock,
    Read { writer_waiting: bool },
    Permit { slot: u32, permits: u32 },
    Other,
}

/// `"succeeded"`, `"failed"` or `"dropped"`.
pub fn outcome(o: Outcome) -> &'static str {
    match o {
        Outcome::Succeeded => "succeeded",
        Outcome::Failed => "failed",
        Outcome::Dropped => "dropped",
    }
}

impl From<&LockInfo> for Lock {
    fn from(r: &LockInfo) -> Self {
        Lock {
            key: r.key.clone(),
            kind: match r.kind {
                LockKind::Lock => Kind::Lock,
                LockKind::Read { writer_waiting } => Kind::Read { writer_waiting },
                LockKind::Permit { slot, permits } => Kind::Permit { slot, permits },
                _ => Kind::Other,
            },
            held: r.held,
            owner: r.owner.clone(),
            holder: r.holder.clone(),
            hold_count: r.hold_count,
            fencing_token: r.fencing_token,
            expires_at: rfc3339(r.expires_at),
            time_left_secs: secs(r.time_left),
            acquired_at: rfc3339(r.acquired_at),
            renewals: r.renewals,
            last_outcome: r.last_outcome.map(outcome),
            finished_at: r.finished_at.map(rfc3339),
        }
    }
}

/// A fair waiter's ticket.
#[derive(Serialize)]
pub struct Queued {
    pub key: String,
    pub ticket: u64,
    pub owner: String,
    pub expires_at: String,
    pub time_left_secs: f64,
}

impl From<&Waiter> for Queued {
    fn from(w: &Waiter) -> Self {
        Queued {
            key: w.key.clone(),
            ticket: w.ticket,
            owner: w.owner.clone(),
            expires_at: rfc3339(w.expires_at),
            time_left_secs: secs(w.time_left),
        }
    }
}

/// `list`.
#[derive(Serialize)]
pub struct List {
    pub table: String,
    pub locks: Vec<Lock>,
}

/// `show KEY`: the key's lock row (`null` if none) and the live permits of its semaphore.
#[derive(Serialize)]
pub struct Show {
    pub table: String,
    pub key: String,
    pub lock: Option<Lock>,
    pub permits: Vec<Lock>,
}

/// `migrate status`.
#[derive(Serialize)]
pub struct Status {
    pub table: String,
    pub backend: &'static str,
    pub migrations: Vec<Migration>,
}

#[derive(Serialize)]
pub struct Migration {
    pub version: u32,
    pub name: &'static str,
    pub applied: bool,
}

impl From<&MigrationStatus> for Migration {
    fn from(m: &MigrationStatus) -> Self {
        Migration {
            version: m.version,
            name: m.name,
            applied: m.applied,
        }
    }
}

/// One line of `watch --json`: a snapshot.
#[derive(Serialize)]
pub struct Snapshot {
    pub table: String,
    /// When it was read (this machine's clock).
    pub at: String,
    pub locks: Vec<Lock>,
    pub waiters: Vec<Queued>,
}

/// Seconds with millisecond precision.
fn secs(d: std::time::Duration) -> f64 {
    d.as_millis() as f64 / 1000.0
}

/// `value` as one line of JSON on stdout.
pub fn print(value: &impl Serialize) {
    match serde_json::to_string(value) {
        Ok(line) => crate::emit(&(line + "\n")),
        // Only a failing `Serialize` impl could get here; these types have none.
        Err(e) => eprintln!("dblock: error: cannot encode JSON: {e}"),
    }
}
