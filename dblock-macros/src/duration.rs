//! Durations written as literals (`"30s"`, `"500ms"`, `"1m30s"`, `"2h"`), parsed at compile time.

use std::time::Duration;

/// Parses a sequence of `<integer><unit>` parts, units `h`, `m`, `s`, `ms`, `us` (or `µs`).
///
/// Input: `"1m30s"` — Output: `Ok(Duration::from_secs(90))`.
pub(crate) fn parse(text: &str) -> Result<Duration, String> {
    let s = text.trim();
    if s.is_empty() {
        return Err("empty duration; write it like \"30s\", \"500ms\", \"1m30s\" or \"2h\"".into());
    }
    if s.starts_with('-') {
        return Err(format!(
            "negative duration `{s}`; durations must be positive"
        ));
    }
    let mut total: u128 = 0; // nanoseconds
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        if digits == 0 {
            return Err(format!(
                "invalid duration `{s}`: expected a number at `{rest}`; write it like \"30s\", \"500ms\", \"1m30s\" or \"2h\""
            ));
        }
        let number: u128 = rest[..digits]
            .parse()
            .map_err(|_| format!("duration `{s}` is too large"))?;
        rest = &rest[digits..];
        let unit_len = rest.len() - rest.trim_start_matches(|c: char| c.is_alphabetic()).len();
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        let nanos_per: u128 = match unit {
            "h" => 3_600_000_000_000,
            "m" => 60_000_000_000,
            "s" => 1_000_000_000,
            "ms" => 1_000_000,
            "us" | "µs" => 1_000,
            "" => {
                return Err(format!(
                    "duration `{s}` needs a unit after {number}: one of `h`, `m`, `s`, `ms`, `us`"
                ))
            }
            other => {
                return Err(format!(
                    "unknown unit `{other}` in duration `{s}`; expected one of `h`, `m`, `s`, `ms`, `us`"
                ))
            }
        };
        total = number
            .checked_mul(nanos_per)
            .and_then(|n| total.checked_add(n))
            .ok_or_else(|| format!("duration `{s}` is too large"))?;
    }
    let secs =
        u64::try_from(total / 1_000_000_000).map_err(|_| format!("duration `{s}` is too large"))?;
    Ok(Duration::new(secs, (total % 1_000_000_000) as u32))
}

#[cfg(test)]
mod tests {
    use super::parse;
    use std::time::Duration;

    #[test]
    fn accepts_the_documented_forms() {
        assert_eq!(parse("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse("1h2m3s4ms"), Ok(Duration::from_millis(3_723_004)));
        assert_eq!(parse("250us"), Ok(Duration::from_micros(250)));
        assert_eq!(parse("0s"), Ok(Duration::ZERO));
        assert_eq!(parse(" 5s "), Ok(Duration::from_secs(5)));
    }

    #[test]
    fn refuses_malformed_input_with_a_reason() {
        for bad in [
            "",
            "30x",
            "-1s",
            "s",
            "30",
            "1.5s",
            "30 s",
            "1m 30s",
            "ms30",
            "99999999999999999999999999999999999999999h",
        ] {
            let e = parse(bad).expect_err(bad);
            assert!(!e.is_empty());
        }
        assert!(parse("30x").unwrap_err().contains("unknown unit `x`"));
        assert!(parse("-1s").unwrap_err().contains("negative"));
    }

    proptest::proptest! {
        #[test]
        fn never_panics(s in "\\PC*") {
            let _ = parse(&s);
        }

        #[test]
        fn round_trips_whole_seconds(n in 0u64..1_000_000_000) {
            proptest::prop_assert_eq!(parse(&format!("{n}s")), Ok(Duration::from_secs(n)));
        }
    }
}
