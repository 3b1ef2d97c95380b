//! Counting semaphores: [`Locker::semaphore`](crate::Locker::semaphore) and
//! [`SemaphoreRequest`].
//!
//! **The table model.** A semaphore of `n` permits on key `k` is `n` permit *slots*, each one
//! an ordinary lock row in the lock table's companion `<table>_permits` (a lock table of its own,
//! created by `migrate`), keyed `k ␟ n.i` (`␟` is the unit separator, `\x1f`; `i` in `0..n`;
//! a key longer than 233 bytes stands there as a name of its own: [`rows_name`]).
//! A permit is a lock on one slot, taken with the lock's own acquire statement, so every lease
//! property of a lock holds for each permit with no statement of its own: owner, ttl, renewal,
//! a fencing token that strictly increases per slot, an outcome when it ends, the grant only
//! returned live, unknown outcomes never counted twice, release ids, `fence`/`succeed_in`.
//!
//! **Why at most `n` hold at once.** Each slot is exclusive (the lock statement's argument), and
//! a call only ever takes slots `0..n` of its own `n`; so `n` slots, `n` holders. Nothing
//! depends on a check across rows, so there is no write skew to guard against: the read that
//! picks a free slot only steers the attempt (a stale read costs a busy attempt, never a grant).
//! The number of permits is part of the slot's key, and the read refuses a call whose `n`
//! differs from that of a live slot ([`LockError::PermitsMismatch`]): two numbers for one key
//! would otherwise add up (a call of 3 and a call of 5 could have 5 + 3 - 3 holders). The read
//! and the take are two statements: a call of another `n` that reads just before the first
//! slot of this `n` is taken can still get in once; from then on each sees the other's slots.
//!
//! **Cost.** A first permit is one read (the live slots of the key, one index range) and one
//! acquire statement; re-entry by the same owner is the acquire alone (it takes the same slot
//! again, counted). A release and each renewal are the lock's.

use std::sync::Arc;

use tokio::time::Instant;
use tracing::Instrument;

use crate::backend::semaphore::FlagSlots;
use crate::backend::Backend;
use crate::error::LockError;
use crate::guard::LockGuard;
use crate::info::{LockInfo, LockKind};
use crate::options::{LockOptions, Options};
use crate::owner::Owner;
use crate::request::LockRequest;
use crate::shared::Shared;
use crate::validate;
use crate::wait::{self, Busy, Kind, Seen, Try};
use std::time::Duration;

/// A semaphore permit's metrics label (`kind="permit"`).
const METRIC: crate::meter::Kind = crate::meter::Kind::named("permit");

/// This kind's entry point.
impl crate::Locker {
    /// A counting semaphore on `key` with `permits` permits: at most that many holders at once,
    /// across processes. `.await` the request for a permit (a [`LockGuard`](crate::LockGuard));
    /// each permit is a lease of its own (owner, ttl, renewal, its own fencing token). Every call
    /// on one key must ask for the same number of permits ([`LockError::PermitsMismatch`]
    /// otherwise). Semaphore keys live apart from lock keys (`lock("k")` and `semaphore("k", 3)`
    /// are unrelated) and are 1 to 255 bytes, as any key. See [`SemaphoreRequest`].
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) -> Result<(), dblock::LockError> {
    /// let permit = locker.semaphore("exports", 3).wait(std::time::Duration::from_secs(30)).await?;
    /// // ... at most 3 of these run at once ...
    /// permit.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn semaphore(&self, key: impl Into<String>, permits: u32) -> SemaphoreRequest {
        SemaphoreRequest::new(self.shared().clone(), key.into(), permits)
    }
}

/// Longest semaphore key, in bytes: 255, as any key's. A permit's row key is the semaphore's key
/// and a suffix of up to 15 bytes (`␟`, permits, `.`, slot); a key longer than 233 bytes stands
/// in its rows as its first 207 bytes at most, `␞` and 32 hex digits of its SHA-256, which the
/// operator's list of every lock (`held()`, `dblock list`) and `watch` show for such a key.
pub const MAX_SEMAPHORE_KEY_LEN: usize = validate::MAX_KEY_LEN;
/// Semaphore keys up to this long name their slots' rows themselves (the longest slot suffix,
/// `␟1000000.999999`, is 15 bytes).
const PLAIN_NAME_MAX: usize = 233;
/// A longer key's rows are named by its first bytes, at most this many.
const NAME_PREFIX_MAX: usize = 207;
/// Most permits one semaphore can have. The cost of a call follows the live holders, not this
/// number; the cap keeps a mistaken `u32::MAX` a clear error.
pub const MAX_PERMITS: u32 = 1_000_000;
/// Free slots tried per read before the live slots are read again.
const TRIES_PER_READ: usize = 3;
/// Up to this many permits, a waiter on PostgreSQL listens for a release of each (beyond, it
/// polls: a semaphore that large frees a permit often anyway).
const MAX_LISTENED_SLOTS: usize = 64;

/// One `locker.semaphore(key, permits)` call being configured; `.await` it to take a permit.
/// The [`LockGuard`] it returns is the permit: release it (or drop it) to give the permit back.
///
#[cfg_attr(feature = "sqlite", doc = "```")]
#[cfg_attr(not(feature = "sqlite"), doc = "```no_run")]
/// # async fn demo() -> Result<(), dblock::LockError> {
/// use std::time::Duration;
/// let locker = dblock::Locker::connect("sqlite::memory:").await?;
/// locker.migrate().await?;
///
/// // At most 3 exports at once, across every process that shares the database.
/// let permit = locker
///     .semaphore("exports", 3)
///     .ttl(Duration::from_secs(60))
///     .wait(Duration::from_secs(30))
///     .holder("export-job")
///     .await?;
/// assert_eq!(permit.key(), "exports");
/// // ... the export ...
/// permit.release().await?;
/// # Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
/// ```
#[must_use = "a semaphore request does nothing until it is awaited"]
pub struct SemaphoreRequest {
    shared: Arc<Shared>,
    key: String,
    permits: u32,
    options: Options,
    /// `reentrant(false)`: an owner that holds a permit takes another one, not the same again.
    no_reentry: bool,
}

impl SemaphoreRequest {
    pub(crate) fn new(shared: Arc<Shared>, key: String, permits: u32) -> Self {
        SemaphoreRequest {
            shared,
            key,
            permits,
            options: Options::default(),
            no_reentry: false,
        }
    }
}

crate::options::setters!(SemaphoreRequest, "locker.semaphore(\"exports\", 3)": ttl, wait, owner, holder, metrics_key, max_hold, lock_delay, reentrant_permit);

crate::options::into_future!(SemaphoreRequest => LockGuard);

impl SemaphoreRequest {
    async fn call(self, owner: Owner) -> Result<LockGuard, LockError> {
        let span =
            crate::options::call_span!("dblock.semaphore", self, owner, permits = self.permits);
        self.acquire(owner).instrument(span).await
    }
}

/// Up to `want` slots of `0..permits` that are not in `taken`, starting from a random slot and
/// going round: callers of one semaphore spread over its free slots instead of all trying the
/// first. The cost follows the live rows (`taken`), never the number of permits.
fn free_slots(permits: u32, mut taken: Vec<u32>, want: usize) -> Vec<u32> {
    taken.sort_unstable();
    taken.dedup();
    let mut free = Vec::with_capacity(want);
    let start = fastrand::u32(..permits);
    // Slots from `start` up, then from 0 up to `start`: each run walks past the taken slots it
    // meets (a binary search says whether a slot is taken), so at most `taken.len() + want`
    // steps.
    for (from, to) in [(start, permits), (0, start)] {
        let mut slot = from;
        while slot < to && free.len() < want {
            if taken.binary_search(&slot).is_err() {
                free.push(slot);
            }
            slot += 1;
        }
    }
    free
}

/// The name a semaphore's slot rows begin with: the key itself, up to [`PLAIN_NAME_MAX`] bytes
/// (233). A longer key (up to 255 bytes, as any key) would leave its slots no room within the
/// 255 bytes of a row key, so its rows are named by its first bytes (at most
/// [`NAME_PREFIX_MAX`], cut at a character boundary), `␞` (`\x1e`) and 32 hex digits of the
/// key's SHA-256: 237 to 240 bytes, never a plain name's length, so no key's rows are another
/// key's. The operator's list of every permit shows that name; [`live`] (one key's permits)
/// shows the key.
pub(crate) fn rows_name(key: &str) -> std::borrow::Cow<'_, str> {
    use sha2::Digest;
    if key.len() <= PLAIN_NAME_MAX {
        return key.into();
    }
    let mut cut = NAME_PREFIX_MAX;
    while !key.is_char_boundary(cut) {
        cut -= 1;
    }
    let digest = sha2::Sha256::digest(key.as_bytes());
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("{}\x1e{hex}", &key[..cut]).into()
}

/// One permit slot of a semaphore: slot `slot` (of `0..permits`) of a semaphore of `permits`
/// permits, the row `<name> ␟ <permits>.<slot>` of the permits' table (`␟` is `\x1f`; the
/// name is the key's [`rows_name`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    permits: u32,
    slot: u32,
}

impl Slot {
    /// Between a semaphore's rows' name and its slot (the unit separator, `\x1f`).
    const SEPARATOR: char = '\x1f';

    /// The row key of this slot of the semaphore whose rows are named `name`.
    fn row(self, name: &str) -> String {
        format!("{name}{}{}.{}", Self::SEPARATOR, self.permits, self.slot)
    }

    /// The row keys `from..to` that hold every slot of the semaphore whose rows are named
    /// `name` (of any number of permits), and no other semaphore's: `from` ends in the
    /// separator, `to` in the byte after it.
    fn range(name: &str) -> (String, String) {
        (format!("{name}{}", Self::SEPARATOR), format!("{name}\x20"))
    }

    /// The slot a row key of the semaphore whose rows are named `name` stands for (`None`: the
    /// row is another semaphore's, or no slot at all).
    fn of_row(name: &str, row: &str) -> Option<Slot> {
        let rest = row.strip_prefix(name)?.strip_prefix(Self::SEPARATOR)?;
        let (permits, slot) = rest.split_once('.')?;
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(permits) || !digits(slot) {
            return None;
        }
        Some(Slot {
            permits: permits.parse().ok()?,
            slot: slot.parse().ok()?,
        })
    }
}

/// A row of the permits' table as the operator sees it: the semaphore's key, and which permit.
/// `None` for a row that is no slot (not written by dblock).
pub(crate) fn as_permit(mut info: LockInfo) -> Option<LockInfo> {
    let (key, kind) = permit_of(&info.key)?;
    info.key = key.to_owned();
    info.kind = kind;
    Some(info)
}

/// The semaphore's rows' name (its key, up to 233 bytes: [`rows_name`]) and the permit a row
/// key of the permits' table stands for (`None`: no slot's row).
pub(crate) fn permit_of(row: &str) -> Option<(&str, LockKind)> {
    let (key, _) = row.rsplit_once(Slot::SEPARATOR)?;
    let Slot { permits, slot } = Slot::of_row(key, row)?;
    Some((key, LockKind::Permit { slot, permits }))
}

/// The row of a live permit `owner` holds of the semaphore whose rows are named `name` (any
/// number of permits): the prefix alone would also match the rows of a semaphore whose key is
/// this one's followed by the separator.
fn own_slot(permits: &Shared, name: &str, owner: &Owner) -> Option<String> {
    permits.held_where(owner, |row| Slot::of_row(name, row).is_some())
}

/// The live permit rows of semaphore `key` (any number of permits); `None` where the permits'
/// table was never made.
async fn slot_rows(shared: &Shared, key: &str) -> Result<Option<Vec<LockInfo>>, LockError> {
    let permits = shared.permits();
    let backend = permits.backend()?;
    let name = rows_name(key);
    let (from, to) = Slot::range(&name);
    let read = crate::backend::RowsIn {
        from: &from,
        to: &to,
        taken_within_us: 0,
    };
    match permits
        .run_bounded("semaphore read", |limit| backend.run(&read, limit))
        .await
    {
        Err(e) if e.is_not_migrated() => Ok(None),
        other => Ok(Some(
            other?
                .into_iter()
                .filter(|r| Slot::of_row(&name, &r.key).is_some())
                .collect(),
        )),
    }
}

/// The live permits of semaphore `key` (any number of permits), as the operator sees them;
/// none where the permits' table was never made.
pub(crate) async fn live(shared: &Shared, key: &str) -> Result<Vec<LockInfo>, LockError> {
    let rows = slot_rows(shared, key).await?.unwrap_or_default();
    let permits = rows.into_iter().filter_map(as_permit);
    Ok(permits
        .map(|p| LockInfo {
            key: key.to_owned(),
            ..p
        })
        .collect())
}

/// Every live permit of every semaphore, as the operator sees them; none where the permits'
/// table was never made.
pub(crate) async fn all_live(shared: &Shared) -> Result<Vec<LockInfo>, LockError> {
    let permits = shared.permits();
    let backend = permits.backend()?;
    match permits
        .run_bounded("held", |limit| {
            backend.run(&crate::backend::LiveRows, limit)
        })
        .await
    {
        Err(e) if e.is_not_migrated() => Ok(Vec::new()),
        other => Ok(other?.into_iter().filter_map(as_permit).collect()),
    }
}

/// Frees every live permit of semaphore `key` held by `owner` (`""`: by anyone; operator
/// action); how many.
pub(crate) async fn force_release(
    shared: &Shared,
    key: &str,
    owner: &str,
) -> Result<usize, LockError> {
    let Some(rows) = slot_rows(shared, key).await? else {
        return Ok(0);
    };
    let permits = shared.permits();
    let mut freed = 0;
    for row in &rows {
        if permits.free("force_release", &row.key, owner).await? {
            freed += 1;
        }
    }
    Ok(freed)
}

/// Purges the permits' table as [`Locker::purge`](crate::Locker::purge) does the lock table;
/// 0 where it was never made.
pub(crate) async fn purge(
    shared: &Shared,
    older_than_us: i64,
) -> Result<crate::backend::Purged, LockError> {
    let permits = shared.permits();
    let backend = permits.backend()?;
    match permits
        .run_bounded("purge", |limit| async move {
            backend
                .run(&crate::backend::Purge { older_than_us }, limit)
                .await
        })
        .await
    {
        Err(e) if e.is_not_migrated() => Ok(Default::default()),
        other => other,
    }
}

impl SemaphoreRequest {
    async fn acquire(self, owner: Owner) -> Result<LockGuard, LockError> {
        self.shared.admit(&self.key)?;
        // Its permits live in a table of their own, which the locker's purge covers: the
        // permit's guard (of the permits' copy) starts none.
        self.shared.purge_in_background();
        if !(1..=MAX_PERMITS).contains(&self.permits) {
            return Err(LockError::Config(format!(
                "semaphore `{}` asks for {} permits: a semaphore has 1 to {MAX_PERMITS}",
                crate::Escaped(&self.key),
                self.permits
            )));
        }
        validate::ttl_micros(self.options.ttl)?;
        let permits = self.shared.permits().clone();
        let name = rows_name(&self.key).into_owned();
        let (from, to) = Slot::range(&name);
        let wait = self.options.wait;
        let mut kind = PermitWait {
            backend: permits.backend()?.clone(),
            reentry: !self.no_reentry && own_slot(&permits, &name, &owner).is_some(),
            permits: permits.clone(),
            request: self,
            owner,
            name,
            from,
            to,
        };
        let mut first_busy = None;
        wait::wait_for(&mut kind, &permits, Instant::now(), wait, &mut first_busy).await
    }
}

/// One `semaphore()` call as the wait loop drives it. Its line of waiters in this process is
/// under the semaphore's key in the permits' table: only the head reads and attempts, a permit
/// given back by this process wakes it at once, and they get permits in arrival order.
struct PermitWait {
    request: SemaphoreRequest,
    /// The core on the permits' table.
    permits: Arc<Shared>,
    backend: Backend,
    owner: Owner,
    /// The name of the semaphore's slot rows ([`rows_name`]), and their range.
    name: String,
    from: String,
    to: String,
    /// The owner holds a permit already (a re-entry): it never waits in the process's line.
    reentry: bool,
}

impl PermitWait {
    /// The key of slot `slot` of this semaphore.
    fn row(&self, slot: u32) -> String {
        Slot {
            permits: self.request.permits,
            slot,
        }
        .row(&self.name)
    }

    /// The slot this owner holds, taken again (a re-entry), or `None`; else up to
    /// `TRIES_PER_READ` free slots by one read of the live ones.
    async fn take_some(&self) -> Result<Option<LockGuard>, LockError> {
        let (permits, req) = (&self.permits, &self.request);
        // One attempt of the owner's at a time on this semaphore (as on a lock's key): calls of
        // one owner at once (`join!`) see each other's permit and re-enter it, not take two.
        let _one_at_a_time =
            crate::registry::serialise(permits.space(), &self.owner, &self.name).await;
        let held = own_slot(permits, &self.name, &self.owner);
        if let Some(row) = held.filter(|_| !req.no_reentry) {
            if Slot::of_row(&self.name, &row).is_some_and(|s| s.permits == req.permits) {
                match req.take(permits, row, &self.owner).await {
                    // Another owner's now (freed by an operator, or run out, and taken): the
                    // owner's hold of it is lost (its renewal says so); a permit is looked for
                    // as on a first call.
                    Err(LockError::Busy { .. }) => {}
                    other => return other.map(Some),
                }
            }
        }
        let read = crate::backend::RowsIn {
            from: &self.from,
            to: &self.to,
            taken_within_us: 0,
        };
        let backend = &self.backend;
        let live = permits
            .run_bounded("semaphore read", |limit| backend.run(&read, limit))
            .await?;
        // The slots live rows hold: never more than the live rows, whatever `permits` is.
        let mut taken = Vec::with_capacity(live.len());
        for row in &live {
            let Some(Slot { permits: n, slot }) = Slot::of_row(&self.name, &row.key) else {
                continue;
            };
            if n != req.permits {
                return Err(LockError::PermitsMismatch {
                    key: req.key.clone(),
                    asked: req.permits,
                    in_use: n,
                });
            }
            if slot < req.permits {
                taken.push(slot);
            }
        }
        for slot in free_slots(req.permits, taken, TRIES_PER_READ) {
            match req.take(permits, self.row(slot), &self.owner).await {
                Err(LockError::Busy { .. }) => continue,
                other => return other.map(Some),
            }
        }
        Ok(None)
    }
}

impl Kind for PermitWait {
    type Grant = LockGuard;

    fn key(&self) -> &str {
        &self.request.key
    }

    fn lines_up(&self) -> bool {
        !self.reentry
    }

    fn reentry(&self) -> bool {
        self.reentry
    }

    async fn attempt(&mut self, _waiting: bool, _call_until: Instant) -> Try {
        match self.take_some().await {
            Ok(Some(guard)) => Try::Got(guard),
            Ok(None) => Try::busy(None),
            // The database unreachable for a moment: a later attempt may get past it. A grant
            // such an attempt may have made is given back in the background (the lock's
            // cancellation safety), never built upon.
            Err(e @ LockError::Database(_)) => Try::Retry(e),
            // A slot's grant that arrived when its lease could have ended (given back, as the
            // lock's): this call asks again within its wait, as a lock does.
            Err(LockError::Lost { .. }) => Try::Stale,
            Err(e) => Try::Failed(e),
        }
    }

    async fn busy(&mut self, busy: Busy) -> Result<(), LockError> {
        // PostgreSQL: the head of the line listens for a release of any slot, and asks the live
        // slots' holders to NOTIFY (again each round: a slot taken anew forgets it).
        if busy.listening {
            let keys = self.wake_keys();
            let limit = (Instant::now() + self.permits.statement_timeout).min(busy.wait_until);
            let _ = self.backend.run(&FlagSlots { keys: &keys }, limit).await;
        }
        Ok(())
    }

    fn wake_keys(&self) -> Vec<String> {
        // Beyond this many permits a waiter polls: a semaphore that large frees one often.
        if (self.request.permits as usize) <= MAX_LISTENED_SLOTS {
            (0..self.request.permits)
                .map(|slot| self.row(slot))
                .collect()
        } else {
            Vec::new()
        }
    }

    fn gave_up(&self, seen: Seen, waited: Duration) -> LockError {
        match seen {
            // As a lock and a read: no answer at all is not a busy semaphore.
            Seen::Nothing => LockError::no_answer(
                waited,
                &format!("permit of `{}`", crate::Escaped(&self.request.key)),
            ),
            Seen::Busy => LockError::Busy {
                key: self.request.key.clone(),
                waited,
            },
            // As a lock's: the last grant came when its lease could have ended.
            Seen::Stale => LockError::Lost {
                key: self.request.key.clone(),
            },
        }
    }
}

impl SemaphoreRequest {
    /// One attempt at slot row `row`, as `owner`: the lock's own acquire.
    async fn take(
        &self,
        permits: &Arc<Shared>,
        row: String,
        owner: &Owner,
    ) -> Result<LockGuard, LockError> {
        let options = Options {
            wait: std::time::Duration::ZERO,
            owner: Some(owner.clone()),
            ..self.options.clone()
        };
        // Not reentrant: a slot this owner holds is busy to it (the read already leaves the
        // live slots out; this makes it exact against a slot taken since).
        let lock = LockOptions {
            no_reentry: self.no_reentry,
            // The semaphore's call waits in the semaphore's line; a slot's attempt is in none
            // (a semaphore may be named as another's slot row, with waiters of its own).
            jumps_line: true,
            ..LockOptions::default()
        };
        let request = LockRequest::with(permits.clone(), row, options, lock);
        request.permit_of(&self.key, METRIC).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_slots_skip_the_taken_ones_and_cost_what_is_live() {
        assert_eq!(free_slots(1, vec![], 3), vec![0]);
        assert!(free_slots(3, vec![0, 1, 2], 3).is_empty());
        let mut free = free_slots(5, vec![3, 1, 1], 5);
        free.sort_unstable();
        assert_eq!(free, vec![0, 2, 4]);
        // The largest semaphore, nearly all free: three slots, none taken, at once.
        let free = free_slots(MAX_PERMITS, vec![7, 8], 3);
        assert_eq!(free.len(), 3);
        assert!(free.iter().all(|s| *s < MAX_PERMITS && *s != 7 && *s != 8));
    }

    #[test]
    fn slot_keys_are_read_back_only_for_their_own_key() {
        let row = Slot {
            permits: 3,
            slot: 2,
        }
        .row("exports");
        assert_eq!(
            Slot::of_row("exports", &row),
            Some(Slot {
                permits: 3,
                slot: 2
            })
        );
        assert_eq!(Slot::of_row("export", &row), None);
        // A key that itself contains the separator never reads as another key's slot.
        let other = Slot {
            permits: 5,
            slot: 0,
        }
        .row("exports\x1f3.2");
        assert_eq!(Slot::of_row("exports", &other), None);
        assert_eq!(
            Slot::of_row("exports\x1f3.2", &other),
            Some(Slot {
                permits: 5,
                slot: 0
            })
        );
        assert_eq!(Slot::of_row("exports", "exports\x1f3."), None);
    }

    #[test]
    fn every_key_up_to_255_bytes_has_slot_rows_that_fit_and_are_its_own() {
        let longest = |name: &str| {
            let slot = MAX_PERMITS - 1;
            Slot {
                permits: MAX_PERMITS,
                slot,
            }
            .row(name)
            .len()
        };
        // Up to 233 bytes the key names its rows, as it always has.
        let plain = "k".repeat(PLAIN_NAME_MAX);
        assert_eq!(rows_name(&plain), plain);
        assert!(longest(&plain) <= validate::MAX_KEY_LEN);
        for len in PLAIN_NAME_MAX + 1..=MAX_SEMAPHORE_KEY_LEN {
            for unit in ["k", "é", "€", "😀"] {
                let key = unit.repeat(len.div_ceil(unit.len()));
                let key = &key[..key.floor_char_boundary(len)];
                let name = rows_name(key);
                if key.len() <= PLAIN_NAME_MAX {
                    assert_eq!(name, key);
                } else {
                    let len = name.len();
                    assert!((237..=240).contains(&len), "{key}: a name of {len} bytes");
                    assert!(key.starts_with(name.split('\x1e').next().unwrap()));
                }
                assert!(longest(&name) <= validate::MAX_KEY_LEN, "{len} {unit}");
            }
        }
        // Two long keys that differ only in their last byte are two semaphores.
        let (a, b) = ("k".repeat(254) + "a", "k".repeat(254) + "b");
        assert_ne!(rows_name(&a), rows_name(&b));
        let row = Slot {
            permits: 3,
            slot: 1,
        }
        .row(&rows_name(&a));
        assert_eq!(Slot::of_row(&rows_name(&b), &row), None);
        assert_eq!(permit_of(&row).map(|(name, _)| name), Some(&*rows_name(&a)));
    }
}
