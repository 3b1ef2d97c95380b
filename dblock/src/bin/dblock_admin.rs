//! `dblock-admin`: the operator's view of a lock table, on any backend.
//!
//! ```text
//! dblock-admin <URL> [--table NAME] [--pooler] list
//! dblock-admin <URL> [--table NAME] [--pooler] show KEY
//! dblock-admin <URL> [--table NAME] [--pooler] release KEY
//! dblock-admin <URL> [--table NAME] [--pooler] reset KEY        (forget the last outcome, end a min_hold wait)
//! dblock-admin <URL> [--table NAME] [--pooler] purge [OLDER_THAN]     (default 1d; 0s = every row not held)
//! ```
//! `--pooler`: the PostgreSQL URL is PgBouncer (or another pooler) in transaction pooling mode.
//! Exit status 1, with the reason on stderr, when a command fails, when `show` finds no row for
//! the key, and when the lock table is not there (the message says how to create it).
//! Build: `cargo run -p dblock --features admin --bin dblock-admin -- sqlite://locks.db list`.

use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use dblock::{LockError, LockInfo, Locker};

const USAGE: &str =
    "usage: dblock-admin <URL> [--table NAME] [--pooler] list | show KEY | release KEY (a lock, and a semaphore's permits) | reset KEY | purge [OLDER_THAN]
  URL         postgres://…, mysql://…, sqlite://path?mode=rw
  --pooler    the PostgreSQL URL is a pooler in transaction mode (PgBouncer): no prepared statements
  OLDER_THAN  like 1d, 12h, 30m, 0s (default 1d)";

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("dblock-admin: {msg}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: &[String]) -> Result<(), String> {
    let mut rest: Vec<&str> = args.iter().map(String::as_str).collect();
    if rest.is_empty() || rest.iter().any(|a| *a == "-h" || *a == "--help") {
        println!("{USAGE}");
        return if rest.is_empty() {
            Err("missing URL".into())
        } else {
            Ok(())
        };
    }
    let url = rest.remove(0);
    let mut table = None;
    if let Some(at) = rest.iter().position(|a| *a == "--table") {
        rest.remove(at);
        if at >= rest.len() {
            return Err("--table needs a name".into());
        }
        table = Some(rest.remove(at));
    }
    let pooler = match rest.iter().position(|a| *a == "--pooler") {
        Some(at) => {
            rest.remove(at);
            true
        }
        None => false,
    };
    let options = dblock::ConnectOptions::new().pooler(pooler).listen(false);
    let mut locker = Locker::connect_with(url, options)
        .await
        .map_err(|e| e.to_string())?;
    // What a locker uses unless told otherwise: the table `migrate()` makes, the name in
    // migrations/*.sql.
    let default_table = locker.table_name().to_owned();
    if let Some(t) = table {
        locker = locker.table(t);
    }
    let failed = |e: LockError| explain(e, &locker, &default_table, url);
    match rest.as_slice() {
        ["list"] | [] => {
            let held = locker.held().await.map_err(failed)?;
            print_table(&held);
            println!("{} held", held.len());
            print_semaphores(&held);
        }
        ["show", key] => {
            let mut rows: Vec<LockInfo> = locker
                .inspect(key)
                .await
                .map_err(failed)?
                .into_iter()
                .collect();
            rows.extend(locker.permits(key).await.map_err(failed)?);
            if rows.is_empty() {
                // Nothing matched: a failure, so that scripts can tell.
                return Err(format!(
                    "no lock row for key {key:?} in table {:?}, and no live permit of a semaphore of that key",
                    locker.table_name()
                ));
            }
            print_table(&rows);
            print_semaphores(&rows);
        }
        ["release", key] => {
            let freed = locker.force_release(key).await.map_err(failed)?;
            println!(
                "{}",
                if freed {
                    format!("released {key:?}")
                } else {
                    format!("{key:?} was not held")
                }
            );
        }
        ["reset", key] => {
            let reset = locker.reset(key).await.map_err(failed)?;
            println!(
                "{}",
                if reset {
                    format!("reset {key:?}: its last outcome is forgotten, it is available")
                } else {
                    format!("{key:?} is held (or has no row): not reset")
                }
            );
        }
        ["purge"] => purge(&locker, Duration::from_secs(24 * 3600))
            .await
            .map_err(failed)?,
        ["purge", age] => purge(&locker, parse_age(age)?).await.map_err(failed)?,
        other => return Err(format!("unknown command {other:?}\n{USAGE}")),
    }
    Ok(())
}

/// One line per semaphore among `rows`: how many of its permits are in use.
fn print_semaphores(rows: &[LockInfo]) {
    let mut seen: Vec<(&str, u32, usize)> = Vec::new();
    for r in rows {
        if let dblock::LockKind::Permit { permits, .. } = r.kind {
            match seen
                .iter_mut()
                .find(|(k, n, _)| *k == r.key && *n == permits)
            {
                Some((_, _, used)) => *used += 1,
                None => seen.push((&r.key, permits, 1)),
            }
        }
    }
    for (key, permits, used) in seen {
        println!("semaphore {key:?}: {used} of {permits} permits in use");
    }
}

async fn purge(locker: &Locker, older_than: Duration) -> Result<(), LockError> {
    let n = locker.purge(older_than).await?;
    println!("purged {n} rows free for longer than {older_than:?}");
    Ok(())
}

/// The message for a failed command: for a lock table that is not there (never migrated, or a
/// wrong `--table`), which table, where, and how to create it, instead of the database's bare
/// "relation does not exist".
fn explain(e: LockError, locker: &Locker, default_table: &str, url: &str) -> String {
    if !e.is_not_migrated() {
        return e.to_string();
    }
    let table = locker.table_name();
    let backend = locker.backend_name();
    let (migrate, files) = if table == default_table {
        (
            "Locker::migrate()".to_owned(),
            format!("migrations/{backend}/*.sql"),
        )
    } else {
        (
            format!("locker.table({table:?}).migrate()"),
            format!("migrations/{backend}/*.sql with {default_table} replaced by {table}"),
        )
    };
    format!(
        "no lock table {table:?} in {} ({e})\n  \
         create it: run {migrate} once from the application (or apply {files})\n  \
         or, if the locks live in another table, pass --table NAME",
        without_password(url),
    )
}

/// `url` for a message: without the password of its user part, or of a `password=` parameter.
fn without_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    if scheme == "sqlite" {
        // A file path: no user, no password.
        return url.to_owned();
    }
    let (before_query, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let (authority, path) = match before_query.find('/') {
        Some(at) => before_query.split_at(at),
        None => (before_query, ""),
    };
    let authority = match authority.rsplit_once('@') {
        Some((user_info, host)) => {
            let user = user_info.split_once(':').map_or(user_info, |(u, _)| u);
            format!("{user}@{host}")
        }
        None => authority.to_owned(),
    };
    let mut out = format!("{scheme}://{authority}{path}");
    if let Some(query) = query {
        let kept: Vec<&str> = query
            .split('&')
            .filter(|p| {
                let name = p.split('=').next().unwrap_or_default();
                !name.eq_ignore_ascii_case("password")
            })
            .collect();
        if !kept.is_empty() {
            out.push('?');
            out.push_str(&kept.join("&"));
        }
    }
    out
}

fn parse_age(s: &str) -> Result<Duration, String> {
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let n: u64 = s[..split]
        .parse()
        .map_err(|_| format!("bad age {s:?}: expected like 1d, 12h, 30m, 0s"))?;
    let unit = match &s[split..] {
        "d" => 86_400,
        "h" => 3_600,
        "m" => 60,
        "s" | "" => 1,
        other => return Err(format!("bad unit {other:?} in {s:?}: use d, h, m or s")),
    };
    Ok(Duration::from_secs(n.saturating_mul(unit)))
}

/// The columns of `list` and `show`: name, and the width a value usually fits in. A column
/// whose values are wider (a long key, a long host name) grows to the widest, header and rows
/// alike, so every row lines up with the header.
const COLUMNS: [(&str, usize, Align); 10] = [
    ("KEY", 40, Align::Left),
    ("KIND", 4, Align::Left),
    ("HELD", 4, Align::Left),
    ("OWNER", 36, Align::Left),
    ("HOLDER", 30, Align::Left),
    ("COUNT", 5, Align::Right),
    ("FENCING TOKEN", 20, Align::Right),
    ("TIME LEFT", 9, Align::Right),
    ("LAST", 20, Align::Left),
    ("ACQUIRED", 8, Align::Left),
];

#[derive(Clone, Copy, PartialEq)]
enum Align {
    Left,
    Right,
}

fn print_table(rows: &[LockInfo]) {
    let now = SystemTime::now();
    let ago = |at: SystemTime| {
        let secs = now.duration_since(at).map(|d| d.as_secs()).unwrap_or(0);
        format!("{secs}s ago")
    };
    let cells: Vec<[String; COLUMNS.len()]> = rows
        .iter()
        .map(|r| {
            let left = if r.held {
                format!("{:.1}s", r.time_left.as_secs_f64())
            } else {
                "-".into()
            };
            let last = match (r.last_outcome, r.finished_at) {
                (Some(o), Some(at)) => format!(
                    "{} {}",
                    match o {
                        dblock::Outcome::Succeeded => "succeeded",
                        _ => "failed",
                    },
                    ago(at)
                ),
                _ => "-".into(),
            };
            let kind = match r.kind {
                dblock::LockKind::Permit { slot, permits } => format!("permit {slot}/{permits}"),
                dblock::LockKind::Read {
                    writer_waiting: true,
                } => "read, writer waiting".into(),
                dblock::LockKind::Read { .. } => "read".into(),
                _ => "lock".into(),
            };
            [
                r.key.clone(),
                kind,
                if r.held { "yes" } else { "no" }.into(),
                r.owner.as_deref().unwrap_or("-").into(),
                r.holder.as_deref().unwrap_or("-").into(),
                r.hold_count.to_string(),
                r.fencing_token.to_string(),
                left,
                last,
                ago(r.acquired_at),
            ]
        })
        .collect();
    let mut widths = COLUMNS.map(|(name, width, _)| width.max(name.chars().count()));
    for row in &cells {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    print_row(&COLUMNS.map(|(name, _, _)| name.to_owned()), &widths);
    for row in &cells {
        print_row(row, &widths);
    }
}

/// One line of the table: each cell padded to its column's width, one space between columns.
fn print_row(cells: &[String; COLUMNS.len()], widths: &[usize; COLUMNS.len()]) {
    let mut line = String::new();
    for ((cell, width), (_, _, align)) in cells.iter().zip(widths).zip(COLUMNS) {
        if !line.is_empty() {
            line.push(' ');
        }
        let pad = " ".repeat(width.saturating_sub(cell.chars().count()));
        if align == Align::Right {
            line.push_str(&pad);
            line.push_str(cell);
        } else {
            line.push_str(cell);
            line.push_str(&pad);
        }
    }
    println!("{}", line.trim_end());
}

#[cfg(test)]
mod tests {
    use super::without_password;

    #[test]
    fn urls_in_messages_have_no_password() {
        for (url, shown) in [
            (
                "postgres://app:s3cret@db.internal:5432/orders?sslmode=require",
                "postgres://app@db.internal:5432/orders?sslmode=require",
            ),
            (
                "mysql://root:p@ss@127.0.0.1:3306/test",
                "mysql://root@127.0.0.1:3306/test",
            ),
            (
                "postgres://postgres@127.0.0.1:5432/test",
                "postgres://postgres@127.0.0.1:5432/test",
            ),
            (
                "postgres://localhost/app?user=app&password=s3cret&sslmode=disable",
                "postgres://localhost/app?user=app&sslmode=disable",
            ),
            ("postgres://h/db?password=x", "postgres://h/db"),
            ("sqlite://locks.db?mode=rw", "sqlite://locks.db?mode=rw"),
            ("sqlite::memory:", "sqlite::memory:"),
        ] {
            assert_eq!(without_password(url), shown);
        }
    }
}
