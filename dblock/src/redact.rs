//! Connection strings in messages: one redaction used wherever a URL can appear (an error, a log
//! field, a span, a `Debug`), so that a password never does.

use std::fmt;

/// What stands where a secret was.
const HIDDEN: &str = "***";

/// `url` without its secrets: the password of its user part (`user:***@host`) and the value of
/// every parameter whose name says password (`?password=***`, `sslpassword=***`). A string that
/// is not a URL at all (a libpq-style `host=… password=…`, a typo) is never echoed: only a short
/// scheme-like prefix of it, or nothing.
pub(crate) fn redact(url: &str) -> String {
    let Some(scheme) = scheme(url) else {
        return "(a connection string that is not a URL)".to_owned();
    };
    let rest = &url[scheme.len() + 1..];
    if !rest.starts_with("//") && !scheme.eq_ignore_ascii_case("sqlite") {
        // `x:` and anything but a URL after it: the scheme alone.
        return format!("{scheme}:…");
    }
    let mut out = format!("{scheme}:");
    // The user part runs to the *last* `@` of the whole URL: a password may hold `/`, `?`, `#`,
    // `@` and `:`, and a parser that ends the authority at the first `?` would otherwise let
    // `u:pa?ss@h` through as a path and a query. What stands before the user's first `:` is
    // shown; if a `/`, `?` or `#` comes before any `:` (an `@` in a query, say), none of it is.
    let rest = match rest
        .strip_prefix("//")
        .and_then(|a| a.rfind('@').map(|at| (a, at)))
    {
        Some((authority, at)) => {
            let userinfo = &authority[..at];
            out.push_str("//");
            match userinfo.find([':', '/', '?', '#']) {
                Some(colon) if userinfo[colon..].starts_with(':') => {
                    push_params(&mut out, &userinfo[..colon]);
                    out.push(':');
                    out.push_str(HIDDEN);
                }
                Some(_) => out.push_str(HIDDEN),
                None => push_params(&mut out, userinfo),
            }
            out.push('@');
            &authority[at + 1..]
        }
        None => rest,
    };
    // Host, path and query: every `name=value` whose name says secret is hidden, wherever it
    // stands (a `?` may have gone into the user part above, and a stray one may hide a
    // `password=` inside another parameter's value): split at every `&`, `?` and `;`.
    push_params(&mut out, rest);
    out
}

/// `text` pushed onto `out` with the value of every `name=value` whose name says secret hidden:
/// split at every `&`, `?` and `;`, so that a stray separator cannot hide a `password=` inside
/// another parameter's value.
fn push_params(out: &mut String, text: &str) {
    for param in text.split_inclusive(['&', '?', ';']) {
        let (body, sep) = match param.char_indices().last() {
            Some((at, '&' | '?' | ';')) => (&param[..at], &param[at..]),
            _ => (param, ""),
        };
        match body.split_once('=') {
            Some((name, _)) if secret(name) => {
                out.push_str(name);
                out.push('=');
                out.push_str(HIDDEN);
            }
            _ => out.push_str(body),
        }
        out.push_str(sep);
    }
}

/// `message` (say, a driver's error about `url`) with every secret of `url` in it replaced: the
/// password of its user part and the values of its secret parameters, as written and
/// percent-decoded.
pub(crate) fn scrub(message: &str, url: &str) -> String {
    let mut secrets: Vec<String> = Vec::new();
    // As `redact` reads it: the user part runs to the last `@` (a password may hold `?`).
    if let Some(authority) = url.split_once("://").map(|(_, a)| a) {
        if let Some((userinfo, _)) = authority.rsplit_once('@') {
            if let Some((_, password)) = userinfo.split_once(':') {
                secrets.push(password.to_owned());
            }
        }
    }
    // Every `name=value` anywhere in the URL: scrubbing a value too many costs nothing.
    for param in url.split(['&', '?', ';', '#', '/']) {
        if let Some((name, value)) = param.split_once('=') {
            if secret(name) {
                secrets.push(value.to_owned());
            }
        }
    }
    let mut out = message.to_owned();
    for secret in secrets.into_iter().filter(|s| !s.is_empty()) {
        let decoded = percent_decoded(&secret);
        for form in [secret, decoded] {
            if !form.is_empty() {
                out = out.replace(&form, HIDDEN);
            }
        }
    }
    out
}

/// `s` with its `%XX` escapes decoded (bytes that do not make UTF-8 replaced).
fn percent_decoded(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi * 16 + lo) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The scheme of `url` (before its first `:`), if it looks like one: a letter, then up to 31
/// letters, digits, `+`, `-` or `.`.
pub(crate) fn scheme(url: &str) -> Option<&str> {
    let (scheme, _) = url.split_once(':')?;
    let mut chars = scheme.chars();
    let ok = scheme.len() <= 32
        && chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    ok.then_some(scheme)
}

/// A parameter whose value is a secret: its name mentions a password (`password`,
/// `sslpassword`, `passwd`, `pwd`), or a key or token.
fn secret(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["pass", "pwd", "secret", "token", "key"]
        .iter()
        .any(|word| name.contains(word))
}

/// A URL shown redacted by `Display` and `Debug`.
pub(crate) struct Redacted<'a>(pub(crate) &'a str);

impl fmt::Display for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact(self.0))
    }
}

impl fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", redact(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_reach_messages() {
        for (url, shown) in [
            ("postgres://u:secret@h/db", "postgres://u:***@h/db"),
            ("mysql://root@h/db", "mysql://root@h/db"),
            ("sqlite://x.db", "sqlite://x.db"),
            ("sqlite::memory:", "sqlite::memory:"),
            // A SQLite file name with an `@`: hidden before it, rather than a password shown.
            ("sqlite:///tmp/a@b.db", "sqlite://***@b.db"),
            ("postgres://u:p@ss/w@rd@h:5/db", "postgres://u:***@h:5/db"),
            (
                "postgres://u@h/db?password=secret&sslmode=require",
                "postgres://u@h/db?password=***&sslmode=require",
            ),
            (
                "postgres://h/db?sslpassword=secret&user=u",
                "postgres://h/db?sslpassword=***&user=u",
            ),
            (
                "host=h user=u password=secret",
                "(a connection string that is not a URL)",
            ),
            ("pg:host=h password=secret", "pg:…"),
            ("sqlite:?=?password=secret", "sqlite:?=?password=***"),
            (
                "postgres://h/d?a=1;pwd=secret&b",
                "postgres://h/d?a=1;pwd=***&b",
            ),
            ("", "(a connection string that is not a URL)"),
            // A password holding `?` or `#`: not a query, not a fragment.
            ("postgres://app:pa?ss@h/db", "postgres://app:***@h/db"),
            (
                "mysql://app:p#x?secret@h:3306/db",
                "mysql://app:***@h:3306/db",
            ),
            (
                "postgres://app:x?password=1&secret@h/db?sslmode=require",
                "postgres://app:***@h/db?sslmode=require",
            ),
            // An `@` in a query: the part before it is hidden whole, never shown.
            (
                "postgres://h/db?password=secret&application_name=a@b",
                "postgres://***@b",
            ),
            // The `?` went into the user part: the query's secrets are hidden all the same.
            (
                "host://127.0.0.1:1/db?@&password=secret",
                "host://127.0.0.1:***@&password=***",
            ),
        ] {
            assert_eq!(redact(url), shown, "{url}");
            assert!(!redact(url).contains("secret"));
        }
    }

    #[test]
    fn a_drivers_message_loses_the_secrets_of_its_url() {
        let url = "postgres://u:s%3Fcret@h:x/db?sslpassword=other";
        assert_eq!(
            scrub("bad port in u:s%3Fcret@h:x, s?cret, other", url),
            "bad port in u:***@h:x, ***, ***"
        );
        assert_eq!(
            scrub("invalid port in app:pa?ss@h", "postgres://app:pa?ss@h/db"),
            "invalid port in app:***@h"
        );
    }
}
