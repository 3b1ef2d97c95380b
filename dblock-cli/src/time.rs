//! Times and durations as the tool reads and prints them: RFC 3339 UTC timestamps (JSON), short
//! UTC times and relative times ("in 12s", "3m ago") for people, and durations such as `1d`,
//! `1m30s`, `500ms` on the command line.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch (negative before it) and the microseconds within that second.
fn epoch_parts(t: SystemTime) -> (i64, u32) {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs() as i64, d.subsec_micros()),
        Err(e) => {
            let d = e.duration();
            let (secs, micros) = (d.as_secs() as i64, d.subsec_micros());
            if micros == 0 {
                (-secs, 0)
            } else {
                (-secs - 1, 1_000_000 - micros)
            }
        }
    }
}

/// Year, month, day of the `days`-th day after 1970-01-01 (proleptic Gregorian calendar).
fn date(days: i64) -> (i64, u32, u32) {
    // Days counted from 0000-03-01, so that the leap day ends each 400-year era's year.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_from_march + 2) / 5 + 1) as u32;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// The calendar fields of `t` in UTC: (year, month, day, hour, minute, second, microsecond).
fn fields(t: SystemTime) -> (i64, u32, u32, u32, u32, u32, u32) {
    let (secs, micros) = epoch_parts(t);
    let (y, mo, d) = date(secs.div_euclid(86_400));
    let in_day = secs.rem_euclid(86_400) as u32;
    (
        y,
        mo,
        d,
        in_day / 3600,
        in_day / 60 % 60,
        in_day % 60,
        micros,
    )
}

/// `2026-11-27T03:20:12.123456Z`: RFC 3339, UTC, microseconds (the JSON output's times).
pub fn rfc3339(t: SystemTime) -> String {
    let (y, mo, d, h, mi, s, us) = fields(t);
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}.{us:06}Z")
}

/// `03:20:12Z` when `t` falls on the same UTC day as `now`, else `2026-11-27 03:20:12Z`.
pub fn short(t: SystemTime, now: SystemTime) -> String {
    let (y, mo, d, h, mi, s, _) = fields(t);
    let (ny, nmo, nd, ..) = fields(now);
    if (y, mo, d) == (ny, nmo, nd) {
        format!("{h:02}:{mi:02}:{s:02}Z")
    } else {
        format!("{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}Z")
    }
}

/// A length the operator gave (an interval, a ttl, an age), said back: in milliseconds when it
/// is under a minute and not whole seconds (`500ms`, `1500ms`), else as [`span`].
pub fn given(d: Duration) -> String {
    if d < Duration::from_secs(60) && d.subsec_nanos() != 0 {
        format!("{}ms", d.as_millis())
    } else {
        span(d)
    }
}

/// A length of time in at most two units, rounded down: `0s`, `12s`, `3m`, `3m12s`, `2h5m`,
/// `4d3h`.
pub fn span(d: Duration) -> String {
    let s = d.as_secs();
    let (big, big_unit, small, small_unit) = match s {
        0..60 => return format!("{s}s"),
        60..3600 => (s / 60, "m", s % 60, "s"),
        3600..86_400 => (s / 3600, "h", s / 60 % 60, "m"),
        _ => (s / 86_400, "d", s / 3600 % 24, "h"),
    };
    if small == 0 {
        format!("{big}{big_unit}")
    } else {
        format!("{big}{big_unit}{small}{small_unit}")
    }
}

/// `t` relative to `now`: `in 12s` or `3m ago`.
pub fn relative(t: SystemTime, now: SystemTime) -> String {
    match t.duration_since(now) {
        Ok(ahead) if ahead >= Duration::from_secs(1) => format!("in {}", span(ahead)),
        Ok(_) => "now".to_owned(),
        Err(e) => format!("{} ago", span(e.duration())),
    }
}

/// A duration as written on the command line: a whole number and a unit, or several
/// (`1d`, `12h`, `30m`, `1m30s`, `45s`, `500ms`, `0s`). A bare number is seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("invalid duration {s:?}: expected like 1d, 12h, 30m, 1m30s, 0s, 500ms");
    if s.is_empty() {
        return Err(bad());
    }
    if s.bytes().all(|b| b.is_ascii_digit()) {
        return s.parse().map(Duration::from_secs).map_err(|_| bad());
    }
    let mut total = Duration::ZERO;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        if digits == 0 {
            return Err(bad());
        }
        let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let part = match &rest[..unit_len] {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n.checked_mul(60).ok_or_else(bad)?),
            "h" => Duration::from_secs(n.checked_mul(3600).ok_or_else(bad)?),
            "d" => Duration::from_secs(n.checked_mul(86_400).ok_or_else(bad)?),
            _ => return Err(bad()),
        };
        total = total.checked_add(part).ok_or_else(bad)?;
        rest = &rest[unit_len..];
    }
    Ok(total)
}

/// A lease for `steal`: more than zero and at most 100 years, as the library takes it.
pub fn parse_ttl(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err(format!("ttl {s:?} is zero: a lease must last"));
    }
    if d > Duration::from_secs(36_500 * 86_400) {
        return Err(format!("ttl {s:?} is longer than 100 years"));
    }
    Ok(d)
}

/// A refresh interval: a duration of at least 100 ms (a shorter one would only load the
/// database).
pub fn parse_interval(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_millis(100) {
        return Err(format!("interval {s:?} is shorter than 100ms"));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64, micros: u32) -> SystemTime {
        if secs >= 0 {
            UNIX_EPOCH + Duration::new(secs as u64, micros * 1000)
        } else {
            UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs())
                + Duration::from_micros(micros.into())
        }
    }

    #[test]
    fn rfc3339_in_utc() {
        assert_eq!(rfc3339(at(0, 0)), "1970-01-01T00:00:00.000000Z");
        // 2026-11-27T03:20:12Z
        assert_eq!(
            rfc3339(at(1_795_749_612, 123_456)),
            "2026-11-27T03:20:12.123456Z"
        );
        // Leap days and century rules.
        assert_eq!(rfc3339(at(951_782_400, 0)), "2000-02-29T00:00:00.000000Z");
        assert_eq!(rfc3339(at(4_107_542_400, 0)), "2100-03-01T00:00:00.000000Z");
        assert_eq!(rfc3339(at(-1, 500_000)), "1969-12-31T23:59:59.500000Z");
    }

    #[test]
    fn short_times_drop_the_date_of_today() {
        let now = at(1_795_749_612, 0);
        assert_eq!(short(at(1_795_749_600, 0), now), "03:20:00Z");
        assert_eq!(
            short(at(1_795_749_612 - 86_400, 0), now),
            "2026-11-26 03:20:12Z"
        );
    }

    #[test]
    fn relative_times() {
        let now = at(1_000_000, 0);
        assert_eq!(relative(at(1_000_012, 400_000), now), "in 12s");
        assert_eq!(relative(at(1_000_000 - 180, 0), now), "3m ago");
        assert_eq!(relative(at(1_000_000 - 192, 0), now), "3m12s ago");
        assert_eq!(relative(at(1_000_000 + 7500, 0), now), "in 2h5m");
        assert_eq!(relative(at(1_000_000 - 4 * 86_400, 0), now), "4d ago");
        assert_eq!(relative(now, now), "now");
    }

    #[test]
    fn given_lengths_are_said_back_as_given() {
        assert_eq!(given(Duration::from_millis(500)), "500ms");
        assert_eq!(given(Duration::from_millis(1500)), "1500ms");
        assert_eq!(given(Duration::from_secs(5)), "5s");
        assert_eq!(given(Duration::ZERO), "0s");
        assert_eq!(given(Duration::from_secs(90)), "1m30s");
        assert_eq!(given(Duration::from_secs(86_400)), "1d");
    }

    #[test]
    fn durations_parse() {
        for (s, secs, ms) in [
            ("0s", 0, 0),
            ("0", 0, 0),
            ("45", 45, 0),
            ("1d", 86_400, 0),
            ("12h", 43_200, 0),
            ("30m", 1800, 0),
            ("1m30s", 90, 0),
            ("500ms", 0, 500),
            ("1s500ms", 1, 500),
        ] {
            assert_eq!(
                parse_duration(s).unwrap(),
                Duration::from_secs(secs) + Duration::from_millis(ms),
                "{s}"
            );
        }
        for bad in [
            "",
            "1x",
            "d",
            "-1s",
            "1.5s",
            "1 s",
            "s1",
            "99999999999999999999d",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
