//! Lock events: [`Locker::watch`] reads the rows of a key prefix held or taken recently at an
//! interval and reports what changed between two reads, as a bounded
//! [`Stream`](futures_core::Stream).

use std::collections::BTreeMap;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use tokio::sync::mpsc;

use crate::backend::{Inspect, LastWriteOf, RowsIn};
use crate::error::LockError;
use crate::info::{LockInfo, LockKind, Outcome};
use crate::locker::Locker;
use crate::shared::Shared;
use crate::validate::MAX_TTL;

/// How often a [`Watch`] reads the rows unless told otherwise.
const DEFAULT_EVERY: Duration = Duration::from_millis(250);
/// How far back (database clock) a read looks for holds taken since the last read, beyond two
/// intervals: a read late by more than this may miss a hold that began and ended before it.
const LATE_MARGIN: Duration = Duration::from_millis(500);
/// How many events a [`Watch`] keeps for a consumer that has not read them yet.
const DEFAULT_CAPACITY: usize = 1024;
/// The most events a watch keeps for its consumer (tokio's channel takes at most
/// `usize::MAX >> 3`).
const MAX_CAPACITY: usize = 1 << 24;

/// A key's hold as an event names it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyEvent {
    /// The key.
    pub key: String,
    /// The owner of the hold (`None` for a row without one).
    pub owner: Option<String>,
    /// Its holder label (`host/pid[/label]`).
    pub holder: Option<String>,
    /// Its fencing token.
    pub fencing_token: u64,
    /// When it happened, on the database clock (for an expiry: the lease end last seen).
    pub at: SystemTime,
    /// What was held: a lock (or a leadership), a read lock (`LockKind::Read`), or one permit
    /// of the semaphore `key` (`LockKind::Permit`, its slot and number of permits).
    pub kind: LockKind,
}

/// What happened to a key, as [`Locker::watch`] saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LockEvent {
    /// A new tenure began: the key was taken (`event` is the new holder).
    Acquired(KeyEvent),
    /// The holder gave the key back (`outcome` as recorded), or an operator force-released it
    /// (`Failed`).
    Released {
        /// The hold that ended.
        event: KeyEvent,
        /// How it ended, as the row records it (`None`: not recorded, or the key changed hands
        /// again before the watch read it).
        outcome: Option<Outcome>,
    },
    /// The lease ran out without a release (a crashed or stalled holder, or a `max_hold`).
    Expired(KeyEvent),
    /// Another owner took the key while the old lease was live and its holder had not released
    /// it ([`Locker::steal`], or an operator's release followed by a take).
    Stolen {
        /// The new holder.
        event: KeyEvent,
        /// The fencing token of the tenure it ended.
        from_token: u64,
    },
    /// The consumer did not keep up: this many events were dropped before the next one.
    Lagged {
        /// How many.
        skipped: u64,
    },
}

/// A stream of [`LockEvent`]s of the keys under a prefix, made by [`Locker::watch`].
///
/// It is advisory: every interval (`every`, 250 ms by default) it reads the keys that are held
/// or were taken since the last read, and reports the differences. It starts on its first
/// poll, from the keys as they were when [`Locker::watch`] made it: a hold taken after that,
/// even before the first poll, is reported (one taken up to 20 ms before may be too). A hold that
/// began and ended between two reads is reported (acquired, then how it ended), but when a key
/// changes hands several times between two reads only the first and the last of those tenures are
/// seen (the first as [`Released`](LockEvent::Released) with outcome `None` when the row no longer
/// says how it ended), and events come in the order of the reads (by key within one read), not of
/// the database's commits. Its owner is `None` when the hold had already ended. Never use it to
/// decide who holds a lock: take the lock.
///
/// It polls on every backend, PostgreSQL included: a NOTIFY from every lock statement would
/// make every commit that sends one queue on PostgreSQL's one notification lock, whoever
/// listens (measured: 0.51–0.57× the lock/unlock throughput at 8 clients), a cost every
/// locker of the database would pay for one dashboard. A read costs one statement on the
/// rows held or taken in the last two intervals, and one on the semaphores' permits.
/// Memory stays bounded: at most `capacity` (1,024 by default) events wait for the consumer;
/// beyond that they are dropped and counted, and the next item is [`LockEvent::Lagged`]. A
/// database failure is an `Err` item, and the stream goes on. It ends after one
/// [`LockError::ShutDown`] item once the locker is [shut down](Locker::shutdown) (at once for a
/// stream made after that), and after a [`LockError::NoRuntime`] item when first polled outside
/// a tokio runtime. Semaphore permits are watched too (a second statement a read, on their own
/// table): each permit's events carry the semaphore's key and [`LockKind::Permit`].
#[must_use = "streams do nothing unless polled"]
pub struct Watch {
    shared: Arc<Shared>,
    prefix: String,
    every: Duration,
    capacity: usize,
    events: Option<mpsc::Receiver<Result<LockEvent, LockError>>>,
    /// When [`Locker::watch`] made it: the holds taken since are reported, even those taken
    /// before the stream is first polled.
    made: std::time::Instant,
}

impl fmt::Debug for Watch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watch")
            .field("prefix", &crate::Escaped(&self.prefix).to_string())
            .field("every", &self.every)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl Locker {
    /// Watches the keys that start with `prefix` (`""`: every key): a [`Stream`] of
    /// [`LockEvent`]s — acquired, released with its outcome, expired, stolen — for cache
    /// invalidation, dashboards and tests. Advisory (see [`Watch`]).
    ///
    /// [`Stream`]: futures_core::Stream
    ///
    /// ```
    /// # async fn demo(locker: dblock::Locker) {
    /// use futures::StreamExt;
    /// let mut events = locker.watch("order:").every(std::time::Duration::from_millis(100));
    /// tokio::spawn(async move {
    ///     while let Some(event) = events.next().await {
    ///         match event {
    ///             Ok(dblock::LockEvent::Acquired(e)) => {
    ///                 println!("{} taken by {:?}", dblock::Escaped(&e.key), e.holder)
    ///             }
    ///             Ok(other) => println!("{other:?}"),
    ///             Err(e) => eprintln!("watch: {e}"), // it goes on reading
    ///         }
    ///     }
    /// });
    /// # }
    /// ```
    pub fn watch(&self, prefix: impl Into<String>) -> Watch {
        Watch {
            shared: self.shared().clone(),
            prefix: prefix.into(),
            every: DEFAULT_EVERY,
            capacity: DEFAULT_CAPACITY,
            events: None,
            made: std::time::Instant::now(),
        }
    }
}

impl Watch {
    /// How often the rows are read (default 250 ms; at least 10 ms; any `Duration` up to
    /// `Duration::MAX` is accepted, a read then looking back at most 100 years).
    ///
    /// ```
    /// # fn demo(locker: dblock::Locker) {
    /// let events = locker.watch("jobs:").every(std::time::Duration::from_secs(1));
    /// # }
    /// ```
    pub fn every(mut self, every: Duration) -> Self {
        self.every = every.max(Duration::from_millis(10));
        self
    }

    /// How many events wait for a slow consumer before they are dropped and counted (default
    /// 1,024; at least 1, at most 16,777,216: a larger capacity is taken as that).
    ///
    /// ```
    /// # fn demo(locker: dblock::Locker) {
    /// let events = locker.watch("jobs:").capacity(64);
    /// # }
    /// ```
    pub fn capacity(mut self, capacity: usize) -> Self {
        self.capacity = capacity.clamp(1, MAX_CAPACITY);
        self
    }
}

impl futures_core::Stream for Watch {
    type Item = Result<LockEvent, LockError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.events.is_none() {
            // Started on the first poll, in the polling task's runtime.
            if let Err(e) = LockError::require_runtime() {
                // Yielded once; the stream is then over (a receiver with no sender).
                this.events = Some(mpsc::channel(1).1);
                return Poll::Ready(Some(Err(e)));
            }
            let (tx, rx) = mpsc::channel(this.capacity);
            let reader = |shared: Arc<Shared>, permits| Reader {
                locker: Locker::from_shared(shared),
                prefix: this.prefix.clone(),
                permits,
            };
            let readers = [
                reader(this.shared.clone(), false),
                reader(this.shared.permits().clone(), true),
            ];
            let out = Out { tx, skipped: 0 };
            tokio::spawn(run(readers, this.every, out, this.made));
            this.events = Some(rx);
        }
        match this.events.as_mut() {
            Some(events) => events.poll_recv(cx),
            None => Poll::Ready(None),
        }
    }
}

/// The window of a read every `every`: the holds taken since the last read, and then some (at
/// most the longest lease there can be, [`MAX_TTL`], so that any `every` makes a window every
/// database can subtract).
fn window(every: Duration) -> Duration {
    every
        .saturating_mul(2)
        .saturating_add(LATE_MARGIN)
        .min(MAX_TTL)
}

/// The first read's baseline: its rows as they stood when the watch was made, `since` ago —
/// those taken since (on the database clock, with a margin for its rounding) are left out, so
/// that they are reported. The database's time is read from a held row's lease (`expires_at`
/// less `time_left`, both the database's), the machine's clock when no row is held.
fn as_made(now: &BTreeMap<String, LockInfo>, since: Duration) -> BTreeMap<String, LockInfo> {
    let db_now = now
        .values()
        .filter(|r| r.held)
        .filter_map(|r| r.expires_at.checked_sub(r.time_left))
        .max()
        .unwrap_or_else(SystemTime::now);
    let made = db_now
        .checked_sub(since.saturating_add(MADE_MARGIN))
        .unwrap_or(SystemTime::UNIX_EPOCH);
    now.iter()
        .filter(|(_, r)| r.acquired_at < made)
        .map(|(k, r)| (k.clone(), r.clone()))
        .collect()
}

/// How much earlier than the watch's making a hold may begin and still be reported by the
/// first read (the database's timestamps are rounded to the millisecond on SQLite).
const MADE_MARGIN: Duration = Duration::from_millis(20);

/// The consumer's end of the channel, and what it missed.
struct Out {
    tx: mpsc::Sender<Result<LockEvent, LockError>>,
    skipped: u64,
}

impl Out {
    /// Tells the consumer how many items it missed, once there is room; `false` while there
    /// is none (or the consumer is gone).
    fn flush(&mut self) -> bool {
        if self.skipped == 0 {
            return true;
        }
        let lagged = LockEvent::Lagged {
            skipped: self.skipped,
        };
        let sent = self.tx.try_send(Ok(lagged)).is_ok();
        if sent {
            self.skipped = 0;
        }
        sent
    }

    /// The last item, after a shutdown: what was missed, then why the stream ends, each given
    /// up to a second for room (a consumer that lags still learns why).
    async fn finish(mut self, e: LockError) {
        let room = Duration::from_secs(1);
        if self.skipped > 0 {
            let lagged = LockEvent::Lagged {
                skipped: std::mem::take(&mut self.skipped),
            };
            let _ = tokio::time::timeout(room, self.tx.send(Ok(lagged))).await;
        }
        let _ = tokio::time::timeout(room, self.tx.send(Err(e))).await;
    }

    /// Hands an item over, or counts it dropped; `false` once the consumer is gone.
    fn send(&mut self, item: Result<LockEvent, LockError>) -> bool {
        if !self.flush() {
            if self.tx.is_closed() {
                return false;
            }
            self.skipped += 1;
            return true;
        }
        match self.tx.try_send(item) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.skipped += 1;
                true
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }
}

/// Reads the watched rows of one table: the locks', or the semaphores' permits'.
struct Reader {
    locker: Locker,
    prefix: String,
    /// The permits' table: its rows are slots, reported as their semaphore's key.
    permits: bool,
}

/// The watch's task: a read every `every`, the differences to `out`, until the consumer is
/// gone or the locker shut down.
async fn run(readers: [Reader; 2], every: Duration, mut out: Out, made: std::time::Instant) {
    let mut lasts: [Option<BTreeMap<String, LockInfo>>; 2] = [None, None];
    loop {
        for (reader, last) in readers.iter().zip(&mut lasts) {
            if out.tx.is_closed() {
                return;
            }
            out.flush();
            // The first read looks back to when `watch()` made the stream, however late it is
            // polled: a hold taken and given back since is reported.
            let span = match last {
                Some(_) => window(every),
                None => window(every)
                    .max(made.elapsed().saturating_add(LATE_MARGIN))
                    .min(MAX_TTL),
            };
            match reader.rows(span).await {
                Err(e @ LockError::ShutDown) => return out.finish(e).await,
                Err(e) => {
                    // A locker that cannot send anything (an invalid table name) fails alike on
                    // both tables: said once a round.
                    let whole = matches!(e, LockError::Config(_));
                    if !out.send(Err(e)) {
                        return;
                    }
                    if whole {
                        break;
                    }
                }
                Ok(mut now) => {
                    let before = last.take().unwrap_or_else(|| as_made(&now, made.elapsed()));
                    match reader.changes(&before, &mut now).await {
                        Ok(events) => {
                            for e in events {
                                if !out.send(Ok(e)) {
                                    return;
                                }
                            }
                        }
                        Err(e @ LockError::ShutDown) => return out.finish(e).await,
                        Err(e) => {
                            if !out.send(Err(e)) {
                                return;
                            }
                        }
                    }
                    *last = Some(now);
                }
            }
        }
        tokio::time::sleep(every).await;
    }
}

impl Reader {
    /// The rows under the prefix that are held, or were taken within `window` (database clock),
    /// by key.
    async fn rows(&self, window: Duration) -> Result<BTreeMap<String, LockInfo>, LockError> {
        let shared = self.locker.shared();
        shared.check_open()?;
        let backend = shared.backend()?;
        // Every key is at most 255 bytes, each character at most U+10FFFF: this bound is above
        // every key with the prefix.
        let to = format!("{}{}", self.prefix, "\u{10FFFF}".repeat(64));
        let read = RowsIn {
            from: &self.prefix,
            to: &to,
            taken_within_us: i64::try_from(window.as_micros()).unwrap_or(i64::MAX),
        };
        let rows = match shared
            .run_bounded("watch", |limit| backend.run(&read, limit))
            .await
        {
            // No semaphore was ever used on this table: nothing to watch there.
            Err(e) if self.permits && e.is_not_migrated() => Vec::new(),
            other => other?,
        };
        Ok(rows
            .into_iter()
            .filter(|r| r.key.starts_with(self.prefix.as_str()))
            .map(|r| (r.key.clone(), r))
            .collect())
    }

    async fn row(&self, key: &str) -> Result<Option<LockInfo>, LockError> {
        let shared = self.locker.shared();
        let backend = shared.backend()?;
        shared
            .run_bounded("watch", |limit| async move {
                backend.run(&Inspect(key), limit).await
            })
            .await
    }

    /// Whether the holder of tenure `token` gave the key back itself (its release wrote the
    /// row's `release_token`; an operator's release and an expiry do not).
    async fn released_by_holder(&self, key: &str, token: u64) -> Result<bool, LockError> {
        let shared = self.locker.shared();
        let backend = shared.backend()?;
        let last = shared
            .run_bounded("watch", |limit| async move {
                backend.run(&LastWriteOf(key), limit).await
            })
            .await?;
        Ok(last.and_then(|l| l.release_token) == Some(token as i64))
    }

    /// What happened between the reads `before` and `now` (held rows, and rows taken recently
    /// that may be free again). A key taken again after the read of `now` is added to it, so
    /// the next read does not report it a second time.
    async fn changes(
        &self,
        before: &BTreeMap<String, LockInfo>,
        now: &mut BTreeMap<String, LockInfo>,
    ) -> Result<Vec<LockEvent>, LockError> {
        let mut events = Vec::new();
        for (key, n) in now.iter() {
            let p = before.get(key);
            let same = p.is_some_and(|p| p.fencing_token == n.fencing_token);
            // The tenure the last read saw held, if any.
            match (p.filter(|p| p.held), n.held) {
                (Some(_), true) if same => {}
                (Some(p), true) => events.extend(self.ended(p, n, Some(n)).await?),
                (Some(p), false) if same => events.extend(self.ended(p, n, None).await?),
                (Some(p), false) => {
                    // It ended, and the next tenure began and ended too, between the reads:
                    // the row tells how the later one ended, not how `p` did.
                    events.push(LockEvent::Released {
                        event: event(p, n.acquired_at),
                        outcome: None,
                    });
                    events.push(LockEvent::Acquired(event(n, n.acquired_at)));
                    events.push(self.end_of(n).await?);
                }
                (None, true) => events.push(LockEvent::Acquired(event(n, n.acquired_at))),
                (None, false) if same => {} // reported by an earlier read
                (None, false) => {
                    // A hold that began and ended between two reads.
                    events.push(LockEvent::Acquired(event(n, n.acquired_at)));
                    events.push(self.end_of(n).await?);
                }
            }
        }
        let gone: Vec<&LockInfo> = before
            .values()
            .filter(|p| p.held && !now.contains_key(&p.key))
            .collect();
        for p in gone {
            match self.row(&p.key).await? {
                Some(r) if r.held && r.fencing_token == p.fencing_token => {
                    now.insert(r.key.clone(), r);
                }
                Some(r) if r.held => {
                    events.extend(self.ended(p, &r, Some(&r)).await?);
                    now.insert(r.key.clone(), r);
                }
                Some(r) => events.extend(self.ended(p, &r, None).await?),
                None => events.push(LockEvent::Expired(event(p, p.expires_at))),
            }
        }
        if self.permits {
            return Ok(events.into_iter().filter_map(as_permit).collect());
        }
        Ok(events)
    }

    /// The end of tenure `n`, already over when it was first read.
    async fn end_of(&self, n: &LockInfo) -> Result<LockEvent, LockError> {
        let by_holder = self.released_by_holder(&n.key, n.fencing_token).await?;
        Ok(end(n, n, by_holder))
    }

    /// How tenure `p` ended, given the key's row now (`row`) and the tenure that followed it,
    /// if any (`next`, then reported too).
    async fn ended(
        &self,
        p: &LockInfo,
        row: &LockInfo,
        next: Option<&LockInfo>,
    ) -> Result<Vec<LockEvent>, LockError> {
        let by_holder = self.released_by_holder(&p.key, p.fencing_token).await?;
        let early = |at: SystemTime| at < p.expires_at;
        Ok(match next {
            Some(n) if !by_holder && early(n.acquired_at) => vec![LockEvent::Stolen {
                event: event(n, n.acquired_at),
                from_token: p.fencing_token,
            }],
            Some(n) => vec![
                end(p, row, by_holder),
                LockEvent::Acquired(event(n, n.acquired_at)),
            ],
            None if !by_holder && row.finished_at.is_some_and(early) => {
                // An operator's release: recorded as a failure, before the lease's end.
                vec![LockEvent::Released {
                    event: event(p, row.finished_at.unwrap_or(p.expires_at)),
                    outcome: row.last_outcome,
                }]
            }
            None => vec![end(p, row, by_holder)],
        })
    }
}

/// The end of tenure `p`: a release by its holder (with the row's outcome), else an expiry.
fn end(p: &LockInfo, row: &LockInfo, by_holder: bool) -> LockEvent {
    if by_holder {
        LockEvent::Released {
            event: event(p, row.finished_at.unwrap_or(p.expires_at)),
            outcome: row.last_outcome,
        }
    } else {
        LockEvent::Expired(event(p, p.expires_at))
    }
}

fn event(row: &LockInfo, at: SystemTime) -> KeyEvent {
    KeyEvent {
        key: row.key.clone(),
        owner: row.owner.clone(),
        holder: row.holder.clone(),
        fencing_token: row.fencing_token,
        at,
        kind: row.kind,
    }
}

/// An event of a row of the permits' table as its semaphore's: the semaphore's key and which
/// permit (`None`: a row that is no slot).
fn as_permit(e: LockEvent) -> Option<LockEvent> {
    let permit = |mut event: KeyEvent| {
        let (key, kind) = crate::semaphore::permit_of(&event.key)?;
        let key = key.to_owned();
        event.key = key;
        event.kind = kind;
        Some(event)
    };
    Some(match e {
        LockEvent::Acquired(event) => LockEvent::Acquired(permit(event)?),
        LockEvent::Released { event, outcome } => LockEvent::Released {
            event: permit(event)?,
            outcome,
        },
        LockEvent::Expired(event) => LockEvent::Expired(permit(event)?),
        LockEvent::Stolen { event, from_token } => LockEvent::Stolen {
            event: permit(event)?,
            from_token,
        },
        lagged @ LockEvent::Lagged { .. } => lagged,
    })
}
