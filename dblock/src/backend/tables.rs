//! The names of a lock table's companions (its fair queue, its semaphores' permits) and the
//! quoting of table names.

/// The fair waiters' table of lock table `table` (validated): `<table>_queue` (see
/// [`companion`]).
pub(crate) fn queue_table(table: &str) -> String {
    companion(table, "queue")
}

/// The semaphores' permits of lock table `table` (validated): `<table>_permits`, a lock table of
/// its own (see [`companion`]) whose rows are the permit slots (`semaphore.rs`).
pub(crate) fn permits_table(table: &str) -> String {
    companion(table, "permits")
}

/// A table beside lock table `table`: `<table>_<what>`, in the same schema; where that would
/// pass the 63-byte identifier limit of PostgreSQL and MySQL, the name is cut and a hash of the
/// whole name keeps it distinct.
fn companion(table: &str, what: &str) -> String {
    let (schema, name) = match table.rsplit_once('.') {
        Some((schema, name)) => (Some(schema), name),
        None => (None, table),
    };
    let full = if name.len() + 1 + what.len() <= 63 {
        format!("{name}_{what}")
    } else {
        let hash = name.bytes().fold(0x811c_9dc5_u32, |h, b| {
            (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
        });
        format!(
            "{}_{what}_{hash:08x}",
            &name[..(63 - 10 - what.len()).min(48)]
        )
    };
    match schema {
        Some(schema) => format!("{schema}.{full}"),
        None => full,
    }
}

/// Quotes an identifier that `validate::table` already accepted.
pub(crate) fn quote_ident(name: &str, quote: char) -> String {
    name.split('.')
        .map(|part| format!("{quote}{part}{quote}"))
        .collect::<Vec<_>>()
        .join(".")
}
