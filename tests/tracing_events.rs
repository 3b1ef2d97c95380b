//! dblock reports what it does through `tracing`: spans around lock calls, events for
//! acquisition, contention, release and errors.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Everything traced on this thread from now on, as text; the guard keeps it installed.
fn capture() -> (Captured, tracing::subscriber::DefaultGuard) {
    let out = Captured::default();
    let writer = out.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    (out, tracing::subscriber::set_default(subscriber))
}

#[tokio::test]
async fn acquire_contention_release_and_errors_are_traced() {
    let (out, _default) = capture();

    let locker = dblock::Locker::connect("sqlite::memory:").await.unwrap();
    locker.migrate().await.unwrap();
    let g = locker.lock("traced").await.unwrap();
    let _ = locker
        .lock("traced")
        .wait(Duration::from_millis(30))
        .await
        .unwrap_err();
    g.release().await.unwrap();
    let _ = locker
        .table("no_such_table")
        .lock("traced")
        .await
        .unwrap_err();

    let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    for needle in [
        "dblock.lock",
        "key=traced",
        "acquired",
        "fencing_token=",
        "busy: waiting",
        "busy: giving up",
        "released",
        "acquire failed",
    ] {
        assert!(text.contains(needle), "no `{needle}` in the trace:\n{text}");
    }
}

/// Renewal is one statement per tick for all of a locker's due leases, not one per lock: the task
/// reports each batch with its size.
///
/// The ten locks are taken together (one or two coalesced statements), so their renewals fall in
/// one tick's window. On a loaded machine the first tick may still split them; every lease a
/// statement extends gets the same new due time, so from the first full batch on each tick
/// extends all ten at once. The ttl leaves a stalled fsync of a busy CI machine two seconds of
/// slack before a lease could end.
/// A locked function: its body's events carry the lock (span `dblock.locked`).
#[cfg(feature = "macros")]
#[dblock::distributed_lock(key = "job:{id}", locker = locker)]
async fn traced_body(locker: &dblock::Locker, id: u32) -> Result<(), dblock::LockError> {
    tracing::info!("inside the body");
    Ok(())
}

#[cfg(feature = "macros")]
#[tokio::test]
async fn a_locked_body_runs_in_a_span_that_names_its_lock() {
    let (out, _default) = capture();
    let locker = dblock::Locker::connect("sqlite::memory:").await.unwrap();
    locker.migrate().await.unwrap();
    traced_body(&locker, 7).await.unwrap();
    let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("inside the body"))
        .unwrap_or_else(|| panic!("no body event in:\n{text}"));
    for needle in [
        "dblock.locked",
        "function=\"tracing_events::traced_body\"",
        "keys=[\"job:7\"]",
        "fencing_tokens=[",
    ] {
        assert!(line.contains(needle), "{needle:?} not in {line:?}");
    }
}

#[tokio::test]
async fn due_leases_are_extended_in_one_batch() {
    let (out, _default) = capture();

    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("l.db").display());
    let locker = dblock::Locker::connect(&url).await.unwrap();
    locker.migrate().await.unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..10 {
        let locker = locker.clone();
        tasks.spawn(async move {
            locker
                .lock(format!("b{i}"))
                .ttl(Duration::from_secs(3))
                .await
                .unwrap()
                .auto_renew()
        });
    }
    let guards = tasks.join_all().await;
    let batches = || -> Vec<usize> {
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        text.lines()
            .filter(|l| l.contains("leases extended"))
            .map(|l| {
                let n = l.rsplit("leases=").next().unwrap();
                n.trim().parse().unwrap()
            })
            .collect()
    };
    let give_up = tokio::time::Instant::now() + Duration::from_secs(15);
    while batches().iter().filter(|&&n| n == 10).count() < 2 {
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        assert!(
            tokio::time::Instant::now() < give_up,
            "no two full renewal batches in 15 s: {:?}\n{text}",
            batches()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let sizes = batches();
    let first_full = sizes.iter().position(|&n| n == 10).unwrap();
    assert!(
        sizes[..first_full].iter().sum::<usize>() <= 10,
        "leases renewed apart more than once before their due times met: {sizes:?}"
    );
    assert!(
        sizes[first_full..].iter().all(|&n| n == 10),
        "once together, every tick extends all ten leases in one statement: {sizes:?}"
    );
    drop(guards);
}

/// A migration with nothing to do says nothing at INFO or above (PostgreSQL's "relation already
/// exists, skipping" NOTICE used to reach the application's log on every start).
#[tokio::test]
async fn migrate_is_quiet_when_there_is_nothing_to_do() {
    let (dbs, _dir) = common::all("quiet_migrate").await;
    for db in &dbs {
        let (out, _default) = capture();
        db.locker.migrate().await.unwrap(); // the table exists: common::all made it
        db.locker.migrate().await.unwrap();
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        let loud: Vec<&str> = text
            .lines()
            .filter(|l| {
                [" INFO ", " WARN ", " ERROR "]
                    .iter()
                    .any(|lvl| l.contains(lvl))
            })
            .collect();
        assert!(loud.is_empty(), "{}: {loud:#?}", db.name);
    }
}

/// SQLite has no server clock: a process whose clock is ahead writes lock times "in the future"
/// for the others. `migrate()` (run at start-up) notices and says what it means.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_warns_when_a_process_sharing_the_file_runs_ahead() {
    let (db, _dir) = common::sqlite("clock_ahead").await;
    let table = db.locker.table_name().to_owned();
    let pool = sqlx::SqlitePool::connect(&db.url).await.unwrap();
    // What a process three hours ahead leaves behind: a lock taken at its "now".
    let ahead_ms = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        + Duration::from_secs(3 * 3600))
    .as_millis() as i64;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{table}\" (lock_key, owner, hold_count, fencing_token, expires_at, acquired_at)
         VALUES ('k', 'other', 1, 1, {}, {ahead_ms})",
        ahead_ms + 30_000
    )))
    .execute(&pool)
    .await
    .unwrap();

    let (out, _default) = capture();
    db.locker.migrate().await.unwrap();
    let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    assert!(
        text.contains("WARN") && text.contains("must share one clock"),
        "no warning:\n{text}"
    );
}

/// `lock_all` on free keys takes them in one statement (one round trip) where the dialect has
/// one, and says so; the MySQL 8 path takes them one by one.
#[tokio::test]
async fn lock_all_takes_free_keys_in_one_statement() {
    let (dbs, _dir) = common::all("trace_many").await;
    for db in &dbs {
        let (out, default) = capture();
        let guards = db
            .locker
            .lock_all(["many-c", "many-a", "many-b"])
            .await
            .unwrap();
        assert_eq!(guards.len(), 3);
        for g in guards {
            g.release().await.unwrap();
        }
        drop(default);
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        let one_statement = text.contains("acquired all in one statement");
        let key_by_key = text.contains("dblock.lock{");
        if db.name == "mysql8-path" {
            assert!(!one_statement && key_by_key, "{}: {text}", db.name);
        } else {
            assert!(one_statement && !key_by_key, "{}: {text}", db.name);
        }
    }
}

/// Span names, through the attribute (on SQLite, no server needed).
#[cfg(all(feature = "macros", feature = "sqlite"))]
mod span_names {
    use super::Captured;

    /// Every span opened on this thread from now on, one `new` line each (with its parents).
    fn capture_spans() -> (Captured, tracing::subscriber::DefaultGuard) {
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::NEW)
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        (out, tracing::subscriber::set_default(subscriber))
    }

    #[dblock::distributed_lock(key = "span-one:{id}", locker = locker)]
    async fn one_key(locker: &dblock::Locker, id: u32) -> Result<(), dblock::LockError> {
        let _ = (locker, id);
        Ok(())
    }

    #[dblock::distributed_lock(key = ["span-a:{id}", "span-b:{id}"], locker = locker)]
    async fn two_keys(locker: &dblock::Locker, id: u32) -> Result<(), dblock::LockError> {
        let _ = (locker, id);
        Ok(())
    }

    /// Spans are named after what the caller wrote: a one-key attribute (like `locker.lock(key)`)
    /// is a `dblock.lock` with its key, not a `dblock.lock_all` of one; several keys are a
    /// `dblock.lock_all`.
    #[tokio::test]
    async fn spans_are_named_after_the_call() {
        let locker = dblock::Locker::connect("sqlite::memory:").await.unwrap();
        locker.migrate().await.unwrap();

        let (out, default) = capture_spans();
        one_key(&locker, 1).await.unwrap();
        drop(default);
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        assert!(
            text.contains("dblock.lock{key=span-one:1"),
            "no `dblock.lock` span for the one-key attribute:\n{text}"
        );
        assert!(
            !text.contains("dblock.lock_all"),
            "a one-key attribute traced as `dblock.lock_all`:\n{text}"
        );

        let (out, default) = capture_spans();
        locker
            .lock("span-plain")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        drop(default);
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        assert!(text.contains("dblock.lock{key=span-plain"), "{text}");
        assert!(!text.contains("dblock.lock_all"), "{text}");

        let (out, default) = capture_spans();
        two_keys(&locker, 2).await.unwrap();
        drop(default);
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        assert!(
            text.contains("dblock.lock_all{keys="),
            "no `dblock.lock_all` span for the two-key attribute:\n{text}"
        );
    }
}

/// Every text field of every span and event as it was recorded, before any subscriber's own
/// escaping: what a JSON or custom sink prints.
#[derive(Clone, Default)]
struct RawFields(Arc<Mutex<Vec<String>>>);

impl tracing::field::Visit for RawFields {
    fn record_str(&mut self, _: &tracing::field::Field, value: &str) {
        self.0.lock().unwrap().push(value.to_owned());
    }
    fn record_debug(&mut self, _: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.lock().unwrap().push(format!("{value:?}"));
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for RawFields {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        attrs.record(&mut self.clone());
    }
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        event.record(&mut self.clone());
    }
}

/// Keys and owners are escaped in every span and event field, whatever sink prints them: a key
/// with terminal escapes and a line break, locked, found busy, released, and given to the
/// operator's calls (force_release, force_release_if_owner, steal, reset); a key with an
/// invisible character in a `lock_all`.
#[tokio::test]
async fn span_and_event_fields_never_carry_a_raw_key() {
    use tracing_subscriber::layer::SubscriberExt;
    let raw = RawFields::default();
    let subscriber = tracing_subscriber::registry().with(raw.clone());
    let _default = tracing::subscriber::set_default(subscriber);

    let locker = dblock::Locker::connect("sqlite::memory:").await.unwrap();
    locker.migrate().await.unwrap();
    let hostile = "k\x1b]0;owned\x07\r\nERROR forged line";
    let owner = "o\x1b[31m\r\nforged";
    let g = locker.lock(hostile).await.unwrap();
    let _ = locker.lock(hostile).await.unwrap_err();
    g.release().await.unwrap();
    let _g = locker.lock(hostile).await.unwrap();
    let _ = locker.force_release_if_owner(hostile, owner).await;
    locker.force_release(hostile).await.unwrap();
    let _ = locker.steal(hostile).await.map(drop);
    let _ = locker.reset(hostile).await;
    // Several keys at once (the `dblock.lock_all` span lists them), one with an invisible
    // character that `Debug` leaves as it is.
    let invisible = "k\u{115f}hidden";
    let all = locker.lock_all([invisible, "k2"]).await.unwrap();
    for g in all {
        g.release().await.unwrap();
    }

    let fields = raw.0.lock().unwrap().clone();
    assert!(
        fields.iter().any(|f| f.contains("ERROR forged line")),
        "the key was never traced: {fields:?}"
    );
    for field in &fields {
        for c in ['\x1b', '\x07', '\r', '\n', '\u{115f}'] {
            assert!(!field.contains(c), "{c:?} in a traced field: {field:?}");
        }
    }
}

/// A writer that went away (its call dropped, so nothing withdrew its intent) leaves the intent
/// on the key's free row until the intent's own lease ends (2 s): a reader that comes meanwhile
/// waits it out with the usual backoff (5 ms doubling to 250 ms: about fifteen pauses), not one
/// statement a millisecond (PostgreSQL's busy read answered "0 ms of lease left": retry now).
/// Counted by the wait loop's "busy: waiting" events, which this thread's calls trace.
#[tokio::test]
async fn a_reader_behind_a_gone_writers_intent_backs_off() {
    let (dbs, _dir) = common::all("trace_intent_backoff").await;
    for db in &dbs {
        let (out, _default) = capture();
        let locker = &db.locker;
        let reader = locker.read("k").await.unwrap();
        let writer = {
            let locker = locker.clone();
            tokio::spawn(async move { locker.lock("k").wait(Duration::from_secs(30)).await })
        };
        let intent = dblock::LockKind::Read {
            writer_waiting: true,
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while locker.inspect("k").await.unwrap().map(|i| i.kind) != Some(intent) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{}: no intent recorded",
                db.name
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        writer.abort();
        let _ = writer.await;
        reader.release().await.unwrap();
        out.0.lock().unwrap().clear();
        let late = locker.read("k").wait(Duration::from_secs(10)).await;
        assert!(late.is_ok(), "{}: {late:?}", db.name);
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        let pauses = text.matches("busy: waiting").count();
        assert!(
            pauses < 60,
            "{}: {pauses} pauses behind the intent",
            db.name
        );
    }
}
