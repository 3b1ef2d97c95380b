//! Deadlines from durations a caller gives: any `Duration` up to `Duration::MAX` is accepted and
//! none overflows an `Instant` (an addition that would panics in `std`).

use std::time::Duration;

use tokio::time::Instant;

/// Longer than any wait anyone means: a `wait` (or any other bound) beyond it is taken as it.
/// 100 years: still far inside what an `Instant` can hold on every platform.
pub(crate) const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `start + d`, with `d` cut to [`FOREVER`].
pub(crate) fn after(start: Instant, d: Duration) -> Instant {
    let d = d.min(FOREVER);
    start
        .checked_add(d)
        .or_else(|| start.checked_add(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_duration_overflows() {
        let now = Instant::now();
        assert_eq!(after(now, Duration::MAX), now + FOREVER);
        assert_eq!(
            after(now, Duration::from_secs(1)),
            now + Duration::from_secs(1)
        );
    }
}
