//! The migration files shipped in the package (`dblock/migrations/<backend>/NNNN_name.sql`).
//! What [`Locker::migrate`](crate::Locker::migrate) runs is read from them when the crate is
//! built, so the files a team applies with its own tool and what `migrate()` runs are one text.
//!
//! A file names the default tables (`dblock_locks`, `dblock_locks_queue`, `dblock_locks_permits`);
//! `migrate()` takes from a file the statements that change one of them and runs those on the
//! locker's own table (its name in their place). Comment lines are dropped.

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
use sqlx::SqlStr;

/// Each migration's file for each backend, by number: 0001 the lock table, 0002 outcomes and
/// min_hold, 0003 exactly-once, 0004 the fair queue, 0005 the semaphores' permits (0001 to 0004
/// for `<table>_permits`, which `migrate()` runs as such), 0006 shared locks, 0007 the renewal
/// count of the admin view.
macro_rules! files {
    ($backend:literal) => {
        [
            include_str!(concat!(
                "../../migrations/",
                $backend,
                "/0001_dblock_locks.sql"
            )),
            include_str!(concat!("../../migrations/", $backend, "/0002_outcomes.sql")),
            include_str!(concat!(
                "../../migrations/",
                $backend,
                "/0003_exactly_once.sql"
            )),
            include_str!(concat!(
                "../../migrations/",
                $backend,
                "/0004_fair_queue.sql"
            )),
            include_str!(concat!("../../migrations/", $backend, "/0005_permits.sql")),
            include_str!(concat!("../../migrations/", $backend, "/0006_shared.sql")),
            include_str!(concat!("../../migrations/", $backend, "/0007_renewals.sql")),
        ]
    };
}

/// The migrations' names, in order (their files are `NNNN_<name>.sql`, numbered from 1).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) const NAMES: [&str; 7] = [
    "dblock_locks",
    "outcomes",
    "exactly_once",
    "fair_queue",
    "permits",
    "shared",
    "renewals",
];

#[cfg(feature = "postgres")]
pub(crate) const POSTGRES: [&str; 7] = files!("postgres");
#[cfg(feature = "mysql")]
pub(crate) const MYSQL: [&str; 7] = files!("mysql");
#[cfg(feature = "sqlite")]
pub(crate) const SQLITE: [&str; 7] = files!("sqlite");

/// The `SET` items of an extension that count it (migration 0007): the count of the tenure
/// `renewals_token` names, started again at 1 by a tenure's first extension. Every item of a
/// `SET` reads the row as it was before the statement (PostgreSQL, SQLite; MySQL assigns left
/// to right and writes its own, `mysql/sql.rs`).
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) const RENEWED: &str =
    "renewals = CASE WHEN renewals_token = fencing_token THEN renewals + 1 ELSE 1 END,
    renewals_token = fencing_token";

/// One backend's schema statements, from its migration files: what `migrate()` applies.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[derive(Debug)]
pub(crate) struct Schema {
    /// Migration 0001: the lock table, `IF NOT EXISTS`.
    pub(crate) create: SqlStr,
    /// Migrations 0002, 0003, 0006 and 0007: the columns each adds to the lock table (each one
    /// statement, all of its columns or none).
    pub(crate) columns: [SqlStr; 4],
    /// Migration 0004: the fair queue's table, `IF NOT EXISTS`.
    pub(crate) queue: SqlStr,
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
impl Schema {
    /// The schema of a backend's `files` (as [`POSTGRES`]), whose identifiers are quoted with
    /// `quote`, for lock table `table` and queue `queue` (both quoted), each statement built by
    /// the backend's `sql(template, table)`. Migration 0005 makes the semaphores' tables, which
    /// their own code creates.
    pub(crate) fn new(
        files: &[&str; 7],
        quote: char,
        sql: fn(&str, &str) -> SqlStr,
        table: &str,
        queue: &str,
    ) -> Self {
        let locks = format!("{quote}dblock_locks{quote}");
        let of = |i: usize| sql(&statements(files[i], &locks), table);
        let queue_file = statements(files[3], &format!("{quote}dblock_locks_queue{quote}"));
        Schema {
            create: of(0),
            columns: [of(1), of(2), of(5), of(6)],
            queue: sql(&queue_file, queue),
        }
    }

    /// Every statement, in the files' order.
    #[cfg(feature = "postgres")]
    pub(crate) fn in_order(&self) -> [&SqlStr; 6] {
        let [outcomes, exactly_once, shared, renewals] = &self.columns;
        [
            &self.create,
            outcomes,
            exactly_once,
            &self.queue,
            shared,
            renewals,
        ]
    }
}

/// The statements of `file` that change the table `quoted` (as the file writes its name, quotes
/// included), with `{table}` in its place: a template for the dialect's statement builder.
pub(crate) fn statements(file: &str, quoted: &str) -> String {
    let body: String = file
        .lines()
        .filter(|line| !line.starts_with("--"))
        .map(|line| format!("{line}\n"))
        .collect();
    body.split_inclusive(";\n")
        .filter(|statement| statement.contains(quoted))
        .map(|statement| statement.replace(quoted, "{table}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every file in `migrations/<backend>/` is one of the migrations above, in order: a new
    /// file that `migrate()` would not run fails here.
    #[test]
    fn every_shipped_file_is_a_migration() {
        for backend in ["postgres", "mysql", "sqlite"] {
            let dir = format!("{}/migrations/{backend}", env!("CARGO_MANIFEST_DIR"));
            let mut files: Vec<String> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            files.sort();
            let expected: Vec<String> = NAMES
                .iter()
                .enumerate()
                .map(|(i, name)| format!("{:04}_{name}.sql", i + 1))
                .collect();
            assert_eq!(files, expected, "{dir}");
        }
    }

    #[test]
    fn a_file_gives_the_statements_of_one_table() {
        let file =
            "-- a comment\nALTER TABLE \"t_permits\" ADD x;\nALTER TABLE \"t\"\n    ADD x;\n";
        assert_eq!(
            statements(file, "\"t\""),
            "ALTER TABLE {table}\n    ADD x;\n"
        );
        assert_eq!(
            statements(file, "\"t_permits\""),
            "ALTER TABLE {table} ADD x;\n"
        );
    }
}
