//! The human view of lock rows: a table whose every value from the database is escaped
//! ([`escape`]) before its column's width is measured, so no key or label can break a row in
//! two, move the cursor or misalign the columns.

use std::time::SystemTime;

use dblock::{LockInfo, LockKind};

use crate::escape::{escape, quoted};
use crate::json::outcome;
use crate::time::{relative, short};

#[derive(Clone, Copy, PartialEq)]
pub enum Align {
    Left,
    Right,
}

/// Lines of a table: the header, then one line per row, each cell padded to its column's
/// widest cell (counted in characters of the escaped text), one space between columns.
pub fn render(header: &[(&str, Align)], rows: &[Vec<String>]) -> Vec<String> {
    let mut widths: Vec<usize> = header.iter().map(|(h, _)| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut out = String::new();
        for ((cell, width), (_, align)) in cells.zip(&widths).zip(header) {
            if !out.is_empty() {
                out.push(' ');
            }
            let pad = " ".repeat(width.saturating_sub(cell.chars().count()));
            match align {
                Align::Left => {
                    out.push_str(cell);
                    out.push_str(&pad);
                }
                Align::Right => {
                    out.push_str(&pad);
                    out.push_str(cell);
                }
            }
        }
        out.trim_end().to_owned()
    };
    let mut lines = vec![line(&mut header.iter().map(|(h, _)| *h))];
    lines.extend(rows.iter().map(|r| line(&mut r.iter().map(String::as_str))));
    lines
}

pub const LOCK_COLUMNS: [(&str, Align); 11] = [
    ("KEY", Align::Left),
    ("KIND", Align::Left),
    ("HELD", Align::Left),
    ("OWNER", Align::Left),
    ("HOLDER", Align::Left),
    ("COUNT", Align::Right),
    ("FENCING TOKEN", Align::Right),
    ("EXPIRES", Align::Left),
    ("ACQUIRED", Align::Left),
    ("RENEWED", Align::Right),
    ("LAST", Align::Left),
];

/// `permit 0/3`, `read`, `read, writer waiting`, `lock`.
pub fn kind(k: LockKind) -> String {
    match k {
        LockKind::Permit { slot, permits } => format!("permit {slot}/{permits}"),
        LockKind::Read {
            writer_waiting: true,
        } => "read, writer waiting".into(),
        LockKind::Read { .. } => "read".into(),
        LockKind::Lock => "lock".into(),
        _ => "other".into(),
    }
}

/// `in 12s (03:20:12Z)`: relative, then absolute.
pub fn when(t: SystemTime, now: SystemTime) -> String {
    format!("{} ({})", relative(t, now), short(t, now))
}

/// The cells of one row, in [`LOCK_COLUMNS`]' order.
pub fn lock_row(r: &LockInfo, now: SystemTime) -> Vec<String> {
    let expires = if r.held {
        // The lease end, with the time left as the database measured it.
        format!(
            "in {} ({})",
            crate::time::span(r.time_left),
            short(r.expires_at, now)
        )
    } else {
        "-".into()
    };
    let last = match (r.last_outcome, r.finished_at) {
        (Some(o), Some(at)) => format!("{} {}", outcome(o), when(at, now)),
        (Some(o), None) => outcome(o).to_owned(),
        _ => "-".into(),
    };
    vec![
        escape(&r.key).into_owned(),
        kind(r.kind),
        if r.held { "yes" } else { "no" }.into(),
        r.owner
            .as_deref()
            .map_or("-".into(), |o| escape(o).into_owned()),
        r.holder
            .as_deref()
            .map_or("-".into(), |h| escape(h).into_owned()),
        r.hold_count.to_string(),
        r.fencing_token.to_string(),
        expires,
        when(r.acquired_at, now),
        r.renewals.to_string(),
        last,
    ]
}

/// The table of `rows`.
pub fn locks(rows: &[LockInfo], now: SystemTime) -> Vec<String> {
    let cells: Vec<Vec<String>> = rows.iter().map(|r| lock_row(r, now)).collect();
    render(&LOCK_COLUMNS, &cells)
}

/// One line per semaphore among `rows`: how many of its permits are in use.
pub fn semaphores(rows: &[LockInfo]) -> Vec<String> {
    let mut seen: Vec<(&str, u32, usize)> = Vec::new();
    for r in rows {
        if let LockKind::Permit { permits, .. } = r.kind {
            match seen
                .iter_mut()
                .find(|(k, n, _)| *k == r.key && *n == permits)
            {
                Some((_, _, used)) => *used += 1,
                None => seen.push((&r.key, permits, 1)),
            }
        }
    }
    seen.into_iter()
        .map(|(key, permits, used)| {
            format!(
                "semaphore {}: {used} of {permits} permits in use",
                quoted(key)
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newline_in_a_cell_cannot_forge_a_row() {
        let rows = [["a\nFORGED x", "1"], ["b", "2"]];
        let escaped: Vec<Vec<String>> = rows
            .iter()
            .map(|r| r.iter().map(|c| escape(c).into_owned()).collect())
            .collect();
        let lines = render(&[("KEY", Align::Left), ("N", Align::Right)], &escaped);
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[1], "a\\nFORGED x 1");
        assert_eq!(lines[2], format!("b{} 2", " ".repeat(10)));
    }
}
