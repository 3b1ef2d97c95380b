//! What the dialects' coalesced statements share: the padding of a statement whose text grows
//! with its rows (SQLite's `VALUES`, MySQL's derived tables), so that a connection prepares a
//! few texts instead of one per batch size.

/// How many entries the statement of a batch of `n` rows lists, where a backend's statement
/// text grows with its rows (SQLite's `VALUES`, MySQL's derived tables): the next power of two,
/// at least 2, the rest padding that matches nothing. A connection then prepares seven texts
/// per statement rather than one per batch size, which would overflow sqlx's cache of 100
/// prepared statements per connection and prepare again and again (measured on MariaDB at 64
/// owners: p99 109 ms instead of 28 ms).
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) fn listed(n: usize) -> usize {
    n.max(2).next_power_of_two()
}

/// `q` with the padding of a list that holds `n` rows of `width` values: NULLs up to
/// [`listed`]`(n)` rows (a NULL key matches nothing; the real rows come first, so the list's
/// column types are theirs).
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) fn pad<DB: sqlx::Database>(
    mut q: sqlx::query::Query<'_, DB, DB::Arguments>,
    n: usize,
    width: usize,
) -> sqlx::query::Query<'_, DB, DB::Arguments>
where
    for<'t> Option<i64>: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    for _ in 0..(listed(n) - n) * width {
        q = q.bind(None::<i64>);
    }
    q
}
