//! The attribute's arguments: `key = ..., ttl = ..., wait = ..., locker = ..., renew = ...,
//! min_hold = ..., max_hold = ..., lock_delay = ..., once = ..., fair = ..., reentrant = ...,
//! permits = ...,
//! shared = ..., tx = ..., proof = ..., crate = ...`.

use std::time::Duration;

use proc_macro2::Span;
use syn::ext::IdentExt;
use syn::parse::{ParseStream, Parser};
use syn::{Expr, ExprLit, Ident, Lit, LitStr, Path, Token};

use crate::duration;
use crate::errors::Errors;

/// The argument names, in the order the messages list them ([`valid`]).
const NAMES: [&str; 16] = [
    "key",
    "ttl",
    "wait",
    "locker",
    "renew",
    "min_hold",
    "max_hold",
    "lock_delay",
    "once",
    "fair",
    "reentrant",
    "permits",
    "shared",
    "tx",
    "proof",
    "crate",
];

/// The valid names as the messages list them: `` `key`, `ttl`, ... ``.
fn valid() -> String {
    NAMES.map(|name| format!("`{name}`")).join(", ")
}

pub(crate) enum Key {
    /// A string literal: a template checked against the parameters.
    Template(LitStr),
    /// Any other expression, formatted with `Display`.
    Expr(Expr),
    /// `[k1, k2, ...]`: several keys, all taken or none.
    List(Vec<Key>, proc_macro2::Span),
}

pub(crate) enum Dur {
    /// A literal parsed at compile time; the span is the literal's.
    Lit(Duration, Span),
    /// Any expression of type `Duration`.
    Expr(Expr),
}

/// What kind of hold the body runs under.
#[derive(Default)]
pub(crate) enum Kind {
    /// The exclusive lock of the key (or of every key of a list): the default.
    #[default]
    Lock,
    /// `shared = true`: a shared (read) hold of the key; the span is the `true`'s.
    Read(Span),
    /// `permits = N`: one permit of the key's counting semaphore of `N`.
    Permit(Expr),
    /// `tx = tx`: the key (or every key of a list) taken inside the body's transaction, the
    /// parameter named.
    InTx(Ident),
}

impl Kind {
    /// How the kind is named in messages, where they point, and why it takes one key.
    fn named(&self) -> Option<(&'static str, Span, &'static str)> {
        match self {
            Kind::Lock | Kind::InTx(_) => None,
            Kind::Read(span) => Some((
                "`shared = true`",
                *span,
                "a read hold is of one key, not a list",
            )),
            Kind::Permit(n) => Some((
                "`permits`",
                syn::spanned::Spanned::span(n),
                "a semaphore is one key with several holders, not a list of keys",
            )),
        }
    }
}

/// The options that only the exclusive lock takes: every other kind refuses them. The one
/// exclusion table of the attribute.
const LOCK_ONLY: [&str; 3] = ["min_hold", "once", "fair"];

/// The options of a lease, which a lock inside the body's transaction (`tx = ..`) has not: its
/// row lock lasts as long as the transaction, and the commit ends it.
const LEASE_ONLY: [&str; 8] = [
    "ttl",
    "renew",
    "min_hold",
    "max_hold",
    "lock_delay",
    "once",
    "fair",
    "permits` or `shared",
];

#[derive(Default)]
pub(crate) struct Args {
    pub key: Option<Key>,
    pub ttl: Option<Dur>,
    pub wait: Option<Dur>,
    pub locker: Option<Expr>,
    pub renew: Option<Expr>,
    pub min_hold: Option<Dur>,
    pub max_hold: Option<Dur>,
    pub lock_delay: Option<Dur>,
    pub once: Option<Expr>,
    pub fair: Option<Expr>,
    pub reentrant: Option<Expr>,
    pub kind: Kind,
    pub proof: Option<Proof>,
    /// The argument list did not parse (its error is reported): nothing else is said missing.
    pub unparsed: bool,
    pub krate: Option<Path>,
}

/// `proof = held` or `proof = held: AccountLock`: the name the body's proof of holding
/// (`dblock::Held`) goes by, and the marker of a typed proof.
pub(crate) struct Proof {
    pub name: Ident,
    pub marker: Option<Path>,
}

/// One `name = value` pair, before it is checked.
struct Pair {
    name: Ident,
    value: Expr,
    /// `proof = held: Marker`: the marker after the name.
    marker: Option<Path>,
}

fn pair(input: ParseStream<'_>) -> syn::Result<Pair> {
    let name = input.call(Ident::parse_any)?;
    if !input.peek(Token![=]) {
        let label = name.unraw().to_string();
        return Err(syn::Error::new(
            name.span(),
            if NAMES.contains(&label.as_str()) {
                format!("expected `{name} = ...`; arguments are written `name = value` (valid names: {})", valid())
            } else {
                format!(
                    "unknown argument `{label}`; expected one of {}, each written `name = value`",
                    valid()
                )
            },
        ));
    }
    input.parse::<Token![=]>()?;
    let value = input.parse()?;
    let marker = if name == "proof" && input.peek(Token![:]) {
        input.parse::<Token![:]>()?;
        Some(input.parse()?)
    } else {
        None
    };
    Ok(Pair {
        name,
        value,
        marker,
    })
}

/// The `name = value` pairs, each parsed on its own: one that does not parse is reported and
/// skipped to the next top-level comma, and the others are still read (so their errors are
/// reported in the same build). `true` when one did not parse.
fn pairs(input: ParseStream<'_>, errors: &mut Errors) -> syn::Result<(Vec<Pair>, bool)> {
    let (mut pairs, mut unparsed) = (Vec::new(), false);
    while !input.is_empty() {
        match pair(input) {
            Ok(p) if input.is_empty() || input.peek(Token![,]) => pairs.push(p),
            Ok(p) => {
                pairs.push(p);
                errors.push(input.error("expected `,` between arguments"));
                unparsed = true;
                skip_to_comma(input)?;
            }
            Err(e) => {
                errors.push(e);
                unparsed = true;
                skip_to_comma(input)?;
            }
        }
        if !input.is_empty() {
            input.parse::<Token![,]>()?;
        }
    }
    Ok((pairs, unparsed))
}

/// Skips the rest of an argument that did not parse, up to the comma after it (or the end).
fn skip_to_comma(input: ParseStream<'_>) -> syn::Result<()> {
    input.step(|cursor| {
        let mut rest = *cursor;
        while let Some((tt, next)) = rest.token_tree() {
            if matches!(&tt, proc_macro2::TokenTree::Punct(p) if p.as_char() == ',') {
                return Ok(((), rest));
            }
            rest = next;
        }
        Ok(((), rest))
    })
}

/// Parses every argument, recording every problem in `errors` (all are reported together).
pub(crate) fn parse(tokens: proc_macro2::TokenStream, errors: &mut Errors) -> Args {
    let mut args = Args::default();
    // `permits = N` and `shared = ..`, before they decide the kind.
    let (mut permits, mut shared): (Option<Expr>, Option<Expr>) = (None, None);
    let mut tx: Option<Ident> = None;
    let (pairs, unparsed) = match (|input: ParseStream<'_>| pairs(input, errors)).parse2(tokens) {
        Ok(p) => p,
        Err(e) => {
            errors.push(e);
            (Vec::new(), true)
        }
    };
    args.unparsed = unparsed;
    let mut seen: Vec<String> = Vec::new();
    for Pair {
        name,
        value,
        marker,
    } in pairs
    {
        let label = name.unraw().to_string();
        // A second copy is reported even when the first was refused (its value invalid).
        if NAMES.contains(&label.as_str()) {
            if seen.contains(&label) {
                errors.push(syn::Error::new(
                    name.span(),
                    format!("duplicate argument `{name}`"),
                ));
                continue;
            }
            seen.push(label.clone());
        }
        match label.as_str() {
            "key" => set(&mut args.key, key(value), &name, errors),
            "ttl" => {
                let d = duration_arg(value, "ttl", errors);
                set(&mut args.ttl, d, &name, errors)
            }
            "wait" => {
                let d = duration_arg(value, "wait", errors);
                set(&mut args.wait, d, &name, errors)
            }
            "locker" => set(&mut args.locker, Some(value), &name, errors),
            "renew" => set(&mut args.renew, Some(value), &name, errors),
            "min_hold" => {
                let d = duration_arg(value, "min_hold", errors);
                set(&mut args.min_hold, d, &name, errors)
            }
            "max_hold" => {
                let d = duration_arg(value, "max_hold", errors);
                set(&mut args.max_hold, d, &name, errors)
            }
            "lock_delay" => {
                let d = duration_arg(value, "lock_delay", errors);
                set(&mut args.lock_delay, d, &name, errors)
            }
            "once" => set(&mut args.once, Some(value), &name, errors),
            "fair" => set(&mut args.fair, Some(value), &name, errors),
            "reentrant" => set(&mut args.reentrant, Some(value), &name, errors),
            "permits" => set(&mut permits, Some(value), &name, errors),
            "shared" => set(&mut shared, Some(value), &name, errors),
            "tx" => {
                let t = tx_arg(value, errors);
                set(&mut tx, t, &name, errors)
            }
            "proof" => {
                let p = proof(value, marker, errors);
                set(&mut args.proof, p, &name, errors)
            }
            "crate" => {
                let p = crate_path(value, errors);
                set(&mut args.krate, p, &name, errors)
            }
            other => errors.push(syn::Error::new(
                name.span(),
                format!("unknown argument `{other}`; expected one of {}", valid()),
            )),
        }
    }
    let lease_kind = permits.is_some() || shared.is_some();
    args.kind = kind(permits, shared, errors);
    if let Some(tx) = tx {
        check_in_tx(&args, &tx, lease_kind, errors);
        args.kind = Kind::InTx(tx);
    }
    check_kind(&args, errors);
    check_max_hold(&args, errors);
    args
}

/// A literal `max_hold` shorter than a literal min_hold: the key would have to stay
/// unavailable past the cap. (Expressions are checked at run time. A max_hold shorter than the
/// ttl is allowed: it is the first lease.)
fn check_max_hold(args: &Args, errors: &mut Errors) {
    let (Some(Dur::Lit(max_hold, at)), Some(Dur::Lit(min_hold, _))) =
        (&args.max_hold, &args.min_hold)
    else {
        return;
    };
    if min_hold > max_hold {
        errors.push(syn::Error::new(
            *at,
            format!("max_hold ({max_hold:?}) is shorter than min_hold ({min_hold:?}): the key would stay unavailable past the cap; make max_hold at least the min_hold"),
        ));
    }
}

/// The kind `permits = ..` and `shared = ..` ask for. `shared` is a literal `true` or `false`
/// (whether the body reads or writes is known when it is written); the two together are
/// refused.
fn kind(permits: Option<Expr>, shared: Option<Expr>, errors: &mut Errors) -> Kind {
    let read = match &shared {
        None => None,
        Some(Expr::Lit(ExprLit {
            lit: Lit::Bool(b), ..
        })) => b.value.then_some(b.span),
        Some(other) => {
            errors.push(syn::Error::new(
                syn::spanned::Spanned::span(other),
                "`shared` takes `true` or `false`, written out: whether the body reads or writes is known when it is written",
            ));
            None
        }
    };
    match (read, permits) {
        (Some(at), Some(_)) => {
            errors.push(syn::Error::new(
                at,
                "`shared = true` cannot be combined with `permits`: a hold is a read or a permit, not both",
            ));
            Kind::Read(at)
        }
        (Some(at), None) => Kind::Read(at),
        (None, Some(n)) => {
            if let Expr::Lit(ExprLit {
                lit: Lit::Int(i), ..
            }) = &n
            {
                if i.base10_parse::<u32>().is_ok_and(|n| n == 0) {
                    errors.push(syn::Error::new(
                        i.span(),
                        "`permits` must be at least 1: a semaphore of no permits can never be taken",
                    ));
                }
            }
            Kind::Permit(n)
        }
        (None, None) => Kind::Lock,
    }
}

/// `tx = ..` takes none of [`LEASE_ONLY`]: each one given is reported, pointing at the `tx`.
fn check_in_tx(args: &Args, tx: &Ident, lease_kind: bool, errors: &mut Errors) {
    let given = [
        args.ttl.is_some(),
        args.renew.is_some(),
        args.min_hold.is_some(),
        args.max_hold.is_some(),
        args.lock_delay.is_some(),
        args.once.is_some(),
        args.fair.is_some(),
        lease_kind,
    ];
    for (name, given) in LEASE_ONLY.into_iter().zip(given) {
        if given {
            errors.push(syn::Error::new(
                tx.span(),
                format!("`tx` cannot be combined with `{name}`: a lock inside the body's transaction has no lease; the transaction's end is its end"),
            ));
        }
    }
    if args.reentrant.is_some() {
        errors.push(syn::Error::new(
            tx.span(),
            "`tx` cannot be combined with `reentrant`: a key taken inside the body's transaction is that transaction's row lock, taken once and held to its end",
        ));
    }
}

/// `tx = name`: a plain identifier, the body's parameter.
fn tx_arg(value: Expr, errors: &mut Errors) -> Option<Ident> {
    match value {
        Expr::Path(p) if p.qself.is_none() && p.attrs.is_empty() => match p.path.get_ident() {
            Some(name) if name != "self" => Some(name.clone()),
            _ => {
                errors.push(syn::Error::new_spanned(
                    p,
                    "`tx` names the body's transaction parameter: write `tx = tx` for `tx: &mut sqlx::Transaction<'_, DB>`",
                ));
                None
            }
        },
        other => {
            errors.push(syn::Error::new_spanned(
                other,
                "`tx` names the body's transaction parameter: write `tx = tx` for `tx: &mut sqlx::Transaction<'_, DB>`",
            ));
            None
        }
    }
}

/// A kind other than the lock takes one key, and none of [`LOCK_ONLY`].
fn check_kind(args: &Args, errors: &mut Errors) {
    let Some((kind, at, one_key)) = args.kind.named() else {
        return;
    };
    if let Some(Key::List(_, span)) = &args.key {
        errors.push(syn::Error::new(
            *span,
            format!("{kind} takes one key: {one_key}"),
        ));
    }
    let given = [
        args.min_hold.is_some(),
        args.once.is_some(),
        args.fair.is_some(),
    ];
    for (name, given) in LOCK_ONLY.into_iter().zip(given) {
        if given {
            errors.push(syn::Error::new(
                at,
                format!("{kind} cannot be combined with `{name}`: `{name}` is an option of the exclusive lock"),
            ));
        }
    }
    // A lock and a permit take it; a read shares its key anyway.
    if matches!(args.kind, Kind::Read(_)) && args.reentrant.is_some() {
        errors.push(syn::Error::new(
            at,
            "`shared = true` cannot be combined with `reentrant`: a read hold shares the key with every reader, its own owner's other reads included",
        ));
    }
}

/// Stores an argument, or reports it as a duplicate. The one place that checks duplicates.
fn set<T>(slot: &mut Option<T>, value: Option<T>, name: &Ident, errors: &mut Errors) {
    if slot.is_some() {
        errors.push(syn::Error::new(
            name.span(),
            format!("duplicate argument `{name}`"),
        ));
    } else {
        *slot = value;
    }
}

fn key(value: Expr) -> Option<Key> {
    Some(match value {
        Expr::Lit(ExprLit {
            lit: Lit::Str(s),
            attrs,
        }) if attrs.is_empty() => Key::Template(s),
        Expr::Array(list) => {
            let span = list.bracket_token.span.join();
            Key::List(list.elems.into_iter().filter_map(key).collect(), span)
        }
        other => Key::Expr(other),
    })
}

fn duration_arg(value: Expr, which: &str, errors: &mut Errors) -> Option<Dur> {
    match value {
        Expr::Lit(ExprLit {
            lit: Lit::Str(s), ..
        }) => match duration::parse(&s.value()) {
            Ok(d) if d.is_zero() && (which == "ttl" || which == "max_hold") => {
                errors.push(syn::Error::new(
                    s.span(),
                    format!("{which} must be greater than zero"),
                ));
                None
            }
            Ok(d) => Some(Dur::Lit(d, s.span())),
            Err(msg) => {
                errors.push(syn::Error::new(s.span(), format!("bad {which}: {msg}")));
                None
            }
        },
        Expr::Lit(ExprLit {
            lit: Lit::Int(i), ..
        }) => {
            errors.push(syn::Error::new(
                i.span(),
                format!("{which} needs a unit: write it as a string like \"{i}s\" or \"{i}ms\", or pass a `Duration`"),
            ));
            None
        }
        other => Some(Dur::Expr(other)),
    }
}

fn proof(value: Expr, marker: Option<Path>, errors: &mut Errors) -> Option<Proof> {
    match value {
        Expr::Path(p) if p.qself.is_none() && p.attrs.is_empty() => match p.path.get_ident() {
            Some(name) if name != "self" => Some(Proof {
                name: name.clone(),
                marker,
            }),
            _ => {
                errors.push(syn::Error::new_spanned(
                    p,
                    "`proof` names a variable for the body's proof of holding: write `proof = held`, or `proof = held: AccountLock` for a typed proof",
                ));
                None
            }
        },
        other => {
            errors.push(syn::Error::new_spanned(
                other,
                "`proof` names a variable for the body's proof of holding: write `proof = held`, or `proof = held: AccountLock` for a typed proof",
            ));
            None
        }
    }
}

fn crate_path(value: Expr, errors: &mut Errors) -> Option<Path> {
    match value {
        Expr::Path(p) if p.qself.is_none() => Some(p.path),
        Expr::Lit(ExprLit {
            lit: Lit::Str(s), ..
        }) => match s.parse::<Path>() {
            Ok(p) => Some(p),
            Err(_) => {
                errors.push(syn::Error::new(
                    s.span(),
                    "`crate` must be a path, like `::dblock` or `my_crate::locks`",
                ));
                None
            }
        },
        other => {
            errors.push(syn::Error::new_spanned(
                other,
                "`crate` must be a path, like `::dblock`",
            ));
            None
        }
    }
}
