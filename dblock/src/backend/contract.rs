//! The contract between the runtime and the backends, naming no backend: what each statement
//! binds and answers ([`Statement`] values), and the answers' types. A backend implements, in
//! its own files, how it sends each statement (`postgres::OnPostgres`, `mysql::OnMySql`,
//! `sqlite::OnSqlite`); one executor runs them all ([`Backend::run`](super::Backend::run)).

use std::time::Duration;

pub(crate) use crate::info::Outcome;

/// A statement as a value: what it binds, and what it answers. Each backend says how it sends
/// it and reads the answer, in its file for the statement's kind (`postgres/read.rs`, ...):
/// a new statement is a type and one implementation per backend, not a method of every
/// dialect, a forwarder and a call site.
pub(crate) trait Statement: Sync {
    /// What the statement answers.
    type Output: Send;

    /// Sent on the pool releases use (lazily durable where the backend has one).
    const ON_RELEASE_POOL: bool = false;
}

/// What one acquire statement binds: a borrowed view of the resolved request, plus this
/// attempt's id.
pub(crate) struct Acquire<'a> {
    pub key: &'a str,
    pub owner: &'a str,
    /// Lease length in microseconds (validated: > 0 and fits the database's interval type).
    pub ttl_us: i64,
    pub holder: &'a str,
    /// Random id of this `lock()` call. A retry after an unknown outcome sends the same id, so
    /// the statement recognises its own earlier success instead of counting the hold twice.
    pub attempt: i64,
    /// A waiter whose LISTEN is in place: on PostgreSQL, a busy attempt asks for a NOTIFY.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub waiting: bool,
    /// The tenure (fencing token) of this owner's holds of the key that the process tracks, and
    /// how many: re-entry counts from these, never from the row alone.
    pub tenure: Option<i64>,
    pub held: u32,
    /// The key stays unavailable to others this long after a new tenure begins (0: no minimum);
    /// the lease is at least this long.
    pub min_hold_us: i64,
    /// Refuse the key if its last hold succeeded.
    pub once: bool,
}

impl<'a> Acquire<'a> {
    /// Its values, as every backend's one-key text numbers them: `$1` key, `$2` owner, `$3`
    /// ttl, `$4` holder label, `$5` attempt id, `$6` the tenure the process tracks (NULL: none),
    /// `$7` how many holds of it (int4), `$8` min_hold (0: none), `$9` once. Times in µs (int8):
    /// a backend of coarser time converts in its text. PostgreSQL appends `$10`, a waiter whose
    /// LISTEN is in place.
    pub(crate) fn args(&self) -> [Arg<'a>; 9] {
        [
            Arg::Text(self.key),
            Arg::Text(self.owner),
            Arg::Int8(self.ttl_us),
            Arg::Text(self.holder),
            Arg::Int8(self.attempt),
            Arg::OptInt8(self.tenure),
            Arg::Int4(self.held as i32),
            Arg::Int8(self.min_hold_us),
            Arg::Bool(self.once),
        ]
    }
}

/// A lock that the statement granted (first hold, takeover or re-entry).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Grant {
    pub hold_count: u32,
    pub fencing_token: u64,
    pub expires_at_us: i64,
}

/// The outcome of one acquire statement.
#[derive(Debug)]
pub(crate) enum Attempt {
    Acquired(Grant),
    /// Held by someone else; `retry_after` is the holder's remaining lease where the backend
    /// reports it, measured on the database clock.
    Busy {
        retry_after: Option<Duration>,
    },
    /// A `once` request for a key whose last hold succeeded (at `finished_at_us`).
    Done {
        finished_at_us: Option<i64>,
    },
}

/// What one release statement did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Released {
    /// The hold count reached zero: the key is free.
    Free,
    /// Still held by the same owner at this count.
    StillHeld(u32),
    /// Nothing matched: not the owner, a different tenure, or the lease already ended.
    NotHeld,
}

impl Released {
    /// The answer of a release that left `left` holds (`None`: it matched no row).
    pub(crate) fn left(left: Option<i64>) -> Self {
        match left {
            None => Released::NotHeld,
            Some(0) => Released::Free,
            Some(n) => Released::StillHeld(n as u32),
        }
    }
}

/// The parameters every owner-checked statement carries.
#[derive(Clone, Copy)]
pub(crate) struct HoldRef<'a> {
    pub key: &'a str,
    pub owner: &'a str,
    pub fencing_token: u64,
}

impl<'a> HoldRef<'a> {
    /// Its values as every owner-checked statement numbers them: `$1` key, `$2` owner, `$3`
    /// fencing token.
    fn args(&self) -> [Arg<'a>; 3] {
        [
            Arg::Text(self.key),
            Arg::Text(self.owner),
            Arg::Int8(self.fencing_token as i64),
        ]
    }
}

/// One lease in a batched extension.
pub(crate) struct RenewItem<'a> {
    pub key: &'a str,
    pub owner: &'a str,
    pub fencing_token: u64,
    pub ttl_us: i64,
    /// `max_hold` in µs ([`NO_CAP_US`] for none): the lease never ends past
    /// `acquired_at + max_hold` (database clock).
    pub max_hold_us: i64,
}

impl<'a> RenewItem<'a> {
    /// The hold it extends.
    #[cfg(any(feature = "mysql", feature = "sqlite"))]
    fn hold(&self) -> HoldRef<'a> {
        HoldRef {
            key: self.key,
            owner: self.owner,
            fencing_token: self.fencing_token,
        }
    }
}

/// The `max_hold` of a hold without one: a thousand years, never reached.
pub(crate) const NO_CAP_US: i64 = 1000 * 365 * 24 * 3600 * 1_000_000;

/// What the row of a key says about its last writers (see `Dialect::last_write`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LastWrite {
    /// The last acquire's attempt id or release's id.
    pub writer: Option<i64>,
    /// The row's tenure.
    pub fencing_token: i64,
    /// The last release's id, and the tenure it released: no acquire overwrites them.
    pub release_id: Option<i64>,
    pub release_token: Option<i64>,
}

/// What one extension found, alone or in a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Extension {
    /// Extended; the new lease end (µs since the epoch) where the statement read it (the
    /// batched form does not).
    Extended(Option<i64>),
    /// The hold is no longer this tenure's: nothing was extended.
    NotHeld,
}

impl Extension {
    /// The answer of a one-row [`Extend`]: the new lease end, or `None` when not held.
    pub(crate) fn of(answer: Option<i64>) -> Self {
        answer.map_or(Extension::NotHeld, |end| Extension::Extended(Some(end)))
    }
}

/// The holds a batched extension found live and extended: (key, owner, fencing token).
pub(crate) type Extended = Vec<(String, String, u64)>;

/// One step of a fair waiter (`LockRequest::fair`) in the queue of its key: the rows of the
/// lock table's queue table ([`queue_table`]), one per waiter, ordered by ticket. Each row is a
/// short lease of its own on the database clock, renewed while its waiter polls, so a waiter
/// that dies leaves the queue by itself. The queue only orders the attempts; who holds the key
/// is decided by the acquire statement alone, so the queue can never break mutual exclusion.
#[derive(Debug, Clone, Copy)]
pub(crate) enum QueueStep<'a> {
    /// Takes a ticket at the back of the queue: answers the ticket.
    Join {
        key: &'a str,
        owner: &'a str,
        lease_us: i64,
    },
    /// How many live waiters with a smaller ticket are queued, counted up to 8 (0: nobody is
    /// ahead); a caller without a ticket asks with `i64::MAX`.
    Ahead { key: &'a str, ticket: i64 },
    /// Renews the ticket's lease: 1, or 0 if it is gone (ran out and was cleared).
    Touch {
        key: &'a str,
        owner: &'a str,
        ticket: i64,
        lease_us: i64,
    },
    /// Leaves the queue, and clears the key's tickets whose lease ran out: how many rows went.
    Leave {
        key: &'a str,
        owner: &'a str,
        ticket: i64,
    },
}

/// A backend's four statements of the fair queue, one per [`QueueStep`].
#[derive(Debug)]
pub(crate) struct QueueSql<S> {
    pub join: S,
    pub ahead: S,
    pub touch: S,
    pub leave: S,
}

impl<S> QueueSql<S> {
    /// The statement of `step`.
    pub(crate) fn of(&self, step: &QueueStep<'_>) -> &S {
        match step {
            QueueStep::Join { .. } => &self.join,
            QueueStep::Ahead { .. } => &self.ahead,
            QueueStep::Touch { .. } => &self.touch,
            QueueStep::Leave { .. } => &self.leave,
        }
    }
}

impl QueueStep<'_> {
    /// What the step binds, in the order of its placeholders on every backend: `$1` the key,
    /// then the owner, the ticket and the lease (µs) where the step has them, in that order.
    pub(crate) fn args(&self) -> Vec<Arg<'_>> {
        match *self {
            QueueStep::Join {
                key,
                owner,
                lease_us,
            } => vec![Arg::Text(key), Arg::Text(owner), Arg::Int8(lease_us)],
            QueueStep::Ahead { key, ticket } => vec![Arg::Text(key), Arg::Int8(ticket)],
            QueueStep::Touch {
                key,
                owner,
                ticket,
                lease_us,
            } => vec![
                Arg::Text(key),
                Arg::Text(owner),
                Arg::Int8(ticket),
                Arg::Int8(lease_us),
            ],
            QueueStep::Leave { key, owner, ticket } => {
                vec![Arg::Text(key), Arg::Text(owner), Arg::Int8(ticket)]
            }
        }
    }
}

/// One value a statement binds, in the order of its placeholders (`$1`, `$2`, …): a statement
/// lists its values once, as these, and each backend binds them with the types its driver gives
/// the Rust values (PostgreSQL, behind a pooler, writes them in as typed literals). The arrays
/// are PostgreSQL's alone.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) enum Arg<'a> {
    Text(&'a str),
    Int4(i32),
    Int8(i64),
    Float8(f64),
    Bool(bool),
    OptInt2(Option<i16>),
    OptInt8(Option<i64>),
    TextArray(&'a [&'a str]),
    Int8Array(&'a [i64]),
    Float8Array(&'a [f64]),
}

/// `sql` with `args` bound in order ([`Binds::bind_value`]): the binding of every backend but
/// PostgreSQL's (which also binds arrays and, behind a pooler, writes literals).
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) fn bound<'q, 'a, DB: Binds<'a>>(
    sql: sqlx::SqlStr,
    args: &[Arg<'a>],
) -> sqlx::Result<sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments>> {
    args.iter()
        .try_fold(sqlx::query::<DB>(sql), |q, arg| DB::bind_value(q, *arg))
}

/// A database whose driver binds every kind of [`Arg`] value but the arrays (each backend's
/// does; PostgreSQL's binding adds the arrays).
pub(crate) trait Binds<'a>: sqlx::Database {
    /// Binds one value with the type the driver gives the Rust value; an array (PostgreSQL's
    /// binding takes those itself) is an encoding error.
    fn bind_value<'q>(
        q: sqlx::query::Query<'q, Self, Self::Arguments>,
        arg: Arg<'a>,
    ) -> Result<sqlx::query::Query<'q, Self, Self::Arguments>, sqlx::Error>;
}

impl<'a, DB> Binds<'a> for DB
where
    DB: sqlx::Database,
    &'a str: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    i32: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    f64: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    bool: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    Option<i16>: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    Option<i64>: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
{
    fn bind_value<'q>(
        q: sqlx::query::Query<'q, DB, DB::Arguments>,
        arg: Arg<'a>,
    ) -> sqlx::Result<sqlx::query::Query<'q, DB, DB::Arguments>> {
        Ok(match arg {
            Arg::Text(v) => q.bind(v),
            Arg::Int4(v) => q.bind(v),
            Arg::Int8(v) => q.bind(v),
            Arg::Float8(v) => q.bind(v),
            Arg::Bool(v) => q.bind(v),
            Arg::OptInt2(v) => q.bind(v),
            Arg::OptInt8(v) => q.bind(v),
            Arg::TextArray(_) | Arg::Int8Array(_) | Arg::Float8Array(_) => {
                return Err(sqlx::Error::Encode(
                    "an array value is bound on PostgreSQL only".into(),
                ))
            }
        })
    }
}

/// The answer to a statement over several keys ([`Dialect::acquire_many`], SQLite's coalesced
/// acquire) from the grants it returned (by key): one attempt per key of `all`, in its order; a
/// key without a grant was busy.
pub(crate) fn per_key(
    all: &[Acquire<'_>],
    grants: impl IntoIterator<Item = (String, Grant)>,
) -> Vec<Attempt> {
    let mut grants: std::collections::HashMap<String, Grant> = grants.into_iter().collect();
    all.iter()
        .map(|a| match grants.remove(a.key) {
            Some(grant) => Attempt::Acquired(grant),
            None => Attempt::Busy { retry_after: None },
        })
        .collect()
}

/// A row of any backend read by column index as one of the few types dblock's statements
/// return (each dialect's text casts its columns to them): the `Decode` bounds every decoder
/// would otherwise restate, written once.
pub(crate) trait Columns {
    fn text(&self, i: usize) -> sqlx::Result<String>;
    fn opt_text(&self, i: usize) -> sqlx::Result<Option<String>>;
    /// A `BIGINT`.
    fn int(&self, i: usize) -> sqlx::Result<i64>;
    fn opt_int(&self, i: usize) -> sqlx::Result<Option<i64>>;
    /// An `INT` (PostgreSQL's `int4` hold counts).
    fn int4(&self, i: usize) -> sqlx::Result<i32>;
    fn flag(&self, i: usize) -> sqlx::Result<bool>;
}

impl<R> Columns for R
where
    R: sqlx::Row,
    usize: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> bool: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    fn text(&self, i: usize) -> sqlx::Result<String> {
        self.try_get(i)
    }
    fn opt_text(&self, i: usize) -> sqlx::Result<Option<String>> {
        self.try_get(i)
    }
    fn int(&self, i: usize) -> sqlx::Result<i64> {
        self.try_get(i)
    }
    fn opt_int(&self, i: usize) -> sqlx::Result<Option<i64>> {
        self.try_get(i)
    }
    fn int4(&self, i: usize) -> sqlx::Result<i32> {
        self.try_get(i)
    }
    fn flag(&self, i: usize) -> sqlx::Result<bool> {
        self.try_get(i)
    }
}

impl Grant {
    /// The grant a row returns from column `from` on: the hold count, the fencing token and the
    /// lease end (µs since the epoch). Every dialect's text returns them with these types (a
    /// negative count reads as 0).
    pub(crate) fn at(row: &impl Columns, from: usize) -> sqlx::Result<Grant> {
        Ok(Grant {
            hold_count: row.int4(from)?.max(0) as u32,
            fencing_token: row.int(from + 1)? as u64,
            expires_at_us: row.int(from + 2)?,
        })
    }
}

/// One granted row of a statement over several keys: its key in column 0, then its
/// [`Grant::at`] column `from`.
pub(crate) fn keyed_grant(row: &impl Columns, from: usize) -> sqlx::Result<(String, Grant)> {
    Ok((row.text(0)?, Grant::at(row, from)?))
}

/// [`per_key`] over grants still to decode (each row's [`keyed_grant`]): the first error, or one
/// attempt per key of `all`.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) fn per_key_decoded(
    all: &[Acquire<'_>],
    grants: impl IntoIterator<Item = Result<(String, Grant), sqlx::Error>>,
) -> sqlx::Result<Vec<Attempt>> {
    let grants = grants.into_iter().collect::<Result<Vec<_>, _>>()?;
    Ok(per_key(all, grants))
}

/// The answer of a one-key acquire from the row it returned (PostgreSQL's, and MySQL's with
/// `RETURNING`): granted, hold count, fencing token, lease end (µs), the holder's time left
/// (ms), done, finished at (µs).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn attempt_row(row: &impl Columns) -> sqlx::Result<Attempt> {
    if row.flag(0)? {
        Ok(Attempt::Acquired(Grant::at(row, 1)?))
    } else if row.flag(5)? {
        Ok(Attempt::Done {
            finished_at_us: row.opt_int(6)?,
        })
    } else {
        Ok(Attempt::Busy {
            retry_after: Some(crate::info::millis(row.int(4)?)),
        })
    }
}

// The statements of the lock table, as values (what each backend runs is in its files:
// `lock.rs` the lock's own statements, `admin.rs` the operator's and the last-writer read,
// `queue.rs` the fair queue's, `migrate.rs` the schema; the coalesced batch forms are the
// coalescer's, `coalesce/rows.rs`).

impl Statement for Acquire<'_> {
    type Output = Attempt;
}

/// Creates the tables (or brings them up to date); idempotent, safe from many processes at
/// once.
pub(crate) struct Migrate;

impl Statement for Migrate {
    type Output = ();
}

/// Several keys of one owner at once, all or nothing, in one statement where the dialect has
/// one (`None` where it has not: the caller takes them one by one). The keys are sorted,
/// without duplicates, and share owner, ttl, holder, min_hold and once. The statement takes
/// every key only if every key is available in its view (a busy set writes nothing), locking
/// rows in key order; a race it cannot see may still leave some keys untaken, so the answer is
/// per key, in their order (busy keys report no `retry_after`).
pub(crate) struct AcquireMany<'a> {
    /// What every key shares (owner, ttl, holder, min_hold, once): the first key's request.
    pub first: &'a Acquire<'a>,
    pub all: &'a [Acquire<'a>],
}

impl<'a> AcquireMany<'a> {
    /// The statement of `all`; `None` for an empty list (nothing to send: no key is taken).
    pub(crate) fn of(all: &'a [Acquire<'a>]) -> Option<Self> {
        all.first().map(|first| AcquireMany { first, all })
    }
}

impl Statement for AcquireMany<'_> {
    type Output = Option<Vec<Attempt>>;
}

/// Sets the hold count to `remaining` (the process's holds left; 0 frees the key) if `hold` is
/// the live tenure, recording `release_id` in the row (and `outcome` when the key is freed); a
/// repeat with the same id (after a lost reply) then matches nothing. Callers serialise the
/// owner's operations on the key.
pub(crate) struct Release<'a> {
    pub hold: HoldRef<'a>,
    pub remaining: u32,
    pub outcome: Option<Outcome>,
    pub release_id: i64,
}

impl Statement for Release<'_> {
    type Output = Released;
    const ON_RELEASE_POOL: bool = true;
}

impl Release<'_> {
    /// Its values, as every backend's text numbers them: the hold's (`$1`-`$3`), `$4` release
    /// id, `$5` holds left (int4), `$6` outcome code (int2, NULL for none).
    pub(crate) fn args(&self) -> Vec<Arg<'_>> {
        let mut args = self.hold.args().to_vec();
        args.extend([
            Arg::Int8(self.release_id),
            Arg::Int4(self.remaining as i32),
            Arg::OptInt2(self.outcome.map(Outcome::code)),
        ]);
        args
    }
}

/// Pushes the lease end to at least `now + ttl` (but never past `acquired_at + max_hold`);
/// `None` if `hold` is not the live tenure.
pub(crate) struct Extend<'a> {
    pub hold: HoldRef<'a>,
    pub ttl_us: i64,
    /// As [`RenewItem::max_hold_us`].
    pub max_hold_us: i64,
}

impl Statement for Extend<'_> {
    type Output = Option<i64>;
}

impl Extend<'_> {
    /// Its values, as every backend's text numbers them: the hold's (`$1`-`$3`), `$4` ttl and
    /// `$5` max_hold, both in µs (int8; a backend of coarser time converts in its text).
    pub(crate) fn args(&self) -> [Arg<'_>; 5] {
        let [key, owner, token] = self.hold.args();
        [
            key,
            owner,
            token,
            Arg::Int8(self.ttl_us),
            Arg::Int8(self.max_hold_us),
        ]
    }
}

/// Extends every live hold of the list (never empty) in one statement; answers those it
/// extended.
pub(crate) struct ExtendMany<'a>(pub &'a [RenewItem<'a>]);

impl Statement for ExtendMany<'_> {
    type Output = Extended;
}

impl<'a> ExtendMany<'a> {
    /// Its values where every row of the list is five placeholders (MySQL and SQLite): key,
    /// owner, fencing token, ttl µs, `max_hold` µs, row after row.
    #[cfg(any(feature = "mysql", feature = "sqlite"))]
    pub(crate) fn args(&self) -> Vec<Arg<'a>> {
        self.0
            .iter()
            .flat_map(|i| {
                let [key, owner, token] = i.hold().args();
                [
                    key,
                    owner,
                    token,
                    Arg::Int8(i.ttl_us),
                    Arg::Int8(i.max_hold_us),
                ]
            })
            .collect()
    }
}

/// The row's last writer id (attempt or release id), fencing token, and last release.
pub(crate) struct LastWriteOf<'a>(pub &'a str);

impl Statement for LastWriteOf<'_> {
    type Output = Option<LastWrite>;
}

/// One step of a fair waiter in its key's queue: one statement. On the release pool: a
/// ticket needs no more durability than a lazily durable release (a lost one only costs its
/// place).
impl Statement for QueueStep<'_> {
    type Output = i64;
    const ON_RELEASE_POOL: bool = true;
}
