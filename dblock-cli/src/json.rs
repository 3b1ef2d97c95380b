//! The one JSON schema of `--json` (documented in `docs/cli.md`): every command's object is
//! built from these types, so a lock row reads the same in `list`, `show` and `watch`.
//! serde_json writes the strings and escapes the C0 controls of a key or label; [`encode`]
//! escapes the rest of what the tables escape (DEL, C1, bidi and invisible characters) as
//! `\uXXXX`, so that no JSON line can drive a terminal either, and every string reads back exactly.

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

/// `value` as one line of JSON, with every character the tables escape written `\uXXXX`
/// (a surrogate pair above U+FFFF): serde_json escapes only the C0 controls, and DEL, the C1
/// controls (CSI is U+009B) and the bidirectional overrides would reach the terminal raw.
/// Outside strings the JSON is ASCII, so every such character is inside one.
pub fn encode(value: &impl Serialize) -> serde_json::Result<String> {
    let line = serde_json::to_string(value)?;
    if line.bytes().all(|b| b.is_ascii() && b != 0x7f) {
        return Ok(line);
    }
    let mut out = String::with_capacity(line.len() + 16);
    for c in line.chars() {
        let mut buf = [0u8; 4];
        let text = c.encode_utf8(&mut buf);
        if (c == '\u{7f}' || !c.is_ascii()) && dblock::Escaped(text).to_string() != *text {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        } else {
            out.push(c);
        }
    }
    Ok(out)
}

/// `value` as one line of JSON on stdout.
pub fn print(value: &impl Serialize) {
    match encode(value) {
        Ok(line) => crate::emit(&(line + "\n")),
        // Only a failing `Serialize` impl could get here; these types have none.
        Err(e) => crate::say(&format!("dblock: error: cannot encode JSON: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_terminal_would_obey_is_escaped_and_reads_back() {
        let evil = "a\u{7f}b\u{9b}31m\u{202e}c\u{200b}\u{e0041}\u{1b}é日\\\"";
        let line = encode(&[evil]).unwrap();
        assert_eq!(
            line,
            r#"["a\u007fb\u009b31m\u202ec\u200b\udb40\udc41\u001bé日\\\""]"#
        );
        let back: Vec<String> = serde_json::from_str(&line).unwrap();
        assert_eq!(back, [evil]);
    }
}
