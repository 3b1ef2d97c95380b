//! A PostgreSQL cluster of the test's own: its own data directory (a temp dir) and port, so a
//! test can crash and restart it without touching the shared server other tests use.
//!
//! ```text
//! let Some(pg) = PrivatePg::start("durability") else { return }; // SKIPPING said, unless required
//! let locker = Locker::connect(&pg.url()).await?;
//! pg.crash();    // pg_ctl stop -m immediate: no checkpoint, no WAL flush
//! pg.restart();  // crash recovery replays the WAL
//! ```
//!
//! PostgreSQL refuses to run as root, so as root the cluster runs as the `postgres` user.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

pub struct PrivatePg {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    as_postgres: bool,
    /// With a clock of its own (`start_with_clock`): libfaketime's offset file.
    clock: Option<PathBuf>,
}

/// libfaketime (Debian's package `faketime`, which `.ci/run` installs when missing).
const FAKETIME_LIB: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

impl PrivatePg {
    /// initdb + start, with `settings` appended to `postgresql.conf`. `None` (after a loud
    /// SKIPPING line) where no PostgreSQL server binaries are installed; with
    /// `DBLOCK_REQUIRE_SERVERS=1` that is a failure instead.
    pub fn start(test: &str, settings: &[&str]) -> Option<PrivatePg> {
        Self::start_inner(test, settings, false)
    }

    /// As [`start`](Self::start), with a clock of the server's own: the postmaster and every
    /// backend run under libfaketime, their time of day the real one plus an offset that
    /// [`set_clock`](Self::set_clock) changes at once (read at every call; the monotonic clock
    /// is left alone). `None` (after SKIPPING) without libfaketime, unless servers are required.
    pub fn start_with_clock(test: &str, settings: &[&str]) -> Option<PrivatePg> {
        if !Path::new(FAKETIME_LIB).exists() {
            let msg = format!("SKIPPING {test}: no libfaketime ({FAKETIME_LIB}; package faketime)");
            assert!(!super::require_servers(), "{msg}");
            super::shout(&msg);
            return None;
        }
        Self::start_inner(test, settings, true)
    }

    /// Steps the server's clock: its time of day is the real one plus `secs` from now on.
    pub fn set_clock(&self, secs: i64) {
        let file = self.clock.as_ref().expect("a cluster started with a clock");
        std::fs::write(file, format!("{secs:+}\n")).expect("write the offset file");
    }

    fn start_inner(test: &str, settings: &[&str], clock: bool) -> Option<PrivatePg> {
        let Some(bin) = bin_dir() else {
            let msg = format!(
                "SKIPPING {test}: no PostgreSQL server binaries (/usr/lib/postgresql/*/bin) for a private cluster"
            );
            assert!(!super::require_servers(), "{msg}");
            super::shout(&msg);
            return None;
        };
        let as_postgres = is_root();
        let dir = tempfile::Builder::new()
            .prefix("dblock-pg-")
            .tempdir()
            .expect("tempdir");
        if as_postgres {
            run(Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(dir.path()));
        }
        let clock = clock.then(|| {
            let file = dir.path().join("clock-offset");
            std::fs::write(&file, "+0\n").expect("offset file");
            file
        });
        let pg = PrivatePg {
            bin,
            port: free_port(),
            dir,
            as_postgres,
            clock,
        };
        let data = pg.data();
        pg.run_pg(
            "initdb",
            &[
                "-D",
                data.to_str().unwrap(),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
        );
        let mut conf = format!(
            "\nport = {}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
             fsync = on\nsynchronous_commit = on\nmax_connections = 50\nshared_buffers = 32MB\n",
            pg.port,
            pg.dir.path().display()
        );
        for s in settings {
            conf.push_str(s);
            conf.push('\n');
        }
        let conf_path = data.join("postgresql.conf");
        let mut existing = std::fs::read_to_string(&conf_path).expect("postgresql.conf");
        existing.push_str(&conf);
        std::fs::write(&conf_path, existing).expect("write postgresql.conf");
        pg.restart();
        Some(pg)
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Starts the cluster (after `crash`: crash recovery) and waits until it accepts connections.
    pub fn restart(&self) {
        let data = self.data();
        let log = self.dir.path().join("server.log");
        let args = [
            "-D",
            data.to_str().unwrap(),
            "-l",
            log.to_str().unwrap(),
            "-w",
            "-t",
            "60",
            "start",
        ];
        match &self.clock {
            None => self.run_pg("pg_ctl", &args),
            // The server inherits pg_ctl's environment.
            Some(offset) => run(self
                .command_under(
                    "pg_ctl",
                    &[
                        format!("LD_PRELOAD={FAKETIME_LIB}"),
                        format!("FAKETIME_TIMESTAMP_FILE={}", offset.display()),
                        "FAKETIME_NO_CACHE=1".into(),
                        "FAKETIME_DONT_FAKE_MONOTONIC=1".into(),
                    ],
                )
                .args(args)),
        }
    }

    /// `pg_ctl stop -m immediate`: the server quits at once, with no checkpoint and no flush of
    /// WAL it had not flushed yet; what was committed but not flushed is gone after recovery.
    pub fn crash(&self) {
        let data = self.data();
        self.run_pg(
            "pg_ctl",
            &[
                "-D",
                data.to_str().unwrap(),
                "-m",
                "immediate",
                "-w",
                "stop",
            ],
        );
    }

    /// `pg_ctl stop -m fast`: an orderly shutdown (connections are closed, WAL flushed).
    pub fn stop(&self) {
        let data = self.data();
        self.run_pg(
            "pg_ctl",
            &["-D", data.to_str().unwrap(), "-m", "fast", "-w", "stop"],
        );
    }

    fn run_pg(&self, tool: &str, args: &[&str]) {
        run(self.command(tool).args(args));
    }

    /// A PostgreSQL tool, run as the `postgres` user when this process is root.
    fn command(&self, tool: &str) -> Command {
        self.command_under(tool, &[])
    }

    /// A PostgreSQL tool with `env` (`NAME=value`) set for it alone (through `env`, so that
    /// `runuser` itself runs without them).
    fn command_under(&self, tool: &str, env: &[String]) -> Command {
        let exe = self.bin.join(tool);
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]);
            c
        } else {
            Command::new("env")
        };
        if self.as_postgres {
            cmd.arg("env");
        }
        cmd.args(env).arg(&exe);
        cmd.current_dir(self.dir.path());
        cmd
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        let data = self.data();
        let _ = self
            .command("pg_ctl")
            .args(["-D", data.to_str().unwrap(), "-m", "immediate", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

fn run(cmd: &mut Command) {
    let out = cmd.output().expect("run a PostgreSQL tool");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn bin_dir() -> Option<PathBuf> {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path().join("bin"))
        .filter(|p| Path::new(p).join("initdb").exists())
        .collect();
    versions.sort();
    versions.pop()
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().unwrap().port()
}

#[cfg(feature = "mysql")]
use dblock::sqlx;

/// A MariaDB server of the test's own under libfaketime (its time of day the real one plus an
/// offset that [`set_clock`](Self::set_clock) changes at once): its own data directory (a temp
/// dir owned by `mysql`) and port, root with an empty password, database `test`. Needs root,
/// `mariadbd` and libfaketime; `None` (after SKIPPING) otherwise, unless servers are required.
#[cfg(feature = "mysql")]
pub struct PrivateMariaDb {
    dir: tempfile::TempDir,
    port: u16,
    server: std::process::Child,
    offset: PathBuf,
}

#[cfg(feature = "mysql")]
const MARIADBD: &str = "/usr/sbin/mariadbd";

#[cfg(feature = "mysql")]
impl PrivateMariaDb {
    pub async fn start_with_clock(test: &str) -> Option<PrivateMariaDb> {
        let missing = [MARIADBD, FAKETIME_LIB, "/usr/bin/mariadb-install-db"]
            .into_iter()
            .find(|p| !Path::new(p).exists());
        if let Some(missing) = missing.or((!is_root()).then_some("root")) {
            let msg = format!("SKIPPING {test}: a private MariaDB server needs {missing}");
            assert!(!super::require_servers(), "{msg}");
            super::shout(&msg);
            return None;
        }
        let dir = tempfile::Builder::new()
            .prefix("dblock-mariadb-")
            .tempdir()
            .expect("tempdir");
        let port = free_port();
        let d = dir.path().display();
        let cnf = dir.path().join("my.cnf");
        std::fs::write(
            &cnf,
            format!(
                "[mariadbd]\ndatadir={d}/data\nsocket={d}/mysqld.sock\npid-file={d}/mysqld.pid\n\
                 log-error={d}/error.log\ntmpdir={d}\nport={port}\nbind-address=127.0.0.1\n\
                 user=mysql\nskip-name-resolve\nskip-log-bin\ninnodb_buffer_pool_size=32M\n\
                 innodb_log_file_size=16M\ninnodb_flush_log_at_trx_commit=2\n"
            ),
        )
        .expect("my.cnf");
        run(Command::new("chown")
            .args(["-R", "mysql:mysql"])
            .arg(dir.path()));
        run(Command::new("mariadb-install-db")
            .arg(format!("--defaults-file={}", cnf.display()))
            .args(["--user=mysql", "--auth-root-authentication-method=normal"]));
        let offset = dir.path().join("clock-offset");
        std::fs::write(&offset, "+0\n").expect("offset file");
        let server = Command::new(MARIADBD)
            .arg(format!("--defaults-file={}", cnf.display()))
            .env("LD_PRELOAD", FAKETIME_LIB)
            .env("FAKETIME_TIMESTAMP_FILE", &offset)
            .env("FAKETIME_NO_CACHE", "1")
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start mariadbd");
        let db = PrivateMariaDb {
            dir,
            port,
            server,
            offset,
        };
        let admin = format!("mysql://root@127.0.0.1:{port}/mysql");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            match <sqlx::MySqlConnection as sqlx::Connection>::connect(&admin).await {
                Ok(mut conn) => {
                    sqlx::query("CREATE DATABASE IF NOT EXISTS test")
                        .execute(&mut conn)
                        .await
                        .expect("CREATE DATABASE test");
                    break;
                }
                Err(e) if std::time::Instant::now() > deadline => {
                    let log = std::fs::read_to_string(db.dir.path().join("error.log"))
                        .unwrap_or_default();
                    panic!("the private MariaDB server did not start: {e}\n{log}");
                }
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(200)).await,
            }
        }
        Some(db)
    }

    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/test", self.port)
    }

    /// Steps the server's clock: its time of day is the real one plus `secs` from now on.
    pub fn set_clock(&self, secs: i64) {
        std::fs::write(&self.offset, format!("{secs:+}\n")).expect("write the offset file");
    }
}

#[cfg(feature = "mysql")]
impl Drop for PrivateMariaDb {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}
