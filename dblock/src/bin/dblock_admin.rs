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
//! Build: `cargo run -p dblock --features admin --bin dblock-admin -- sqlite://locks.db list`.

use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use dblock::{LockInfo, Locker};

const USAGE: &str =
    "usage: dblock-admin <URL> [--table NAME] [--pooler] list | show KEY | release KEY | reset KEY | purge [OLDER_THAN]
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
    if let Some(t) = table {
        locker = locker.table(t);
    }
    match rest.as_slice() {
        ["list"] | [] => {
            let held = locker.held().await.map_err(|e| e.to_string())?;
            print_table(&held);
            println!("{} held", held.len());
        }
        ["show", key] => match locker.inspect(key).await.map_err(|e| e.to_string())? {
            Some(info) => print_table(&[info]),
            None => println!("no row for {key:?}"),
        },
        ["release", key] => {
            let freed = locker.force_release(key).await.map_err(|e| e.to_string())?;
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
            let reset = locker.reset(key).await.map_err(|e| e.to_string())?;
            println!(
                "{}",
                if reset {
                    format!("reset {key:?}: its last outcome is forgotten, it is available")
                } else {
                    format!("{key:?} is held (or has no row): not reset")
                }
            );
        }
        ["purge"] => purge(&locker, Duration::from_secs(24 * 3600)).await?,
        ["purge", age] => purge(&locker, parse_age(age)?).await?,
        other => return Err(format!("unknown command {other:?}\n{USAGE}")),
    }
    Ok(())
}

async fn purge(locker: &Locker, older_than: Duration) -> Result<(), String> {
    let n = locker.purge(older_than).await.map_err(|e| e.to_string())?;
    println!("purged {n} rows free for longer than {older_than:?}");
    Ok(())
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

fn print_table(rows: &[LockInfo]) {
    println!(
        "{:<40} {:<5} {:<36} {:<30} {:>5} {:>20} {:>10} {:<10}",
        "KEY", "HELD", "OWNER", "HOLDER", "COUNT", "FENCING TOKEN", "TIME LEFT", "LAST"
    );
    for r in rows {
        let left = if r.held {
            format!("{:.1}s", r.time_left.as_secs_f64())
        } else {
            "-".into()
        };
        let age = SystemTime::now()
            .duration_since(r.acquired_at)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let last = match (r.last_outcome, r.finished_at) {
            (Some(o), Some(at)) => format!(
                "{} {}s ago",
                match o {
                    dblock::Outcome::Succeeded => "succeeded",
                    _ => "failed",
                },
                SystemTime::now()
                    .duration_since(at)
                    .map(|d| d.as_secs())
                    .unwrap_or(0)
            ),
            _ => "-".into(),
        };
        println!(
            "{:<40} {:<5} {:<36} {:<30} {:>5} {:>20} {:>10} {last:<10}   (acquired {age}s ago)",
            r.key,
            if r.held { "yes" } else { "no" },
            r.owner.as_deref().unwrap_or("-"),
            r.holder.as_deref().unwrap_or("-"),
            r.hold_count,
            r.fencing_token,
            left
        );
    }
}
