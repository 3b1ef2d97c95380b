//! `dblock watch`: the held keys, their fair waiters and waiting writers, read again every
//! interval and drawn over the previous view (the terminal's alternate screen), until `q` or
//! Ctrl-C. With `--json`, one snapshot per line on stdout instead, until interrupted.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use crossterm::{cursor, queue, terminal};
use dblock::{LockInfo, Locker, Waiter};
use tokio::sync::mpsc;

use crate::escape::{escape, escape_message, quoted};
use crate::table::{self, Align};
use crate::time::{short, span};
use crate::{json, Failure};

/// What one refresh read.
struct Snapshot {
    at: SystemTime,
    locks: Vec<LockInfo>,
    waiters: Vec<Waiter>,
}

/// Which holds a view shows: keys that start with `prefix`, and with `holder`, only the holds
/// whose holder contains it (and the fair waiters of the keys those hold).
pub struct Filter {
    pub prefix: String,
    pub holder: Option<String>,
}

async fn read(locker: &Locker, filter: &Filter) -> Result<Snapshot, dblock::LockError> {
    let mut locks = locker.held().await?;
    locks.retain(|r| r.key.starts_with(&filter.prefix));
    let mut waiters = locker.waiters(&filter.prefix).await?;
    if let Some(holder) = &filter.holder {
        locks.retain(|r| crate::held_by(r, holder));
        waiters.retain(|w| locks.iter().any(|r| r.key == w.key));
    }
    Ok(Snapshot {
        at: SystemTime::now(),
        locks,
        waiters,
    })
}

pub async fn run(
    locker: &Locker,
    filter: &Filter,
    interval: Duration,
    json: bool,
) -> Result<(), Failure> {
    if !json && (!std::io::stdin().is_terminal() || !std::io::stdout().is_terminal()) {
        return Err(Failure::Error(
            "watch needs a terminal (stdin and stdout); for a stream of snapshots use `watch --json`"
                .into(),
        ));
    }
    if json {
        // Ctrl-C is ours from here on (exit 0): tokio installs its handler at the future's first
        // poll, so it is polled once now, before the first read and the first line. Until then
        // an interrupt would kill the process with its default action.
        let mut interrupted = Box::pin(tokio::signal::ctrl_c());
        tokio::select! {
            biased;
            _ = &mut interrupted => return Ok(()),
            () = std::future::ready(()) => {}
        }
        let first = read(locker, filter).await?;
        stream(locker, filter, interval, first, interrupted).await
    } else {
        // A first read before anything else: a wrong table or database fails here, with its
        // explanation and exit status 1, instead of on a screen.
        let first = read(locker, filter).await?;
        live(locker, filter, interval, first).await
    }
}

/// `--json`: a snapshot per line until Ctrl-C (exit 0) or until stdout is closed.
async fn stream(
    locker: &Locker,
    filter: &Filter,
    interval: Duration,
    first: Snapshot,
    // One Ctrl-C future for the whole stream, already polled once (its handler installed), so
    // that an interrupt that comes while a refresh is read or a line written is not missed.
    mut interrupted: std::pin::Pin<Box<impl std::future::Future<Output = std::io::Result<()>>>>,
) -> Result<(), Failure> {
    let table = locker.table_name().to_owned();
    let mut next: Result<Snapshot, dblock::LockError> = Ok(first);
    loop {
        match next {
            Ok(s) => {
                let line = json::encode(&json::Snapshot {
                    table: table.clone(),
                    at: crate::time::rfc3339(s.at),
                    locks: s.locks.iter().map(json::Lock::from).collect(),
                    waiters: s.waiters.iter().map(json::Queued::from).collect(),
                })
                .map_err(|e| Failure::Error(format!("cannot encode JSON: {e}")))?;
                let mut out = std::io::stdout().lock();
                if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
                    return Ok(()); // the reader went away
                }
            }
            // Said on stderr, and tried again at the next refresh.
            Err(e) => crate::say(&format!(
                "dblock: error: {}",
                escape_message(&e.to_string())
            )),
        }
        let later = async {
            tokio::time::sleep(interval).await;
            read(locker, filter).await
        };
        tokio::select! {
            _ = &mut interrupted => return Ok(()),
            snapshot = later => next = snapshot,
        }
    }
}

/// What the key reader tells the refresh loop.
enum Input {
    Quit,
    Redraw,
}

/// Raw mode and the alternate screen while it lives; the terminal as it was after, whatever
/// way the view ends.
struct Screen;

impl Screen {
    fn enter() -> std::io::Result<Screen> {
        terminal::enable_raw_mode()?;
        let screen = Screen;
        let mut out = std::io::stdout();
        queue!(out, terminal::EnterAlternateScreen, cursor::Hide)?;
        out.flush()?;
        Ok(screen)
    }

    /// Draws `lines` from the top left, each cut to the terminal's width, as many as fit.
    fn draw(&self, lines: &[String]) -> std::io::Result<()> {
        let (width, height) = terminal::size().unwrap_or((80, 24));
        let mut out = std::io::stdout().lock();
        queue!(out, cursor::MoveTo(0, 0))?;
        for (i, line) in lines.iter().take(usize::from(height)).enumerate() {
            let cut: String = line.chars().take(usize::from(width)).collect();
            out.write_all(cut.as_bytes())?;
            queue!(out, terminal::Clear(terminal::ClearType::UntilNewLine))?;
            if i + 1 < usize::from(height) {
                out.write_all(b"\r\n")?;
            }
        }
        queue!(out, terminal::Clear(terminal::ClearType::FromCursorDown))?;
        out.flush()
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        let mut out = std::io::stdout();
        let _ = queue!(out, cursor::Show, terminal::LeaveAlternateScreen);
        let _ = out.flush();
        let _ = terminal::disable_raw_mode();
    }
}

/// Reads keys on a thread of its own (crossterm's reads block): `q`, `Q`, Esc or Ctrl-C quit, a
/// resize redraws. Ends when `stop` is set.
fn keys(tx: mpsc::UnboundedSender<Input>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        match event::poll(Duration::from_millis(100)) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(_) => {
                let _ = tx.send(Input::Quit);
                return;
            }
        }
        let input = match event::read() {
            Ok(Event::Key(k)) if k.kind != KeyEventKind::Release => match k.code {
                KeyCode::Char('q' | 'Q') | KeyCode::Esc => Some(Input::Quit),
                KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => {
                    Some(Input::Quit)
                }
                _ => None,
            },
            Ok(Event::Resize(..)) => Some(Input::Redraw),
            Ok(_) => None,
            Err(_) => Some(Input::Quit),
        };
        if let Some(input) = input {
            if tx.send(input).is_err() {
                return;
            }
        }
    }
}

async fn live(
    locker: &Locker,
    filter: &Filter,
    interval: Duration,
    first: Snapshot,
) -> Result<(), Failure> {
    let screen = Screen::enter().map_err(|e| Failure::Error(format!("terminal: {e}")))?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let stop = stop.clone();
        std::thread::spawn(move || keys(tx, stop))
    };
    let mut last = first;
    let mut error: Option<String> = None;
    let result = loop {
        let lines = view(
            locker.table_name(),
            filter,
            interval,
            &last,
            error.as_deref(),
        );
        if let Err(e) = screen.draw(&lines) {
            break Err(Failure::Error(format!("terminal: {e}")));
        }
        let refresh = tokio::select! {
            () = tokio::time::sleep(interval) => true,
            input = rx.recv() => match input {
                Some(Input::Redraw) => false,
                Some(Input::Quit) | None => break Ok(()),
            },
        };
        if refresh {
            match read(locker, filter).await {
                Ok(s) => {
                    last = s;
                    error = None;
                }
                // Kept on screen, with the last good snapshot, until a read works again.
                Err(e) => error = Some(escape_message(&e.to_string())),
            }
        }
    };
    stop.store(true, Ordering::Relaxed);
    drop(screen);
    let _ = reader.join();
    result
}

/// The screen's lines for `s`.
fn view(
    table: &str,
    filter: &Filter,
    interval: Duration,
    s: &Snapshot,
    error: Option<&str>,
) -> Vec<String> {
    let mut shown = String::new();
    if !filter.prefix.is_empty() {
        shown += &format!(", keys {}*", quoted(&filter.prefix));
    }
    if let Some(holder) = &filter.holder {
        shown += &format!(", holders containing {}", quoted(holder));
    }
    let filter = shown;
    let mut lines = vec![
        format!(
            "dblock watch: table {}{filter}, every {} (q or Ctrl-C quits)   {}",
            quoted(table),
            crate::time::given(interval),
            short(s.at, s.at)
        ),
        format!(
            "{} held, {} waiting in fair queues",
            s.locks.len(),
            s.waiters.len()
        ),
    ];
    if let Some(e) = error {
        lines.push(format!(
            "error: {e} (showing the last snapshot; trying again)"
        ));
    }
    lines.push(String::new());
    // The columns that matter most first: a narrow terminal cuts the right ones off.
    let rows: Vec<Vec<String>> = s
        .locks
        .iter()
        .map(|r| {
            let queued = s.waiters.iter().filter(|w| w.key == r.key).count();
            vec![
                escape(&r.key).into_owned(),
                table::kind(r.kind),
                format!("in {}", span(r.time_left)),
                queued.to_string(),
                r.owner
                    .as_deref()
                    .map_or("-".into(), |o| escape(o).into_owned()),
                r.holder
                    .as_deref()
                    .map_or("-".into(), |h| escape(h).into_owned()),
                r.hold_count.to_string(),
                r.fencing_token.to_string(),
            ]
        })
        .collect();
    lines.extend(table::render(
        &[
            ("KEY", Align::Left),
            ("KIND", Align::Left),
            ("EXPIRES", Align::Left),
            ("QUEUED", Align::Right),
            ("OWNER", Align::Left),
            ("HOLDER", Align::Left),
            ("COUNT", Align::Right),
            ("FENCING TOKEN", Align::Right),
        ],
        &rows,
    ));
    if !s.waiters.is_empty() {
        lines.push(String::new());
        lines.push("FAIR QUEUE (served in ticket order)".into());
        let rows: Vec<Vec<String>> = s
            .waiters
            .iter()
            .map(|w| {
                vec![
                    escape(&w.key).into_owned(),
                    w.ticket.to_string(),
                    escape(&w.owner).into_owned(),
                    format!("in {}", span(w.time_left)),
                ]
            })
            .collect();
        lines.extend(table::render(
            &[
                ("KEY", Align::Left),
                ("TICKET", Align::Right),
                ("OWNER", Align::Left),
                ("TICKET LEASE", Align::Left),
            ],
            &rows,
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header names what the view is cut to: the key prefix and the holder text.
    #[test]
    fn the_header_names_the_filter() {
        let empty = Snapshot {
            at: SystemTime::now(),
            locks: Vec::new(),
            waiters: Vec::new(),
        };
        let filter = Filter {
            prefix: "pick:".into(),
            holder: Some("web-3/".into()),
        };
        let lines = view("jobs", &filter, Duration::from_secs(1), &empty, None);
        assert!(
            lines[0].contains(r#"keys "pick:"*, holders containing "web-3/""#),
            "{}",
            lines[0]
        );
        let all = Filter {
            prefix: String::new(),
            holder: None,
        };
        let lines = view("jobs", &all, Duration::from_secs(1), &empty, None);
        assert!(!lines[0].contains("keys") && !lines[0].contains("holders"));
    }
}
