//! A property test over the public inputs, on a SQLite file and on PostgreSQL: keys and labels
//! of arbitrary text and length, every `Duration` from zero to `MAX`, any `u32` of permits, key
//! lists, table names, URLs and options. Whatever the input: never a panic or an abort, always
//! `Ok` or a typed `LockError`, nothing left held, no secret in any message.
//!
//! Cases per property: `PROPTEST_CASES` (default 48 here, so that CI stays quick).

mod common;

use std::sync::OnceLock;
use std::time::Duration;

use dblock::{ConnectOptions, LockError, Locker};
use proptest::prelude::*;

const SECRET: &str = "hunter2";

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(48)
}

/// One runtime for every case (a locker lives on the runtime that made it).
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    })
}

/// The lockers under test: a SQLite file, and PostgreSQL where it can be reached.
fn lockers() -> &'static Vec<(&'static str, Locker)> {
    static LOCKERS: OnceLock<(Vec<(&'static str, Locker)>, tempfile::TempDir)> = OnceLock::new();
    &LOCKERS
        .get_or_init(|| {
            runtime().block_on(async {
                #[allow(unused_mut)]
                let mut out = Vec::new();
                #[cfg(feature = "sqlite")]
                let dir = {
                    let (lite, dir) = common::sqlite("props").await;
                    out.push((lite.name, lite.locker));
                    dir
                };
                #[cfg(not(feature = "sqlite"))]
                let dir = tempfile::tempdir().expect("tempdir");
                if let Some(pg) = common::postgres("props").await {
                    out.push((pg.name, pg.locker));
                }
                (out, dir)
            })
        })
        .0
}

/// Any duration, weighted towards the edges: zero, sub-millisecond, seconds, centuries, MAX.
fn duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        Just(Duration::ZERO),
        Just(Duration::MAX),
        (0u64..2_000_000).prop_map(Duration::from_nanos),
        (0u64..3_000).prop_map(Duration::from_millis),
        any::<u64>().prop_map(Duration::from_secs),
        (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
    ]
}

/// Any text: printable or not, NUL and controls, one to 400 characters (keys over 255 bytes
/// and labels over 255 characters included), or empty.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        "[a-z:/0-9]{1,40}",
        ".{1,40}",
        "[\\x00-\\x1f\\x7f\\u{80}-\\u{9f}\\u{202e}a]{1,20}",
        ".{200,400}",
    ]
}

#[derive(Debug, Clone)]
enum Call {
    Lock {
        key: String,
        label: String,
        ttl: Duration,
        wait: Duration,
    },
    Read {
        key: String,
        ttl: Duration,
        wait: Duration,
    },
    Semaphore {
        key: String,
        permits: u32,
        wait: Duration,
    },
    LockAll {
        keys: Vec<String>,
        wait: Duration,
    },
    Extend {
        key: String,
        by: Duration,
    },
    Table {
        name: String,
    },
}

fn call() -> impl Strategy<Value = Call> {
    prop_oneof![
        (text(), text(), duration(), duration()).prop_map(|(key, label, ttl, wait)| Call::Lock {
            key,
            label,
            ttl,
            wait
        }),
        (text(), duration(), duration()).prop_map(|(key, ttl, wait)| Call::Read { key, ttl, wait }),
        (text(), any::<u32>(), duration()).prop_map(|(key, permits, wait)| Call::Semaphore {
            key,
            permits,
            wait
        }),
        (proptest::collection::vec(text(), 0..8), duration())
            .prop_map(|(keys, wait)| Call::LockAll { keys, wait }),
        (text(), duration()).prop_map(|(key, by)| Call::Extend { key, by }),
        text().prop_map(|name| Call::Table { name }),
    ]
}

/// Runs `call` on `l` with keys under `prefix` (each case its own keys, so no call waits for
/// another's hold): whatever it answers must be `Ok` or a typed error, and what it took is
/// released. A call still waiting after 3 s (a lease too short to be granted live, with a long
/// wait) is dropped: that too must leave nothing held.
async fn run(l: &Locker, prefix: &str, call: Call) -> Result<(), String> {
    let check = |e: LockError| -> Result<(), String> {
        let text = format!("{e} {e:?}");
        if text.contains(SECRET) {
            return Err(format!("a secret in {text}"));
        }
        Ok(())
    };
    let key = |k: &str| format!("{prefix}{k}");
    let bounded = Duration::from_secs(3);
    let out = match call {
        Call::Lock {
            key: k,
            label,
            ttl,
            wait,
        } => {
            let f = l.lock(key(&k)).holder(label).ttl(ttl).wait(wait);
            match tokio::time::timeout(bounded, f).await {
                Ok(Ok(g)) => g.release().await.or_else(|e| match e {
                    // A lease of a microsecond may end before its release.
                    LockError::NotHeld { .. } => Ok(()),
                    e => Err(e),
                }),
                Ok(Err(e)) => Err(e),
                Err(_) => Ok(()),
            }
        }
        Call::Read { key: k, ttl, wait } => {
            match tokio::time::timeout(bounded, l.read(key(&k)).ttl(ttl).wait(wait)).await {
                Ok(Ok(g)) => g.release().await.or_else(|e| match e {
                    LockError::NotHeld { .. } => Ok(()),
                    e => Err(e),
                }),
                Ok(Err(e)) => Err(e),
                Err(_) => Ok(()),
            }
        }
        Call::Semaphore {
            key: k,
            permits,
            wait,
        } => match tokio::time::timeout(bounded, l.semaphore(key(&k), permits).wait(wait)).await {
            Ok(Ok(g)) => g.release().await,
            Ok(Err(e)) => Err(e),
            Err(_) => Ok(()),
        },
        Call::LockAll { keys, wait } => {
            let keys: Vec<String> = keys.iter().map(|k| key(k)).collect();
            match tokio::time::timeout(bounded, l.lock_all(keys).wait(wait)).await {
                Ok(Ok(guards)) => {
                    for g in guards {
                        g.release().await.map_err(|e| e.to_string())?;
                    }
                    Ok(())
                }
                Ok(Err(e)) => Err(e),
                Err(_) => Ok(()),
            }
        }
        Call::Extend { key: k, by } => match l.lock(key(&k)).await {
            Ok(g) => {
                let extended = g.extend(by).await;
                g.release().await.map_err(|e| e.to_string())?;
                extended
            }
            Err(e) => Err(e),
        },
        Call::Table { name } => match l.table(&name).lock(key("t")).await {
            Ok(g) => g.release().await,
            Err(e) => Err(e),
        },
    };
    match out {
        Ok(()) => Ok(()),
        Err(e) => check(e),
    }
}

/// Nothing under `prefix` is held once the background releases of dropped calls are done.
async fn nothing_held(l: &Locker, prefix: &str) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let held: Vec<String> = l
            .held()
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .filter(|i| i.key.starts_with(prefix))
            .map(|i| i.key)
            .collect();
        if held.is_empty() {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("left held: {held:?}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_call_answers_ok_or_a_typed_error_and_leaves_nothing_held(
        calls in proptest::collection::vec(call(), 1..6),
    ) {
        for (name, l) in lockers() {
            let prefix = format!("p{:08x}/", fastrand::u32(..));
            let verdict: Result<(), String> = runtime().block_on(async {
                for c in calls.clone() {
                    run(l, &prefix, c).await?;
                }
                nothing_held(l, &prefix).await
            });
            prop_assert!(verdict.is_ok(), "{}: {:?}", name, verdict);
        }
    }

    #[test]
    fn any_url_and_options_connect_or_fail_without_a_secret(
        scheme in prop_oneof![Just("postgres".to_owned()), Just("mysql".to_owned()), Just("sqlite".to_owned()), Just("host".to_owned()), "[a-z+.-]{0,8}"],
        at in 0usize..4,
        junk in "[a-zA-Z0-9:@?&=%.\\[\\] ]{0,30}",
        statement_timeout in duration(),
        acquire_timeout in duration(),
        pooler in any::<Option<bool>>(),
    ) {
        // The secret where a password goes: the user part, the query, a libpq string, or the
        // query of a URL without a host (never a host to look up: no lookup leaves this machine).
        let url = match at {
            0 => format!("{scheme}://app:{SECRET}@127.0.0.1:1/{junk}"),
            1 => format!("{scheme}://127.0.0.1:1/db?{junk}&password={SECRET}"),
            2 => format!("{scheme}=127.0.0.1 password={SECRET} {junk}"),
            _ => format!("{scheme}:{junk}?password={SECRET}"),
        };
        let url = url.replace("mode=rwc", "");
        let mut options = ConnectOptions::new()
            .statement_timeout(statement_timeout)
            .acquire_timeout(acquire_timeout.min(Duration::from_millis(300)))
            .listen_url(format!("postgres://u:{SECRET}@[{junk}"));
        if acquire_timeout == Duration::MAX {
            options = options.acquire_timeout(acquire_timeout);
        }
        if let Some(p) = pooler {
            options = options.pooler(p);
        }
        let shown = format!("{options:?}");
        prop_assert!(!shown.contains(SECRET), "{}", shown);
        let result = runtime().block_on(async {
            tokio::time::timeout(Duration::from_secs(10), Locker::connect_with(&url, options)).await
        });
        if let Ok(Err(e)) = result {
            let text = format!("{e} {e:?}");
            prop_assert!(!text.contains(SECRET), "{}: {}", url, text);
        }
    }
}
