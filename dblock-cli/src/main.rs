//! `dblock`: the operator's command-line tool for the lock tables of the `dblock` library, on
//! PostgreSQL (also behind PgBouncer), MySQL/MariaDB and SQLite. See `docs/cli.md`.

mod escape;
mod json;
mod table;
mod time;
mod watch;

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::{Parser, Subcommand};
use dblock::{ConnectOptions, LockError, Locker};

use crate::escape::{escape_message, quoted};

/// Inspect and repair dblock lock tables: list held locks, show a key, force-release or reset
/// it, purge old rows, run or check the migrations, and watch the table live.
///
/// The database comes from DATABASE_URL (or --database-url). Exit status: 0 success, 1 error
/// (database, configuration), 2 bad command line, 3 nothing to do or not found.
#[derive(Parser)]
#[command(
    name = "dblock",
    version,
    propagate_version = true,
    max_term_width = 100
)]
struct Cli {
    /// The database: postgres://…, mysql://…, sqlite://path?mode=rw. Read from DATABASE_URL if not
    /// given; prefer that: a password on the command line is visible to other users in `ps` and
    /// stays in the shell's history.
    #[arg(
        long,
        global = true,
        env = "DATABASE_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    database_url: Option<String>,

    /// The lock table [default: dblock_locks].
    #[arg(long, global = true, value_name = "NAME")]
    table: Option<String>,

    /// Treat a PostgreSQL URL as a transaction pooler (PgBouncer in transaction mode). Only to
    /// force it: a pooler is detected without it.
    #[arg(long, global = true)]
    pooler: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the locks, read locks and semaphore permits held now.
    List {
        /// Only keys that start with this.
        #[arg(long, value_name = "PREFIX")]
        prefix: Option<String>,
        /// Only holds whose holder (host/pid, then the function or label) contains this: the
        /// holds of one machine (`web-3/`), one process (`web-3/4711/`) or one job.
        #[arg(long, value_name = "TEXT")]
        holder: Option<String>,
        /// Print JSON (the schema is in docs/cli.md).
        #[arg(long)]
        json: bool,
    },
    /// Show a key's lock row (held or not) and the live permits of the semaphore of that key.
    ///
    /// Exits 3 if the key has neither.
    Show {
        /// The key.
        #[arg(value_parser = parse_key)]
        key: String,
        /// Print JSON (the schema is in docs/cli.md).
        #[arg(long)]
        json: bool,
    },
    /// Free a key whoever holds it: its lock and every permit of its semaphore. With --owner,
    /// only what that owner holds of it; with --holder instead of a key, the locks and permits
    /// of every holder that contains TEXT.
    ///
    /// The old holder's release and renewal then fail (it has lost the lock); the hold is
    /// recorded as failed. --holder frees each hold it listed only if its owner still holds
    /// it (a key taken over meanwhile is left alone), and never read locks. Exits 3 if
    /// nothing was released.
    Release {
        /// The key.
        #[arg(value_parser = parse_key, required_unless_present = "holder")]
        key: Option<String>,
        /// Only the holds of this owner (the OWNER column of `list`).
        #[arg(long, value_name = "UUID", requires = "key")]
        owner: Option<String>,
        /// Every lock and permit whose holder (host/pid[/label]) contains this: a dead machine's
        /// (`web-3/`), a process's (`web-3/4711/`). Not empty, not only slashes (that would be
        /// every holder).
        #[arg(long, value_name = "TEXT", conflicts_with_all = ["key", "owner"], value_parser = parse_holder)]
        holder: Option<String>,
    },
    /// Take a key from whoever holds it, with a new fencing token, and keep it for --ttl.
    ///
    /// The old holder's renewal, extend and fenced writes fail from then on (Locker::steal);
    /// its hold is recorded as failed. The key stays taken after this command exits, until
    /// --ttl runs out or `dblock release KEY` frees it: a runaway job is stopped and nobody
    /// else starts it meanwhile.
    Steal {
        /// The key.
        #[arg(value_parser = parse_key)]
        key: String,
        /// How long the stolen lease lasts: like 30s, 5m, 1h.
        #[arg(long, value_name = "TTL", default_value = "5m", value_parser = time::parse_ttl)]
        ttl: Duration,
    },
    /// Forget how a key's last hold ended, so that a `once` key runs again, and end a min_hold
    /// wait.
    ///
    /// Exits 3 if the key is held (release it first) or has no row.
    Reset {
        /// The key.
        #[arg(value_parser = parse_key)]
        key: String,
    },
    /// Delete rows that have been free (or expired) for longer than --older-than.
    ///
    /// Never deletes a held row, nor the record of a `once` key whose work succeeded (reset it
    /// first). Fencing tokens still never go backwards.
    Purge {
        /// Like 1d, 12h, 30m, 1m30s; 0s deletes every row that is not held.
        #[arg(long, value_name = "AGE", default_value = "1d", value_parser = time::parse_duration)]
        older_than: Duration,
    },
    /// Create or update the lock table (`migrate`, `migrate run`), or list which migrations
    /// are applied (`migrate status`).
    Migrate {
        #[command(subcommand)]
        action: Option<Migrate>,
    },
    /// A live view of the held keys, their fair waiters and writers waiting, refreshed in place.
    ///
    /// Needs a terminal; quit with q or Ctrl-C. With --json it prints one JSON snapshot per
    /// line instead, until interrupted.
    Watch {
        /// Only keys that start with this.
        #[arg(long, value_name = "PREFIX")]
        prefix: Option<String>,
        /// Only holds whose holder (host/pid, then the function or label) contains this, and
        /// the fair waiters of the keys they hold: one machine's (web-3/), one process's.
        #[arg(long, value_name = "TEXT")]
        holder: Option<String>,
        /// Time between refreshes, like 1s, 500ms, 5s (at least 100ms).
        #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = time::parse_interval)]
        interval: Duration,
        /// Print one JSON snapshot per refresh, one per line (no terminal needed).
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum Migrate {
    /// Apply the pending migrations (the same as `migrate` alone). Idempotent, safe from many
    /// processes at once.
    Run,
    /// List the migrations with applied or pending.
    Status {
        /// Print JSON (the schema is in docs/cli.md).
        #[arg(long)]
        json: bool,
    },
}

/// `release --holder`: a text that picks some holders, not all of them (an unset shell variable
/// in `--holder "$HOST/"` leaves `/`, which every `host/pid` contains).
pub fn parse_holder(s: &str) -> Result<String, String> {
    if s.chars().all(|c| c == '/') {
        return Err("the holder text is empty or only slashes: it would match every holder".into());
    }
    Ok(s.to_owned())
}

/// A key as the library takes it: not empty, at most 255 bytes, no NUL.
pub fn parse_key(s: &str) -> Result<String, String> {
    if s.is_empty() {
        return Err("the key is empty".into());
    }
    if s.len() > dblock::MAX_KEY_LEN {
        return Err(format!(
            "the key is {} bytes long; at most {} are allowed",
            s.len(),
            dblock::MAX_KEY_LEN
        ));
    }
    if s.contains('\0') {
        return Err("the key contains a NUL byte".into());
    }
    Ok(s.to_owned())
}

/// How a command failed, and so the exit status.
pub enum Failure {
    /// 1: the configuration failed (the message is ready to print).
    Error(String),
    /// 1: the library failed (the database, or its configuration).
    Lock(LockError),
    /// 3: nothing to do, or nothing found.
    Nothing(String),
}

impl From<LockError> for Failure {
    fn from(e: LockError) -> Self {
        Failure::Lock(e)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse(); // a bad command line exits 2 here (help and version: 0)
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            say(&format!("dblock: error: cannot start: {e}"));
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Error(msg)) => {
            say(&format!("dblock: error: {msg}"));
            ExitCode::from(1)
        }
        Err(Failure::Lock(e)) => {
            say(&format!(
                "dblock: error: {}",
                escape_message(&e.to_string())
            ));
            ExitCode::from(1)
        }
        Err(Failure::Nothing(msg)) => {
            say(&format!("dblock: {msg}"));
            ExitCode::from(3)
        }
    }
}

/// Whether the row's holder (host/pid[/label]) contains `text`: the `--holder TEXT` filter of
/// `list`, `release` and `watch`. A row with no holder (a free key) matches no text.
pub fn held_by(row: &dblock::LockInfo, text: &str) -> bool {
    row.holder.as_deref().is_some_and(|h| h.contains(text))
}

/// `release --holder TEXT`: each lock and permit whose holder contains `holder`, freed only if
/// the owner listed still holds it; read locks are left (their row is every reader's).
async fn release_holder(locker: &Locker, holder: &str) -> Result<(), Failure> {
    let rows = locker.held().await?;
    let mut done: Vec<(String, String)> = Vec::new();
    for row in &rows {
        let (Some(owner), Some(label)) = (&row.owner, &row.holder) else {
            continue;
        };
        if !held_by(row, holder) {
            continue;
        }
        if matches!(row.kind, dblock::LockKind::Read { .. }) {
            say(&format!(
                "dblock: left {}: a read lock (free it with `dblock release KEY`)",
                quoted(&row.key)
            ));
            continue;
        }
        let pair = (row.key.clone(), owner.clone());
        if done.contains(&pair) {
            continue; // two permits of one owner: freed together
        }
        if locker.force_release_if_owner(&row.key, owner).await? {
            emit(&format!(
                "released {} (owner {}, holder {})\n",
                quoted(&row.key),
                quoted(owner),
                quoted(label)
            ));
            done.push(pair);
        }
    }
    if done.is_empty() {
        return Err(Failure::Nothing(format!(
            "no lock or permit held by a holder containing {}: nothing released",
            quoted(holder)
        )));
    }
    emit(&format!("{} released\n", done.len()));
    Ok(())
}

/// Writes `text` to stdout. A reader that went away (`dblock list | head -1`) is not an error.
pub fn emit(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
}

/// Writes `line` to stderr. A closed stderr is not a reason to panic (`eprintln!` would).
pub fn say(line: &str) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{line}").and_then(|()| err.flush());
}

/// `lines`, one per line.
fn emit_lines(lines: &[String]) {
    let mut text = lines.join("\n");
    text.push('\n');
    emit(&text);
}

async fn connect(cli: &Cli) -> Result<Locker, Failure> {
    let Some(url) = cli.database_url.as_deref().filter(|u| !u.is_empty()) else {
        return Err(Failure::Error(
            "no database: set DATABASE_URL (or pass --database-url URL)".into(),
        ));
    };
    // No LISTEN connection: the tool never waits for a lock. A pooler is detected by the
    // library unless --pooler forces it.
    let mut options = ConnectOptions::new().listen(false);
    if cli.pooler {
        options = options.pooler(true);
    }
    // The library's errors never show the URL's password; this tool never prints the URL.
    let locker = Locker::connect_with(url, options).await?;
    Ok(match &cli.table {
        Some(t) => locker.table(t),
        None => locker,
    })
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let locker = connect(&cli).await?;
    let result = command(&cli.command, &locker).await;
    match result {
        // The table (or a column of a later migration) is not there: say which and how.
        Err(Failure::Lock(e)) if e.is_not_migrated() => {
            let msg = escape_message(&e.to_string());
            Err(Failure::Error(
                explain(msg, &locker, cli.table.is_some()).await,
            ))
        }
        other => other,
    }
}

async fn command(command: &Command, locker: &Locker) -> Result<(), Failure> {
    let now = SystemTime::now();
    let table = locker.table_name().to_owned();
    match command {
        Command::List {
            prefix,
            holder,
            json,
        } => {
            let mut rows = locker.held().await?;
            if let Some(p) = prefix {
                rows.retain(|r| r.key.starts_with(p.as_str()));
            }
            if let Some(h) = holder {
                rows.retain(|r| held_by(r, h));
            }
            if *json {
                json::print(&json::List {
                    table,
                    locks: rows.iter().map(json::Lock::from).collect(),
                });
            } else {
                let mut lines = if rows.is_empty() {
                    Vec::new()
                } else {
                    table::locks(&rows, now)
                };
                lines.push(format!("{} held", rows.len()));
                lines.extend(table::semaphores(&rows));
                emit_lines(&lines);
            }
        }
        Command::Show { key, json } => {
            let lock = locker.inspect(key).await?;
            let permits = locker.permits(key).await?;
            let found = lock.is_some() || !permits.is_empty();
            if *json {
                json::print(&json::Show {
                    table: table.clone(),
                    key: key.clone(),
                    lock: lock.as_ref().map(json::Lock::from),
                    permits: permits.iter().map(json::Lock::from).collect(),
                });
            } else if found {
                let rows: Vec<_> = lock.into_iter().chain(permits).collect();
                let mut lines = table::locks(&rows, now);
                lines.extend(table::semaphores(&rows));
                emit_lines(&lines);
            }
            if !found {
                return Err(Failure::Nothing(format!(
                    "no lock row for key {} in table {}, and no live permit of a semaphore of that key",
                    quoted(key),
                    quoted(&table)
                )));
            }
        }
        Command::Release {
            key: Some(key),
            owner,
            ..
        } => {
            let released = match owner {
                Some(owner) => locker.force_release_if_owner(key, owner).await?,
                None => locker.force_release(key).await?,
            };
            if released {
                emit(&format!("released {}\n", quoted(key)));
            } else {
                return Err(Failure::Nothing(match owner {
                    Some(owner) => format!(
                        "{} was not held by {}: nothing released",
                        quoted(key),
                        quoted(owner)
                    ),
                    None => format!("{} was not held: nothing released", quoted(key)),
                }));
            }
        }
        Command::Release {
            key: None,
            holder: Some(holder),
            ..
        } => release_holder(locker, holder).await?,
        Command::Release { .. } => {
            return Err(Failure::Error("release needs a KEY or --holder".into()));
        }
        Command::Steal { key, ttl } => {
            let guard = locker
                .steal(key.as_str())
                .ttl(*ttl)
                .holder("dblock steal")
                .await?;
            emit(&format!(
                "stole {}: fencing token {}, held for {}\n",
                quoted(key),
                guard.fencing_token(),
                time::given(*ttl),
            ));
            // The lease outlives this process: no release on the way out.
            std::mem::forget(guard);
        }
        Command::Reset { key } => {
            if locker.reset(key).await? {
                emit(&format!(
                    "reset {}: its last outcome is forgotten, it is available\n",
                    quoted(key)
                ));
            } else {
                let why = match locker.inspect(key).await? {
                    Some(info) if info.held => format!(
                        "{} is held: not reset (free it first with `dblock release`)",
                        quoted(key)
                    ),
                    Some(_) => format!("{} was not reset", quoted(key)),
                    None => format!(
                        "no lock row for key {} in table {}: nothing to reset",
                        quoted(key),
                        quoted(&table)
                    ),
                };
                return Err(Failure::Nothing(why));
            }
        }
        Command::Purge { older_than } => {
            let n = locker.purge(*older_than).await?;
            emit(&format!(
                "purged {n} {} free for longer than {}\n",
                if n == 1 { "row" } else { "rows" },
                time::given(*older_than)
            ));
        }
        Command::Migrate {
            action: None | Some(Migrate::Run),
        } => {
            let before = locker.migration_status().await?;
            locker.migrate().await?;
            let after = locker.migration_status().await?;
            let done: Vec<String> = after
                .iter()
                .zip(&before)
                .filter(|(a, b)| a.applied && !b.applied)
                .map(|(a, _)| format!("{:04}_{}", a.version, a.name))
                .collect();
            let pending = after.iter().filter(|m| !m.applied).count();
            let mut text = if done.is_empty() {
                format!("table {} is up to date", quoted(&table))
            } else {
                format!("table {}: applied {}", quoted(&table), done.join(", "))
            };
            if pending > 0 {
                // Never after a migrate that succeeded; said rather than hidden if it happens.
                text.push_str(&format!(
                    " ({pending} still pending: see `dblock migrate status`)"
                ));
            }
            emit(&(text + "\n"));
        }
        Command::Migrate {
            action: Some(Migrate::Status { json }),
        } => {
            let status = locker.migration_status().await?;
            if *json {
                json::print(&json::Status {
                    table,
                    backend: locker.backend_name(),
                    migrations: status.iter().map(json::Migration::from).collect(),
                });
            } else {
                let rows: Vec<Vec<String>> = status
                    .iter()
                    .map(|m| {
                        vec![
                            format!("{:04}", m.version),
                            m.name.to_owned(),
                            if m.applied { "applied" } else { "pending" }.to_owned(),
                        ]
                    })
                    .collect();
                use table::Align::Left;
                let mut lines = vec![format!(
                    "table {} ({})",
                    quoted(&table),
                    locker.backend_name()
                )];
                lines.extend(table::render(
                    &[("VERSION", Left), ("NAME", Left), ("STATUS", Left)],
                    &rows,
                ));
                let pending = status.iter().filter(|m| !m.applied).count();
                lines.push(match pending {
                    0 => "all applied".to_owned(),
                    n => format!("{n} pending: run `dblock migrate` (or Locker::migrate())"),
                });
                emit_lines(&lines);
            }
        }
        Command::Watch {
            prefix,
            holder,
            interval,
            json,
        } => {
            let filter = watch::Filter {
                prefix: prefix.clone().unwrap_or_default(),
                holder: holder.clone(),
            };
            watch::run(locker, &filter, *interval, *json).await?;
        }
    }
    Ok(())
}

/// The message of a command that failed because the lock table is not there (never migrated,
/// or a wrong --table) or is behind the library (migrations pending): which table, which
/// migrations, and the commands that fix it; the library's own message last.
async fn explain(msg: String, locker: &Locker, table_given: bool) -> String {
    let Ok(status) = locker.migration_status().await else {
        return msg;
    };
    let table = locker.table_name();
    let backend = locker.backend_name();
    let flag = if table_given {
        format!("--table {table} ")
    } else {
        String::new()
    };
    let pending: Vec<String> = status
        .iter()
        .filter(|m| !m.applied)
        .map(|m| format!("{:04}_{}", m.version, m.name))
        .collect();
    match status.first() {
        Some(first) if !first.applied => format!(
            "no lock table {} in this database\n  \
             create it: `dblock {flag}migrate`, or Locker::migrate() from the application \
             (or apply the dblock package's migrations/{backend}/*.sql)\n  \
             or, if the locks live in another table, pass --table NAME\n  \
             ({msg})",
            quoted(table)
        ),
        _ if !pending.is_empty() => format!(
            "the lock table {} is missing migrations {}\n  \
             update it: `dblock {flag}migrate`, or Locker::migrate() from the application \
             (or apply those of the dblock package's migrations/{backend}/*.sql)\n  \
             ({msg})",
            quoted(table),
            pending.join(", ")
        ),
        _ => msg,
    }
}
