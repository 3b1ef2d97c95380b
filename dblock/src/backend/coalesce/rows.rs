//! The kinds of row that travel together (acquire, release, extend; SQLite's writes of every
//! kind in one transaction), each with the statement that carries a batch of them.

use tokio::time::Instant;

use super::{Acquire, Attempt, Backend, Extend, Extended, Extension, HoldRef, Released, RenewItem};
use crate::info::Outcome;
use crate::retry::Failed;

use super::Row;

/// A queued row's strings, copied in one allocation (a queued row outlives its caller's
/// borrow): `N` strings end to end, and where each ends.
#[derive(Debug, Clone)]
pub(crate) struct Texts<const N: usize> {
    all: Box<str>,
    ends: [usize; N],
}

impl<const N: usize> Texts<N> {
    pub(crate) fn new(parts: [&str; N]) -> Self {
        let mut all = String::with_capacity(parts.iter().map(|p| p.len()).sum());
        let mut ends = [0; N];
        for (end, part) in ends.iter_mut().zip(parts) {
            all.push_str(part);
            *end = all.len();
        }
        Texts {
            all: all.into_boxed_str(),
            ends,
        }
    }

    /// The `i`th string.
    fn get(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.all[start..self.ends[i]]
    }
}

/// An acquire's values, owned (a queued row outlives its caller's borrow).
#[derive(Debug, Clone)]
pub(crate) struct AcquireRow {
    /// Key, owner, holder.
    texts: Texts<3>,
    pub(crate) ttl_us: i64,
    pub(crate) attempt: i64,
    pub(crate) tenure: Option<i64>,
    pub(crate) held: u32,
    pub(crate) min_hold_us: i64,
    pub(crate) once: bool,
}

impl From<&Acquire<'_>> for AcquireRow {
    fn from(a: &Acquire<'_>) -> Self {
        AcquireRow {
            texts: Texts::new([a.key, a.owner, a.holder]),
            ttl_us: a.ttl_us,
            attempt: a.attempt,
            tenure: a.tenure,
            held: a.held,
            min_hold_us: a.min_hold_us,
            once: a.once,
        }
    }
}

impl AcquireRow {
    pub(crate) fn as_acquire(&self) -> Acquire<'_> {
        Acquire {
            key: self.texts.get(0),
            owner: self.texts.get(1),
            ttl_us: self.ttl_us,
            holder: self.texts.get(2),
            attempt: self.attempt,
            waiting: false,
            tenure: self.tenure,
            held: self.held,
            min_hold_us: self.min_hold_us,
            once: self.once,
        }
    }
}

impl Row for AcquireRow {
    type Out = Attempt;
    type To = Backend;

    fn key(&self) -> &str {
        self.texts.get(0)
    }

    async fn send(
        backend: &Backend,
        rows: &[Self],
        deadline: Instant,
    ) -> Result<Vec<Attempt>, Failed> {
        let all: Vec<Acquire<'_>> = rows.iter().map(AcquireRow::as_acquire).collect();
        backend.acquire_batch(&all, deadline).await
    }
}

/// A release's values, owned.
#[derive(Debug, Clone)]
pub(crate) struct ReleaseRow {
    /// Key, owner.
    texts: Texts<2>,
    pub(crate) fencing_token: u64,
    pub(crate) remaining: u32,
    pub(crate) outcome: Option<Outcome>,
    pub(crate) release_id: i64,
}

impl ReleaseRow {
    /// The row as its one-row statement.
    pub(crate) fn statement(&self) -> crate::backend::Release<'_> {
        crate::backend::Release {
            hold: self.hold(),
            remaining: self.remaining,
            outcome: self.outcome,
            release_id: self.release_id,
        }
    }

    /// The release of `h` that leaves `remaining` holds, recording `outcome`, by `release_id`.
    pub(crate) fn new(
        h: &HoldRef<'_>,
        remaining: u32,
        outcome: Option<Outcome>,
        release_id: i64,
    ) -> Self {
        ReleaseRow {
            texts: Texts::new([h.key, h.owner]),
            fencing_token: h.fencing_token,
            remaining,
            outcome,
            release_id,
        }
    }

    pub(crate) fn key(&self) -> &str {
        self.texts.get(0)
    }

    pub(crate) fn owner(&self) -> &str {
        self.texts.get(1)
    }

    pub(crate) fn hold(&self) -> HoldRef<'_> {
        HoldRef {
            key: self.key(),
            owner: self.owner(),
            fencing_token: self.fencing_token,
        }
    }
}

impl Row for ReleaseRow {
    type Out = Released;
    type To = Backend;

    fn key(&self) -> &str {
        ReleaseRow::key(self)
    }

    async fn send(
        backend: &Backend,
        rows: &[Self],
        deadline: Instant,
    ) -> Result<Vec<Released>, Failed> {
        backend.release_batch(rows, deadline).await
    }
}

/// An extension's values, owned.
#[derive(Debug, Clone)]
pub(crate) struct ExtendRow {
    /// Key, owner.
    texts: Texts<2>,
    pub(crate) fencing_token: u64,
    pub(crate) ttl_us: i64,
    pub(crate) max_hold_us: i64,
}

impl ExtendRow {
    /// The extension `e`, owned.
    pub(crate) fn new(e: &Extend<'_>) -> Self {
        ExtendRow {
            texts: Texts::new([e.hold.key, e.hold.owner]),
            fencing_token: e.hold.fencing_token,
            ttl_us: e.ttl_us,
            max_hold_us: e.max_hold_us,
        }
    }

    pub(crate) fn key(&self) -> &str {
        self.texts.get(0)
    }

    pub(crate) fn owner(&self) -> &str {
        self.texts.get(1)
    }
}

impl Row for ExtendRow {
    type Out = Extension;
    type To = Backend;

    fn key(&self) -> &str {
        ExtendRow::key(self)
    }

    async fn send(
        backend: &Backend,
        rows: &[Self],
        deadline: Instant,
    ) -> Result<Vec<Self::Out>, Failed> {
        if let [one] = rows {
            let h = HoldRef {
                key: one.key(),
                owner: one.owner(),
                fencing_token: one.fencing_token,
            };
            let one = Extend {
                hold: h,
                ttl_us: one.ttl_us,
                max_hold_us: one.max_hold_us,
            };
            return Ok(vec![Extension::of(backend.run(&one, deadline).await?)]);
        }
        let items: Vec<RenewItem<'_>> = rows.iter().map(ExtendRow::item).collect();
        let extended = backend.extend_many(&items, deadline).await?;
        Ok(ExtendRow::answers(rows.iter(), &extended))
    }
}

impl ExtendRow {
    pub(crate) fn item(&self) -> RenewItem<'_> {
        RenewItem {
            key: self.key(),
            owner: self.owner(),
            fencing_token: self.fencing_token,
            ttl_us: self.ttl_us,
            max_hold_us: self.max_hold_us,
        }
    }

    /// Each row's answer from the holds a statement `extended`.
    fn answers<'a>(
        rows: impl Iterator<Item = &'a ExtendRow>,
        extended: &Extended,
    ) -> Vec<Extension> {
        let live: std::collections::HashSet<(&str, &str, u64)> = extended
            .iter()
            .map(|(k, o, t)| (k.as_str(), o.as_str(), *t))
            .collect();
        rows.map(|r| {
            if live.contains(&(r.key(), r.owner(), r.fencing_token)) {
                Extension::Extended(None)
            } else {
                Extension::NotHeld
            }
        })
        .collect()
    }
}

/// A row of any kind, where statements of every kind share one transaction
/// ([`Backend::coalesce_kinds_together`]). Each kind is still one statement of its own rows; the
/// transaction gives them one commit (on SQLite, one WAL flush), and the lane one key per
/// statement across kinds.
#[derive(Debug)]
pub(crate) enum WriteRow {
    Acquire(AcquireRow),
    Release(ReleaseRow),
    Extend(ExtendRow),
}

/// A [`WriteRow`]'s answer: its kind's.
#[derive(Debug)]
pub(crate) enum WriteOut {
    Acquire(Attempt),
    Release(Released),
    Extend(Extension),
}

impl WriteOut {
    pub(super) fn attempt(self) -> Result<Attempt, Failed> {
        match self {
            WriteOut::Acquire(attempt) => Ok(attempt),
            _ => Err(mismatched()),
        }
    }

    pub(super) fn released(self) -> Result<Released, Failed> {
        match self {
            WriteOut::Release(released) => Ok(released),
            _ => Err(mismatched()),
        }
    }

    pub(super) fn extended(self) -> Result<Extension, Failed> {
        match self {
            WriteOut::Extend(extended) => Ok(extended),
            _ => Err(mismatched()),
        }
    }
}

/// An answer of another kind than its row's: never (the answers follow the rows), and an error
/// of unknown outcome if it were.
fn mismatched() -> Failed {
    Failed {
        error: sqlx::Error::Protocol("a coalesced row got an answer of another kind".into()),
        sent: true,
        class: None,
    }
}

impl Row for WriteRow {
    type Out = WriteOut;
    type To = Backend;

    /// A lazily durable release leads ([`Backend::releases_lead`]): a statement of releases
    /// alone commits on connections that do not flush the log, where a transaction beside an
    /// acquire waits for the acquire's flush. Under load a lane of one slot then sends the
    /// releases of the holders a statement of acquires answered, and the acquires their
    /// callers send next travel together: the owners fall into step, and a flush serves every
    /// acquire rather than half of them.
    fn leads(&self, to: &Backend) -> bool {
        matches!(self, WriteRow::Release(_)) && to.releases_lead()
    }

    fn key(&self) -> &str {
        match self {
            WriteRow::Acquire(a) => a.key(),
            WriteRow::Release(r) => r.key(),
            WriteRow::Extend(e) => e.key(),
        }
    }

    async fn send(
        backend: &Backend,
        rows: &[Self],
        deadline: Instant,
    ) -> Result<Vec<WriteOut>, Failed> {
        let mut acquires = Vec::new();
        let mut releases = Vec::new();
        let mut extends = Vec::new();
        for row in rows {
            match row {
                WriteRow::Acquire(a) => acquires.push(a.as_acquire()),
                WriteRow::Release(r) => releases.push(r.clone()),
                WriteRow::Extend(e) => extends.push(e),
            }
        }
        let items: Vec<RenewItem<'_>> = extends.iter().map(|e| e.item()).collect();
        let (attempts, released, extended) = backend
            .write_batch(&acquires, &releases, &items, deadline)
            .await?;
        let mut attempts = attempts.into_iter();
        let mut released = released.into_iter();
        let mut extended = ExtendRow::answers(extends.into_iter(), &extended).into_iter();
        rows.iter()
            .map(|row| {
                let out = match row {
                    WriteRow::Acquire(_) => attempts.next().map(WriteOut::Acquire),
                    WriteRow::Release(_) => released.next().map(WriteOut::Release),
                    WriteRow::Extend(_) => extended.next().map(WriteOut::Extend),
                };
                out.ok_or_else(mismatched)
            })
            .collect()
    }
}

/// Coalesced acquires of distinct keys by any owners (sorted by key), each decided on its own
/// as its one-row statement would be: one attempt per row, in their order.
pub(crate) struct AcquireBatch<'a>(pub &'a [Acquire<'a>]);

impl crate::backend::Statement for AcquireBatch<'_> {
    type Output = Vec<Attempt>;
}

/// Coalesced releases of distinct keys by any owners (sorted by key), each decided on its own
/// as its one-row statement would be: one answer per row, in their order.
pub(crate) struct ReleaseBatch<'a>(pub &'a [ReleaseRow]);

impl crate::backend::Statement for ReleaseBatch<'_> {
    type Output = Vec<Released>;
    const ON_RELEASE_POOL: bool = true;
}

/// A batch is its rows: each backend's batch functions take the slice (`runs!`).
macro_rules! rows_of {
    ($($batch:ident => $row:ty),+) => {$(
        impl<'a> std::ops::Deref for $batch<'a> {
            type Target = [$row];
            fn deref(&self) -> &[$row] {
                self.0
            }
        }
    )+};
}
rows_of!(AcquireBatch => Acquire<'a>, ReleaseBatch => ReleaseRow);
