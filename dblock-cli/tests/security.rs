//! What the tool prints is safe to print: keys and labels that carry terminal controls come out
//! escaped (and a newline can never forge a row), passwords of database URLs never come out;
//! and where the database comes from (`DATABASE_URL`, `--database-url` over it).

mod common;

use std::time::Duration;

use common::{expect, expect_json, run, stderr, stdout};
use serde_json::json;

/// A key that would retitle the window, ring the bell and forge a row; a label that would
/// clear the screen; a key that would reverse the text after it.
const EVIL_KEY: &str = "evil\u{1b}]0;pwned\u{7}\nFORGED yes x";
const EVIL_LABEL: &str = "\r\u{1b}[2Jlabel";
const BIDI_KEY: &str = "invoice\u{202e}fdp.exe";

fn assert_no_controls(db: &str, what: &str, text: &[u8]) {
    for (i, b) in text.iter().enumerate() {
        assert!(
            *b == b'\n' || (*b >= 0x20 && *b != 0x7f),
            "{db}: {what}: control byte {b:#04x} at {i}: {}",
            String::from_utf8_lossy(text)
        );
    }
    let text = String::from_utf8_lossy(text);
    assert!(
        !text.contains('\u{202e}') && !text.contains('\u{9b}'),
        "{db}: {what}: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_and_labels_are_printed_escaped() {
    let (dbs, _dir) = common::all("escape").await;
    for db in &dbs {
        let g = db
            .locker
            .lock(EVIL_KEY)
            .holder(EVIL_LABEL)
            .ttl(Duration::from_secs(300))
            .await
            .unwrap();
        let list = run(db, &["list"]);
        assert_eq!(list.status.code(), Some(0), "{}", db.name);
        assert_no_controls(db.name, "list", &list.stdout);
        let text = stdout(&list);
        let lines: Vec<&str> = text.lines().collect();
        // The header, one row, the count: the newline in the key made no row of its own.
        assert_eq!(lines.len(), 3, "{}: {text}", db.name);
        assert!(
            lines[1].starts_with("evil\\u{1b}]0;pwned\\u{7}\\nFORGED yes x "),
            "{}: {text}",
            db.name
        );
        assert!(
            lines[1].contains("\\r\\u{1b}[2Jlabel"),
            "{}: {text}",
            db.name
        );
        assert_eq!(lines[2], "1 held");
        // Columns are measured on the escaped text: the row's owner starts under OWNER.
        assert_eq!(
            lines[1].find(g.owner().id()),
            lines[0].find("OWNER"),
            "{}: {text}",
            db.name
        );

        let show = run(db, &["show", EVIL_KEY]);
        assert_eq!(show.status.code(), Some(0), "{}", db.name);
        assert_no_controls(db.name, "show", &show.stdout);
        assert_eq!(stdout(&show).lines().count(), 2, "{}", db.name);

        // JSON escapes them its own way, and they read back exactly.
        for args in [&["list", "--json"][..], &["show", EVIL_KEY, "--json"]] {
            let out = run(db, args);
            assert_no_controls(db.name, "json", &out.stdout);
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            let lock = if args[0] == "list" {
                &v["locks"][0]
            } else {
                &v["lock"]
            };
            assert_eq!(lock["key"], json!(EVIL_KEY), "{}", db.name);
            assert!(
                lock["holder"].as_str().unwrap().ends_with(EVIL_LABEL),
                "{}: {v}",
                db.name
            );
        }

        // Messages too: stderr of a command that found nothing.
        g.release().await.unwrap();
        let out = run(db, &["release", EVIL_KEY]);
        assert_eq!(out.status.code(), Some(3), "{}", db.name);
        assert_no_controls(db.name, "stderr", &out.stderr);
        assert_eq!(
            stderr(&out).lines().count(),
            1,
            "{}: {}",
            db.name,
            stderr(&out)
        );
        assert!(
            stderr(&out).contains("\"evil\\u{1b}]0;pwned\\u{7}\\nFORGED yes x\""),
            "{}: {}",
            db.name,
            stderr(&out)
        );

        let s = db
            .locker
            .semaphore(BIDI_KEY, 2)
            .ttl(Duration::from_secs(300))
            .await
            .unwrap();
        let out = run(db, &["list"]);
        assert_no_controls(db.name, "semaphore", &out.stdout);
        assert!(
            stdout(&out).contains("semaphore \"invoice\\u{202e}fdp.exe\": 1 of 2 permits in use"),
            "{}: {}",
            db.name,
            stdout(&out)
        );
        s.release().await.unwrap();
    }
}

/// In `--json`, what the tables escape is escaped too: DEL, a C1 control (CSI), a
/// bidirectional override, a zero-width space and a tag character come out as `\uXXXX`
/// escapes, never raw, and read back exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_escapes_what_a_terminal_would_obey() {
    let (db, _dir) = common::sqlite("json_escape").await;
    let key = "k\u{7f}\u{9b}31m\u{202e}exe\u{200b}\u{e0041}";
    let _g = db.locker.lock(key).holder("\u{9b}2J").await.unwrap();
    for args in [&["list", "--json"][..], &["show", key, "--json"]] {
        let out = run(&db, args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
        assert_no_controls(db.name, "json", &out.stdout);
        let text = stdout(&out);
        assert!(!text.contains(['\u{200b}', '\u{e0041}']), "{text}");
        for escape in ["\\u007f", "\\u009b", "\\u202e", "\\u200b", "\\udb40\\udc41"] {
            assert!(text.contains(escape), "{escape} in {text}");
        }
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let lock = if args[0] == "list" {
            &v["locks"][0]
        } else {
            &v["lock"]
        };
        assert_eq!(lock["key"], json!(key));
        assert!(lock["holder"].as_str().unwrap().ends_with("\u{9b}2J"));
    }
}

/// A password in the URL (user part or `password=` parameter) never reaches stdout or stderr:
/// not in a connection error, not in a URL that does not parse, not in `--help` (which shows
/// that DATABASE_URL is read, never its value).
#[test]
fn passwords_are_never_printed() {
    let secret = "s3cr3t-Pw0rd";
    let urls = [
        format!("postgres://app:{secret}@127.0.0.1:1/test"),
        format!("postgres://127.0.0.1:1/test?user=app&password={secret}"),
        format!("mysql://app:{secret}@127.0.0.1:1/test"),
        format!("postgres://app:{secret}@127.0.0.1:notaport/test"),
        format!("mysql://app:{secret}@[::1/test"),
        // A password holding `?`, `#` or `@`, which a parser may end the authority at.
        format!("postgres://app:{secret}?x@127.0.0.1:1/test"),
        format!("postgres://app:x?{secret}@127.0.0.1:1/test"),
        format!("mysql://app:#{secret}@127.0.0.1:1/test"),
        format!("postgres://app:a@{secret}@127.0.0.1:notaport/test"),
    ];
    for url in &urls {
        for how in ["env", "flag"] {
            let mut cmd = common::cmd();
            match how {
                "env" => cmd.env("DATABASE_URL", url),
                _ => cmd.args(["--database-url", url]),
            };
            let out = cmd.arg("list").output().unwrap();
            assert_eq!(
                out.status.code(),
                Some(1),
                "{url} ({how}): {}",
                stderr(&out)
            );
            let all = format!("{}{}", stdout(&out), stderr(&out));
            assert!(!all.contains(secret), "{url} ({how}): {all}");
        }
    }
    for args in [&["--help"][..], &["list", "--help"], &["-h"]] {
        let out = common::cmd()
            .env("DATABASE_URL", &urls[0])
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0));
        let help = stdout(&out);
        assert!(help.contains("DATABASE_URL"), "{help}");
        assert!(!help.contains(secret), "{help}");
    }
}

/// The database comes from DATABASE_URL, and `--database-url` (before or after the command)
/// wins over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_url_from_the_environment_or_the_flag() {
    let (db, _dir) = common::sqlite("url").await;
    let _g = db.locker.lock("k").await.unwrap();
    // Only the environment.
    let v = expect_json(&db, &["list", "--json"], 0);
    assert_eq!(v["locks"][0]["key"], json!("k"));

    let other = tempfile::tempdir().unwrap();
    let nowhere = format!(
        "sqlite://{}?mode=rw",
        other.path().join("missing/none.db").display()
    );
    // A bad environment, a good flag: the flag wins, wherever it stands.
    for args in [
        vec![
            "--database-url",
            &db.url,
            "--table",
            db.table(),
            "list",
            "--json",
        ],
        vec![
            "--table",
            db.table(),
            "list",
            "--json",
            "--database-url",
            &db.url,
        ],
    ] {
        let out = common::cmd()
            .env("DATABASE_URL", &nowhere)
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["locks"][0]["key"], json!("k"));
    }
    // A good environment, a bad flag: the flag still wins.
    let out = common::cmd()
        .env("DATABASE_URL", &db.url)
        .args(["--database-url", &nowhere, "--table", db.table(), "list"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    // The table flag after the command works as before it.
    let list = expect(&db, &["list"], 0);
    assert!(list.contains("1 held"), "{list}");
}
