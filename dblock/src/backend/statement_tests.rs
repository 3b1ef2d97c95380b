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
        Backend::connect("sqlite::memory:", &table, &ConnectOptions::default())
            .await
            .unwrap(),
    ));
    let require = crate::backend::servers_required();
    #[allow(unused_variables)]
    for (name, var, default, built) in [
        (
            "postgres",
            "DBLOCK_POSTGRES_URL",
            "postgres://postgres@127.0.0.1:5432/test",
            cfg!(feature = "postgres"),
        ),
        // PgBouncer in transaction pooling mode (`.ci/pgbouncer`), the backend in pooler mode.
        (
            "postgres-pgbouncer",
            "DBLOCK_PGBOUNCER_URL",
            "postgres://postgres@127.0.0.1:6432/test",
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
        let options = ConnectOptions::default().pooler(name == "postgres-pgbouncer");
        match Backend::connect(&url, &table, &options).await {
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
        b.run(&crate::backend::Migrate, soon()).await.unwrap();
    }
    out
}

fn grant(a: Attempt) -> Grant {
    match a {
        Attempt::Acquired(g) => g,
        other => panic!("expected a grant, got {other:?}"),
    }
}

fn soon() -> Instant {
    Instant::now() + std::time::Duration::from_secs(10)
}

async fn acquire(b: &Backend, p: &Acquire<'_>) -> Attempt {
    b.run(p, soon()).await.unwrap()
}

async fn release(b: &Backend, h: &HoldRef<'_>, remaining: u32, id: i64) -> Released {
    b.run(
        &crate::backend::Release {
            hold: *h,
            remaining,
            outcome: Some(Outcome::Succeeded),
            release_id: id,
        },
        soon(),
    )
    .await
    .unwrap()
}

async fn count(b: &Backend, key: &str) -> u32 {
    b.run(&crate::backend::Inspect(key), soon())
        .await
        .unwrap()
        .unwrap()
        .hold_count
}

#[tokio::test]
async fn a_repeated_attempt_is_recognised_not_counted_twice() {
    for (name, b) in backends().await {
        let mut p = one("idem", "owner-1", 7);
        let first = grant(acquire(&b, &p).await);
        let repeat = grant(acquire(&b, &p).await);
        assert_eq!(
            (first.hold_count, repeat.hold_count),
            (1, 1),
            "{name}: repeat counted twice"
        );
        assert_eq!(first.fencing_token, repeat.fencing_token, "{name}");
        // A new attempt of the process that holds it once: re-entry.
        p.attempt = 8;
        p.tenure = Some(first.fencing_token as i64);
        p.held = 1;
        let second = grant(acquire(&b, &p).await);
        assert_eq!(second.hold_count, 2, "{name}: new attempt is re-entry");
        assert_eq!(
            second.fencing_token, first.fencing_token,
            "{name}: same tenure"
        );
        assert_eq!(
            grant(acquire(&b, &p).await).hold_count,
            2,
            "{name}: repeat of re-entry"
        );
        assert_eq!(count(&b, "idem").await, 2, "{name}");

        // Another owner's attempt with the same id is still busy.
        let other = Acquire {
            owner: "owner-2",
            ..p
        };
        assert!(
            matches!(acquire(&b, &other).await, Attempt::Busy { .. }),
            "{name}"
        );

        // Release: a repeat of the same release (same id, after a lost reply) matches
        // nothing; a new release sets the count the process has left.
        let h = HoldRef {
            key: "idem",
            owner: "owner-1",
            fencing_token: first.fencing_token,
        };
        assert_eq!(
            release(&b, &h, 1, 100).await,
            Released::StillHeld(1),
            "{name}"
        );
        assert_eq!(
            release(&b, &h, 1, 100).await,
            Released::NotHeld,
            "{name}: applied twice"
        );
        assert_eq!(count(&b, "idem").await, 1, "{name}");
        let stale = HoldRef {
            fencing_token: first.fencing_token - 1,
            ..h
        };
        assert_eq!(
            release(&b, &stale, 0, 101).await,
            Released::NotHeld,
            "{name}: other tenure"
        );
        assert_eq!(release(&b, &h, 0, 102).await, Released::Free, "{name}");
        assert_eq!(release(&b, &h, 0, 103).await, Released::NotHeld, "{name}");
        let last = b
            .run(&crate::backend::LastWriteOf("idem"), soon())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (last.writer, last.release_id, last.release_token),
            (Some(102), Some(102), Some(first.fencing_token as i64)),
            "{name}"
        );
    }
}

/// A live row of ours that the process does not track (an acquire whose reply never came) is
/// not built upon: a first hold of the process takes it over as a new tenure.
#[tokio::test]
async fn an_untracked_hold_of_the_same_owner_is_taken_over_not_reentered() {
    for (name, b) in backends().await {
        let p = one("orphan", "owner-1", 1);
        let orphan = grant(acquire(&b, &p).await);
        // The process never saw that grant: its next lock is a first hold.
        let fresh = grant(acquire(&b, &Acquire { attempt: 2, ..p }).await);
        assert_eq!(fresh.hold_count, 1, "{name}: built on an untracked hold");
        assert!(
            fresh.fencing_token > orphan.fencing_token,
            "{name}: a new tenure"
        );
        // Re-entry into a tenure that is not the row's (a stale one): also a takeover.
        let stale = Acquire {
            attempt: 3,
            tenure: Some(orphan.fencing_token as i64),
            held: 4,
            ..p
        };
        let again = grant(acquire(&b, &stale).await);
        assert_eq!(again.hold_count, 1, "{name}");
        assert!(again.fencing_token > fresh.fencing_token, "{name}");
    }
}

#[tokio::test]
async fn busy_attempts_report_the_holders_time_left_where_the_dialect_can() {
    for (name, b) in backends().await {
        let p = Acquire {
            ttl_us: 10_000_000,
            ..one("left", "a", 1)
        };
        grant(acquire(&b, &p).await);
        let q = Acquire {
            owner: "b",
            attempt: 2,
            ..p
        };
        match acquire(&b, &q).await {
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
            other => panic!("{name}: double grant: {other:?}"),
        }
    }
}

/// One statement for several keys that must grant every one of them.
async fn grants(b: &Backend, all: &[Acquire<'_>]) -> Vec<Grant> {
    let attempts = b
        .run(&crate::backend::AcquireMany::of(all).unwrap(), soon())
        .await
        .unwrap();
    attempts
        .expect("a statement for several keys")
        .into_iter()
        .map(grant)
        .collect()
}

/// A first attempt of `owner` at `key` (nothing tracked), with a 30 s ttl.
pub(crate) fn one<'a>(key: &'a str, owner: &'a str, attempt: i64) -> Acquire<'a> {
    Acquire {
        key,
        owner,
        ttl_us: 30_000_000,
        holder: "h",
        attempt,
        waiting: false,
        tenure: None,
        held: 0,
        min_hold_us: 0,
        once: false,
    }
}

/// Several keys in one statement: all or nothing, re-entry and resends per key, and a busy set
/// writes nothing. (The MySQL 8 path has no such statement: `None`, the caller goes key by key.)
#[tokio::test]
async fn several_keys_in_one_statement_are_taken_whole_or_not_at_all() {
    for (name, b) in backends().await {
        // Backends on one server share the table: keys of their own.
        let [ma, mb, mc, md] = ["m-a", "m-b", "m-c", "m-d"].map(|k| format!("{name}:{k}"));
        let (ma, mb, mc, md) = (ma.as_str(), mb.as_str(), mc.as_str(), md.as_str());
        // "m-b" exists (free), "m-a" and "m-c" do not: updates and inserts in one statement.
        let pre = grant(acquire(&b, &one(mb, "x", 1)).await);
        let h = HoldRef {
            key: mb,
            owner: "x",
            fencing_token: pre.fencing_token,
        };
        assert_eq!(release(&b, &h, 0, 2).await, Released::Free, "{name}");

        let set = [one(ma, "a", 10), one(mb, "a", 11), one(mc, "a", 12)];
        let Some(got) = b
            .run(&crate::backend::AcquireMany::of(&set).unwrap(), soon())
            .await
            .unwrap()
        else {
            assert_eq!(name, "mysql8-path", "{name}: no statement for several keys");
            continue;
        };
        let got: Vec<Grant> = got.into_iter().map(grant).collect();
        assert!(got.iter().all(|g| g.hold_count == 1), "{name}: {got:?}");
        assert!(
            got[1].fencing_token > pre.fencing_token,
            "{name}: new tenure of m-b"
        );
        for (a, _) in set.iter().zip(&got) {
            assert_eq!(count(&b, a.key).await, 1, "{name}: {}", a.key);
        }

        // A resend (same attempt ids, reply lost) is recognised; a new attempt of the process
        // that tracks the tenures is re-entry; both per key.
        let again = grants(&b, &set).await;
        assert!(
            again.iter().all(|g| g.hold_count == 1),
            "{name}: resend counted twice"
        );
        let reenter: Vec<Acquire> = set
            .iter()
            .zip(&got)
            .map(|(a, g)| Acquire {
                attempt: a.attempt + 100,
                tenure: Some(g.fencing_token as i64),
                held: 1,
                ..*a
            })
            .collect();
        let deeper = grants(&b, &reenter).await;
        assert!(
            deeper.iter().all(|g| g.hold_count == 2),
            "{name}: {deeper:?}"
        );
        assert_eq!(
            deeper.iter().map(|g| g.fencing_token).collect::<Vec<_>>(),
            got.iter().map(|g| g.fencing_token).collect::<Vec<_>>(),
            "{name}: re-entry keeps the tenures"
        );

        // Another owner wants "m-c" (held) and "m-d" (free): nothing at all, nothing written.
        let before = b.run(&crate::backend::Inspect(md), soon()).await.unwrap();
        let other = [one(mc, "o", 20), one(md, "o", 21)];
        let answer = b
            .run(&crate::backend::AcquireMany::of(&other).unwrap(), soon())
            .await
            .unwrap()
            .unwrap();
        assert!(
            answer.iter().all(|a| matches!(a, Attempt::Busy { .. })),
            "{name}: a partial or double grant: {answer:?}"
        );
        assert_eq!(before, None, "{name}");
        assert_eq!(
            b.run(&crate::backend::Inspect(md), soon()).await.unwrap(),
            None,
            "{name}: a busy set wrote a row"
        );
        assert_eq!(count(&b, mc).await, 2, "{name}: the holder's row changed");
    }
}
