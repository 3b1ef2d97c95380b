//! PostgreSQL behind a transaction pooler (PgBouncer in `pool_mode = transaction` or
//! `statement`): every statement as ONE simple-protocol `Query` message, its values written into
//! the text as literals.
//!
//! Why not prepared statements: a pooler in transaction mode hands each transaction to whichever
//! server connection is free, and a statement outside an explicit transaction is a transaction
//! of its own.
//! - A named prepared statement (sqlx's default) lives on the server connection it was prepared
//!   on. The next use lands on another one: "prepared statement sqlx_s_1 does not exist", or
//!   "already exists" when another client prepared the same name there first, or another
//!   client's statement of that name runs with our values.
//! - An unnamed one is no better: sqlx sends Parse+Describe+Sync, waits for ReadyForQuery, then
//!   Bind+Execute+Sync. The pooler may give the server connection away at that ReadyForQuery,
//!   so the Bind can run another client's unnamed statement — measured through PgBouncer 1.18:
//!   about a third of 3,200 such queries from 16 clients returned another statement's result
//!   (`tests/pgbouncer.rs`). It would also cost two round trips.
//!
//! The simple protocol has neither problem, and one round trip. Its price is that there are no
//! bound values: [`Template`] cuts each statement at its `$n` placeholders once, and
//! [`Template::render`] puts typed literals ([`Arg`]) in their place. Text becomes `E'…'` with
//! `\` and `'` doubled, which reads the same whatever `standard_conforming_strings` says; a NUL
//! (which PostgreSQL text cannot hold, and which would end the query string early) is refused
//! before anything is sent. Every literal carries the type the bound value would have had
//! (`::text`, `::int8`, …), so the statements mean exactly what they mean with binds.
//!
//! Session settings cannot be relied on either (a pooler refuses the `options` start-up
//! parameter, and a `SET` would stick to a server connection that other clients share), so each
//! statement starts with [`Pooler::prefix`]: READ COMMITTED, `statement_timeout` and
//! `lock_timeout` for this one transaction only (`SET LOCAL`). The statements of one `Query`
//! message form one implicit transaction, so they cost no extra round trip and leave nothing
//! behind on the shared connection. TCP keepalives towards the client are the pooler's job
//! (PgBouncer's `tcp_keepalive`, `client_idle_timeout`).

use std::fmt::Write as _;
use std::future::Future;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgArguments, Postgres};
use sqlx::query::Query;

use crate::backend::contract::Arg;

/// What a locker behind a pooler adds to each of its statements.
#[derive(Debug)]
pub(crate) struct Pooler {
    prefix: String,
}

impl Pooler {
    /// Settings for one statement's transaction: READ COMMITTED and the statement time-out (on
    /// the server, as the `options` start-up parameter sets them on a direct connection).
    pub(crate) fn new(statement_timeout: Duration) -> Self {
        let ms = statement_timeout.as_millis().max(1);
        let lock_ms = super::row_lock_wait(statement_timeout).as_millis();
        Pooler {
            prefix: format!(
                "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; \
                 SET LOCAL statement_timeout = {ms}; SET LOCAL lock_timeout = {lock_ms};\n"
            ),
        }
    }

    /// The statements that go before each of the locker's own, in the same `Query` message.
    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }
}

/// Whether a locker's statements go through a transaction pooler, as far as it knows: said by
/// `ConnectOptions::pooler`, found out by `Locker::connect`, or (`Locker::postgres(pool)`, whose
/// pool is the application's) found out before its first statement ([`Mode::find_out`]), and
/// changed to pooler mode should a prepared statement then meet a shared server connection
/// anyway ([`Mode::shared_connection_seen`]).
#[derive(Debug)]
pub(crate) struct Mode {
    state: AtomicU8,
    /// Whether the state may change from what it is (not set by `pooler(..)`).
    found: bool,
    pooler: Pooler,
    /// Held by the one caller finding out; the others wait for its answer.
    finding: tokio::sync::Mutex<()>,
}

const UNKNOWN: u8 = 0;
const DIRECT: u8 = 1;
const POOLED: u8 = 2;

impl Mode {
    /// Known: pooler mode or the direct path, as `ConnectOptions::pooler` or a connect decided.
    pub(crate) fn known(pooler: bool, statement_timeout: Duration) -> Self {
        Self::with(
            if pooler { POOLED } else { DIRECT },
            false,
            statement_timeout,
        )
    }

    /// Found out at the first statement ([`Mode::find_out`]).
    pub(crate) fn unknown(statement_timeout: Duration) -> Self {
        Self::with(UNKNOWN, true, statement_timeout)
    }

    fn with(state: u8, found: bool, statement_timeout: Duration) -> Self {
        Mode {
            state: AtomicU8::new(state),
            found,
            pooler: Pooler::new(statement_timeout),
            finding: tokio::sync::Mutex::new(()),
        }
    }

    /// Behind a pooler: what goes before each statement. `None` on the direct path (or while
    /// not known yet, which [`Mode::find_out`] settles before any statement).
    pub(crate) fn pooler(&self) -> Option<&Pooler> {
        (self.state.load(Ordering::Acquire) == POOLED).then_some(&self.pooler)
    }

    pub(crate) fn is_known(&self) -> bool {
        self.state.load(Ordering::Acquire) != UNKNOWN
    }

    /// Settles the mode, once for all callers: `probe` answers whether server connections are
    /// shared between clients. A probe that fails decides nothing (the next statement asks
    /// again) and its error is the caller's.
    pub(crate) async fn find_out<E>(
        &self,
        probe: impl Future<Output = Result<bool, E>>,
    ) -> Result<(), E> {
        let _finding = self.finding.lock().await;
        if self.is_known() {
            return Ok(());
        }
        let shared = probe.await?;
        if shared {
            tracing::info!(
                reason = "a session setting made on one connection showed up on another, or a \
                          connection's server session changed between statements",
                "PostgreSQL pool behind a transaction pooler: statements go as simple queries with \
                 their settings, and waiters poll (no LISTEN through it)"
            );
        }
        self.state
            .store(if shared { POOLED } else { DIRECT }, Ordering::Release);
        Ok(())
    }

    /// Settles an unknown mode (a connect found out): no-op once known.
    pub(crate) fn settle(&self, pooler: bool) {
        let state = if pooler { POOLED } else { DIRECT };
        let _ = self
            .state
            .compare_exchange(UNKNOWN, state, Ordering::AcqRel, Ordering::Acquire);
    }

    /// A prepared statement met a shared server connection ("prepared statement … does not
    /// exist" / "already exists"): a transaction pooler the first look missed. From now on
    /// pooler mode, unless `pooler(false)` forced the direct path: then `false`.
    pub(crate) fn shared_connection_seen(&self) -> bool {
        if !self.found {
            return self.state.load(Ordering::Acquire) == POOLED;
        }
        if self.state.swap(POOLED, Ordering::AcqRel) != POOLED {
            tracing::info!(
                "PostgreSQL behind a transaction pooler after all (a prepared statement met another \
                 client's server connection): statements go as simple queries from now on"
            );
        }
        true
    }
}

/// On PostgreSQL a statement's values ([`Arg`]) are bound as is on the default path, written
/// as typed literals behind a pooler.
impl<'a> Arg<'a> {
    /// Binds the value to a prepared statement, with the type sqlx gives the Rust value.
    pub(crate) fn bind<'q>(
        self,
        q: Query<'q, Postgres, PgArguments>,
    ) -> sqlx::Result<Query<'q, Postgres, PgArguments>> {
        match self {
            Arg::TextArray(v) => Ok(q.bind(v)),
            Arg::Int8Array(v) => Ok(q.bind(v)),
            Arg::Float8Array(v) => Ok(q.bind(v)),
            value => <Postgres as crate::backend::contract::Binds>::bind_value(q, value),
        }
    }

    /// Writes the value as a literal of the type it would have been bound as.
    fn write_literal(self, out: &mut String) -> sqlx::Result<()> {
        match self {
            Arg::Text(v) => {
                text(out, v)?;
                out.push_str("::text");
            }
            Arg::Int4(v) => {
                let _ = write!(out, "'{v}'::int4");
            }
            Arg::Int8(v) | Arg::OptInt8(Some(v)) => {
                let _ = write!(out, "'{v}'::int8");
            }
            Arg::OptInt2(Some(v)) => {
                let _ = write!(out, "'{v}'::int2");
            }
            Arg::OptInt2(None) => out.push_str("NULL::int2"),
            Arg::OptInt8(None) => out.push_str("NULL::int8"),
            Arg::Float8(v) => {
                float(out, v);
                out.push_str("::float8");
            }
            Arg::Bool(v) => out.push_str(if v { "true" } else { "false" }),
            Arg::TextArray(vs) => {
                array(out, vs, |out, v| text(out, v))?;
                out.push_str("::text[]");
            }
            Arg::Int8Array(vs) => {
                array(out, vs, |out, v| {
                    let _ = write!(out, "'{v}'");
                    Ok(())
                })?;
                out.push_str("::int8[]");
            }
            Arg::Float8Array(vs) => {
                array(out, vs, |out, v| {
                    float(out, *v);
                    Ok(())
                })?;
                out.push_str("::float8[]");
            }
        }
        Ok(())
    }
}

/// `E'…'`: backslashes and quotes doubled, so the literal reads the same whether or not
/// `standard_conforming_strings` is on. No NUL: PostgreSQL text cannot hold one, and in a
/// simple query it would cut the statement short.
fn text(out: &mut String, v: &str) -> sqlx::Result<()> {
    if v.contains('\0') {
        return Err(sqlx::Error::Encode(
            "a text value with a NUL byte cannot be sent to PostgreSQL".into(),
        ));
    }
    out.reserve(v.len() + 3);
    out.push_str("E'");
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("''"),
            c => out.push(c),
        }
    }
    out.push('\'');
    Ok(())
}

/// A float8 literal that round-trips exactly (Rust's shortest representation, which
/// PostgreSQL's `float8in` reads back to the same value).
fn float(out: &mut String, v: f64) {
    if v.is_nan() {
        out.push_str("'NaN'");
    } else if v.is_infinite() {
        out.push_str(if v > 0.0 { "'Infinity'" } else { "'-Infinity'" });
    } else {
        let _ = write!(out, "'{v:?}'");
    }
}

/// `ARRAY[a, b, …]`, or `'{}'` when empty (an empty `ARRAY[]` has no type to cast from).
fn array<T>(
    out: &mut String,
    items: &[T],
    mut one: impl FnMut(&mut String, &T) -> Result<(), sqlx::Error>,
) -> sqlx::Result<()> {
    if items.is_empty() {
        out.push_str("'{}'");
        return Ok(());
    }
    out.push_str("ARRAY[");
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        one(out, item)?;
    }
    out.push(']');
    Ok(())
}

/// A statement's text cut at its placeholders, for [`Template::render`].
#[derive(Debug)]
pub(crate) struct Template {
    parts: Vec<Part>,
    /// Bytes of text, for the output's capacity.
    len: usize,
}

#[derive(Debug, PartialEq, Eq)]
enum Part {
    Text(String),
    /// `$n`, as an index into the values (n - 1).
    Param(usize),
}

impl Template {
    /// Cuts `sql` at every `$n` outside string literals, quoted identifiers, dollar quotes and
    /// comments. Comments are dropped (a value never lands in one, and they need not travel).
    /// Meant for the dialect's own statements: `E'…'` strings with backslash escapes are not
    /// among them and are not understood.
    pub(crate) fn parse(sql: &str) -> Template {
        let b = sql.as_bytes();
        let mut parts = Vec::new();
        let mut text = String::with_capacity(sql.len());
        let mut i = 0;
        // Copies `sql[from..to]` (always at char boundaries: every cut is at an ASCII byte).
        let copy = |text: &mut String, from: usize, to: usize| text.push_str(&sql[from..to]);
        while i < b.len() {
            match b[i] {
                q @ (b'\'' | b'"') => {
                    let end = b[i + 1..]
                        .iter()
                        .position(|&c| c == q)
                        .map_or(b.len(), |p| i + 1 + p + 1);
                    copy(&mut text, i, end);
                    i = end;
                }
                b'-' if b.get(i + 1) == Some(&b'-') => {
                    i = b[i..]
                        .iter()
                        .position(|&c| c == b'\n')
                        .map_or(b.len(), |p| i + p);
                }
                b'/' if b.get(i + 1) == Some(&b'*') => {
                    let mut depth = 0usize;
                    while i < b.len() {
                        if b[i..].starts_with(b"/*") {
                            depth += 1;
                            i += 2;
                        } else if b[i..].starts_with(b"*/") {
                            depth -= 1;
                            i += 2;
                            if depth == 0 {
                                break;
                            }
                        } else {
                            i += 1;
                        }
                    }
                    text.push(' ');
                }
                b'$' if !i.checked_sub(1).is_some_and(|p| {
                    b[p].is_ascii_alphanumeric() || b[p] == b'_' || b[p] == b'$'
                }) =>
                {
                    let digits = b[i + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
                    if digits > 0 {
                        let n: usize = sql[i + 1..i + 1 + digits].parse().unwrap_or(0);
                        if !text.is_empty() {
                            parts.push(Part::Text(std::mem::take(&mut text)));
                        }
                        parts.push(Part::Param(n.saturating_sub(1)));
                        i += 1 + digits;
                    } else {
                        // A dollar quote, `$$…$$` or `$tag$…$tag$`: copied whole.
                        let tag_len = b[i + 1..].iter().position(|&c| c == b'$').filter(|&p| {
                            b[i + 1..i + 1 + p]
                                .iter()
                                .all(|c| c.is_ascii_alphanumeric() || *c == b'_')
                        });
                        match tag_len {
                            Some(p) => {
                                let tag = &b[i..i + p + 2];
                                let body = i + tag.len();
                                let end = b[body..]
                                    .windows(tag.len())
                                    .position(|w| w == tag)
                                    .map_or(b.len(), |q| body + q + tag.len());
                                copy(&mut text, i, end);
                                i = end;
                            }
                            None => {
                                text.push('$');
                                i += 1;
                            }
                        }
                    }
                }
                _ => {
                    // Up to the next byte that may start something above.
                    let next = b[i + 1..]
                        .iter()
                        .position(|c| matches!(c, b'\'' | b'"' | b'-' | b'/' | b'$'))
                        .map_or(b.len(), |p| i + 1 + p);
                    copy(&mut text, i, next);
                    i = next;
                }
            }
        }
        if !text.is_empty() {
            parts.push(Part::Text(text));
        }
        let len = parts
            .iter()
            .map(|p| match p {
                Part::Text(t) => t.len(),
                Part::Param(_) => 0,
            })
            .sum();
        Template { parts, len }
    }

    /// `prefix`, then the statement with each placeholder replaced by its value's literal.
    pub(crate) fn render(&self, prefix: &str, args: &[Arg<'_>]) -> sqlx::Result<String> {
        let mut out = String::with_capacity(prefix.len() + self.len + 64 * args.len());
        out.push_str(prefix);
        for part in &self.parts {
            match part {
                Part::Text(t) => out.push_str(t),
                Part::Param(n) => match args.get(*n) {
                    Some(arg) => arg.write_literal(&mut out)?,
                    None => {
                        return Err(sqlx::Error::Encode(
                            format!("no value for placeholder ${} of the statement", n + 1).into(),
                        ))
                    }
                },
            }
        }
        Ok(out)
    }

    /// The highest placeholder number in the statement (0 for none).
    #[cfg(test)]
    pub(crate) fn params(&self) -> usize {
        self.parts
            .iter()
            .filter_map(|p| match p {
                Part::Param(n) => Some(n + 1),
                Part::Text(_) => None,
            })
            .max()
            .unwrap_or(0)
    }
}

/// `sql` with `args` in place of its placeholders and nothing before it: one statement inside
/// the caller's own transaction (`fence`).
pub(crate) fn inline(sql: &str, args: &[Arg<'_>]) -> sqlx::Result<String> {
    Template::parse(sql).render("", args)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(sql: &str, args: &[Arg<'_>]) -> String {
        Template::parse(sql).render("", args).unwrap()
    }

    #[test]
    fn placeholders_are_found_outside_quotes_and_comments_only() {
        let sql = "SELECT $1, '$2', \"$3\", $$ $4 $$, $q$ $5 $q$ -- $6 here\n, /* $7 /* $8 */ */ $10, a$1, $2";
        let t = Template::parse(sql);
        assert_eq!(
            t.parts
                .iter()
                .filter_map(|p| match p {
                    Part::Param(n) => Some(n + 1),
                    Part::Text(_) => None,
                })
                .collect::<Vec<_>>(),
            vec![1, 10, 2]
        );
        let args: Vec<Arg<'_>> = (1..=10).map(|i| Arg::Int8(i * 100)).collect();
        assert_eq!(
            t.render("", &args).unwrap(),
            "SELECT '100'::int8, '$2', \"$3\", $$ $4 $$, $q$ $5 $q$ \n,   '1000'::int8, a$1, '200'::int8"
        );
    }

    #[test]
    fn text_literals_escape_quotes_and_backslashes_and_refuse_nul() {
        assert_eq!(render("$1", &[Arg::Text("a'b\\c")]), r"E'a''b\\c'::text");
        assert_eq!(
            render("$1", &[Arg::Text("'; DROP TABLE x; --")]),
            "E'''; DROP TABLE x; --'::text"
        );
        // A value that looks like a placeholder stays a value: rendering is one pass.
        assert_eq!(
            render("$1 $2", &[Arg::Text("$2"), Arg::Int4(-3)]),
            "E'$2'::text '-3'::int4"
        );
        assert!(matches!(
            Template::parse("$1").render("", &[Arg::Text("a\0b")]),
            Err(sqlx::Error::Encode(_))
        ));
    }

    #[test]
    fn every_type_has_its_literal() {
        assert_eq!(
            render("$1", &[Arg::Float8(30_000_000.0)]),
            "'30000000.0'::float8"
        );
        assert_eq!(render("$1", &[Arg::Float8(1e300)]), "'1e300'::float8");
        assert_eq!(
            render("$1", &[Arg::Float8(f64::INFINITY)]),
            "'Infinity'::float8"
        );
        assert_eq!(render("$1", &[Arg::Bool(true)]), "true");
        assert_eq!(render("$1", &[Arg::OptInt2(None)]), "NULL::int2");
        assert_eq!(render("$1", &[Arg::OptInt2(Some(2))]), "'2'::int2");
        assert_eq!(render("$1", &[Arg::OptInt8(None)]), "NULL::int8");
        assert_eq!(
            render("$1", &[Arg::OptInt8(Some(i64::MIN))]),
            "'-9223372036854775808'::int8"
        );
        assert_eq!(
            render("$1", &[Arg::TextArray(&["a", "b'"])]),
            "ARRAY[E'a', E'b''']::text[]"
        );
        assert_eq!(render("$1", &[Arg::TextArray(&[])]), "'{}'::text[]");
        assert_eq!(
            render(
                "$1 $2",
                &[Arg::Int8Array(&[1, -2]), Arg::Float8Array(&[0.5])]
            ),
            "ARRAY['1', '-2']::int8[] ARRAY['0.5']::float8[]"
        );
    }

    #[test]
    fn a_missing_value_is_an_error_not_a_panic() {
        assert!(Template::parse("$3").render("", &[]).is_err());
    }

    #[test]
    fn the_prefix_sets_the_transaction_up() {
        let p = Pooler::new(Duration::from_millis(2500));
        assert_eq!(
            p.prefix(),
            "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; SET LOCAL statement_timeout = 2500; \
             SET LOCAL lock_timeout = 250;\n"
        );
    }
}
