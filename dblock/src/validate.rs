//! What the lock table can hold exactly: keys, lease lengths, table names, holder labels.

use std::time::Duration;

use crate::error::LockError;

/// Longest key, in bytes (the `lock_key` column's size).
pub const MAX_KEY_LEN: usize = 255;

/// Longest accepted lease: 100 years.
pub(crate) const MAX_TTL: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// A min_hold in microseconds (0: none), refused when absurdly long.
pub(crate) fn min_hold_micros(min_hold: Duration) -> Result<i64, LockError> {
    if min_hold > MAX_TTL {
        return Err(LockError::Config(format!(
            "min_hold {min_hold:?} is longer than 100 years"
        )));
    }
    Ok(min_hold.as_micros() as i64)
}

/// Refuses keys the lock table cannot hold exactly.
pub(crate) fn key(key: &str) -> Result<(), LockError> {
    if key.is_empty() {
        return Err(LockError::invalid_key(key, "the key is empty"));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(LockError::invalid_key(
            key,
            "the key is longer than 255 bytes",
        ));
    }
    if key.contains('\0') {
        return Err(LockError::invalid_key(key, "the key contains a NUL byte"));
    }
    Ok(())
}

/// A lease length in microseconds, refused when zero or absurdly long.
pub(crate) fn ttl_micros(ttl: Duration) -> Result<i64, LockError> {
    if ttl.is_zero() {
        return Err(LockError::Config("ttl must be greater than zero".into()));
    }
    if ttl > MAX_TTL {
        return Err(LockError::Config(format!(
            "ttl {ttl:?} is longer than 100 years"
        )));
    }
    // Sub-microsecond leases round up to one microsecond rather than to an already-ended lease.
    Ok((ttl.as_micros() as i64).max(1))
}

/// The lease a statement asks the database for: the ttl, plus the lock-delay that keeps the
/// key unavailable after a lease that ends without a release (the holder's own view of its
/// lease stays the ttl).
pub(crate) fn lease_micros(ttl: Duration, lock_delay: Duration) -> Result<i64, LockError> {
    ttl_micros(ttl)?;
    if lock_delay > MAX_TTL {
        return Err(LockError::Config(format!(
            "lock_delay {lock_delay:?} is longer than 100 years"
        )));
    }
    ttl_micros(ttl.saturating_add(lock_delay))
}

/// A table name is an identifier, optionally `schema.table`, at most 63 bytes a part.
pub(crate) fn table(name: &str) -> Result<(), String> {
    let parts: Vec<&str> = name.split('.').collect();
    let ok = parts.len() <= 2
        && parts.iter().all(|p| {
            let mut chars = p.chars();
            p.len() <= 63
                && chars
                    .next()
                    .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "invalid table name {name:?}: expected an identifier such as `dblock_locks` or `schema.locks`"
        ))
    }
}

/// Refuses a text a caller gives beside a key (a holder label, a metrics key) that the
/// database could not store as it is: a NUL byte. Such a text shares a statement with other
/// callers' rows when calls are coalesced, and PostgreSQL refuses a whole statement with a NUL
/// in any of its texts, so it is refused here, before it is sent, on every backend alike.
pub(crate) fn text(what: &str, s: &str) -> Result<(), LockError> {
    if s.contains('\0') {
        return Err(LockError::Config(format!(
            "the {what} {:?} contains a NUL byte, which no backend can store",
            s.chars().take(300).collect::<String>()
        )));
    }
    Ok(())
}

/// Refuses a holder label the caller gave that the `holder` column could not show whole: longer
/// than [`MAX_KEY_LEN`] bytes (the column's size, as for keys) or with a NUL byte. A label is
/// never cut silently: an operator reading `host/pid/label` sees the whole label or the call
/// fails, before anything is sent (where the host name makes the row's text longer than the
/// column, the end of the label is cut).
pub(crate) fn label(label: &str) -> Result<(), LockError> {
    if label.len() > MAX_KEY_LEN {
        return Err(LockError::Config(format!(
            "the holder label {:?}… is longer than 255 bytes",
            label.chars().take(40).collect::<String>()
        )));
    }
    text("holder label", label)
}

/// Cuts a holder text (`host/pid/label`) to the column's 255 characters.
pub(crate) fn holder(mut s: String) -> String {
    if let Some((at, _)) = s.char_indices().nth(255) {
        s.truncate(at);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked_for_length_and_emptiness() {
        assert!(key("a").is_ok());
        assert!(key(&"x".repeat(255)).is_ok());
        assert!(matches!(key(""), Err(LockError::InvalidKey { .. })));
        assert!(matches!(
            key(&"x".repeat(256)),
            Err(LockError::InvalidKey { .. })
        ));
        // 128 two-byte characters = 256 bytes: counted in bytes, not characters.
        assert!(key(&"é".repeat(128)).is_err());
        assert!(key("a\0b").is_err());
        assert!(key("'; DROP TABLE dblock_locks; --").is_ok());
    }

    #[test]
    fn table_names_are_identifiers() {
        assert!(table("dblock_locks").is_ok());
        assert!(table("app.locks").is_ok());
        assert!(table("_x1").is_ok());
        for bad in [
            "",
            "1abc",
            "a-b",
            "a.b.c",
            "x; DROP TABLE y",
            "a b",
            "\"q\"",
            &"a".repeat(64),
        ] {
            assert!(table(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn ttl_must_be_positive_and_sane() {
        assert!(ttl_micros(Duration::ZERO).is_err());
        assert!(ttl_micros(Duration::from_secs(u64::MAX)).is_err());
        assert_eq!(ttl_micros(Duration::from_millis(1500)).unwrap(), 1_500_000);
        assert_eq!(ttl_micros(Duration::from_nanos(1)).unwrap(), 1);
    }

    #[test]
    fn texts_beside_keys_have_no_nul() {
        assert!(text("holder label", "worker-1/é").is_ok());
        assert!(matches!(
            text("holder label", "bad\0holder"),
            Err(LockError::Config(m)) if m.contains("NUL")
        ));
    }

    #[test]
    fn holder_labels_are_checked_like_keys() {
        assert!(label(&"x".repeat(255)).is_ok());
        assert!(label("").is_ok());
        assert!(matches!(
            label(&"é".repeat(128)),
            Err(LockError::Config(m)) if m.contains("longer than 255 bytes")
        ));
        assert!(matches!(label("a\0b"), Err(LockError::Config(m)) if m.contains("NUL")));
    }

    #[test]
    fn holder_texts_are_cut_to_the_column() {
        assert_eq!(holder("é".repeat(300)).chars().count(), 255);
        assert_eq!(holder("host/1".into()), "host/1");
    }
}
