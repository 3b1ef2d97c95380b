//! The statements themselves, below the public API: what only they can show. Against SQLite in
//! memory and the servers of the integration tests (those this build has a feature for).

use super::*;

/// SQLite in memory, and the servers of the integration tests when they are reachable.
async fn backends() -> Vec<(String, Backend)> {
    let table = format!("t_stmt_{}_{}", std::process::id(), fastrand::u32(..));
    #[allow(unused_mut)]
    let mut out: Vec<(String, Backend)> = Vec::new();
    #[cfg(feature = "sqlite")]
    out.push((
        "sqlite".into(),
        Backend::connect("sqlite::memory:", &table).await.unwrap(),
    ));
    let require = std::env::var("DBLOCK_REQUIRE_SERVERS").is_ok_and(|v| v == "1");
    #[allow(unused_variables)]
    for (name, var, default, built) in [
        (
            "postgres",
            "DBLOCK_POSTGRES_URL",
            "postgres://postgres@127.0.0.1:5432/test",
            cfg!(feature = "postgres"),
        ),
        (
            "mariadb",
            "DBLOCK_MYSQL_URL",
            "mysql://root@127.0.0.1:3306/test",
            cfg!(feature = "mysql"),
        ),
    ] {
        if !built {
            continue;
        }
        let url = std::env::var(var).unwrap_or_else(|_| default.into());
        match Backend::connect(&url, &table).await {
            Ok(b) => {
                if name == "mariadb" {
                    out.push(("mysql8-path".into(), b.without_returning()));
                }
                out.push((name.into(), b));
            }
            Err(e) if !require => eprintln!("!!!!! SKIPPING {name}: {e}"),
            Err(e) => panic!("{name} unreachable and DBLOCK_REQUIRE_SERVERS=1: {e}"),
        }
    }
    for (_, b) in &out {
        b.migrate().await.unwrap();
    }
    out
}

fn grant(a: Attempt) -> Grant {
    match a {
        Attempt::Acquired(g) => g,
        Attempt::Busy { .. } => panic!("expected a grant"),
    }
}

#[tokio::test]
async fn a_repeated_attempt_is_recognised_not_counted_twice() {
    for (name, b) in backends().await {
        let mut p = Acquire {
            key: "idem",
            owner: "owner-1",
            ttl_us: 30_000_000,
            holder: "h",
            attempt: 7,
            waiting: false,
        };
        let first = grant(b.acquire(&p).await.unwrap());
        let repeat = grant(b.acquire(&p).await.unwrap());
        assert_eq!(
            (first.hold_count, repeat.hold_count),
            (1, 1),
            "{name}: repeat counted twice"
        );
        assert_eq!(first.fencing_token, repeat.fencing_token, "{name}");
        p.attempt = 8;
        assert_eq!(
            grant(b.acquire(&p).await.unwrap()).hold_count,
            2,
            "{name}: new attempt is re-entry"
        );
        assert_eq!(
            grant(b.acquire(&p).await.unwrap()).hold_count,
            2,
            "{name}: repeat of re-entry"
        );
        assert_eq!(
            b.inspect("idem").await.unwrap().unwrap().hold_count,
            2,
            "{name}"
        );

        // Another owner's attempt with the same id is still busy.
        let other = Acquire {
            owner: "owner-2",
            ..p
        };
        assert!(
            matches!(b.acquire(&other).await.unwrap(), Attempt::Busy { .. }),
            "{name}"
        );

        // Release: a repeat of the same release (same id, after a lost reply) matches
        // nothing instead of decrementing twice; a new release decrements again.
        let h = HoldRef {
            key: "idem",
            owner: "owner-1",
            fencing_token: first.fencing_token,
        };
        assert_eq!(
            b.release(&h, 100).await.unwrap(),
            Released::StillHeld(1),
            "{name}"
        );
        assert_eq!(
            b.release(&h, 100).await.unwrap(),
            Released::NotHeld,
            "{name}: applied twice"
        );
        assert_eq!(
            b.inspect("idem").await.unwrap().unwrap().hold_count,
            1,
            "{name}"
        );
        let stale = HoldRef {
            fencing_token: first.fencing_token - 1,
            ..h
        };
        assert_eq!(
            b.release(&stale, 101).await.unwrap(),
            Released::NotHeld,
            "{name}: other tenure"
        );
        assert_eq!(b.release(&h, 102).await.unwrap(), Released::Free, "{name}");
        assert_eq!(
            b.release(&h, 103).await.unwrap(),
            Released::NotHeld,
            "{name}"
        );
    }
}

#[tokio::test]
async fn busy_attempts_report_the_holders_time_left_where_the_dialect_can() {
    for (name, b) in backends().await {
        let p = Acquire {
            key: "left",
            owner: "a",
            ttl_us: 10_000_000,
            holder: "h",
            attempt: 1,
            waiting: false,
        };
        grant(b.acquire(&p).await.unwrap());
        let q = Acquire {
            owner: "b",
            attempt: 2,
            ..p
        };
        match b.acquire(&q).await.unwrap() {
            Attempt::Busy {
                retry_after: Some(left),
            } => {
                assert!(
                    left > std::time::Duration::from_secs(8)
                        && left <= std::time::Duration::from_secs(10),
                    "{name}: {left:?}"
                );
            }
            Attempt::Busy { retry_after: None } => {
                assert!(
                    name == "sqlite" || name == "mysql8-path",
                    "{name}: no time left reported"
                )
            }
            Attempt::Acquired(_) => panic!("{name}: double grant"),
        }
    }
}
