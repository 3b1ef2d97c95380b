//! Text that came from a caller (keys, holder labels, owners) or from a database, shown in an
//! error message, a log field or a terminal: escaped, so that it can neither move a terminal's
//! cursor, set its title or ring its bell, nor forge a line of a log or a row of a table.

use std::fmt;

/// Shows a string with its control characters, its backslashes and the Unicode formatting
/// characters that reorder text (bidi overrides and isolates) escaped as Rust writes them
/// (`\n`, `\\`, `\u{1b}`); every other character, printable ASCII or not, as it is.
///
/// ```
/// # use dblock::Escaped;
/// assert_eq!(Escaped("order:7").to_string(), "order:7");
/// assert_eq!(Escaped("a\nb\x1b[2J").to_string(), "a\\nb\\u{1b}[2J");
/// assert_eq!(Escaped("zürich").to_string(), "zürich");
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.0;
        while let Some(at) = rest.find(needs_escape) {
            f.write_str(&rest[..at])?;
            let c = rest[at..].chars().next().unwrap_or_default();
            match c {
                '\n' => f.write_str("\\n")?,
                '\r' => f.write_str("\\r")?,
                '\t' => f.write_str("\\t")?,
                '\\' => f.write_str("\\\\")?,
                c => write!(f, "\\u{{{:x}}}", c as u32)?,
            }
            rest = &rest[at + c.len_utf8()..];
        }
        f.write_str(rest)
    }
}

/// Characters shown escaped: C0 and C1 controls and DEL, the backslash (so that an escape in
/// the output always means one), and the bidi controls that can make text read in another
/// order than it is stored (U+061C, U+200E, U+200F, U+202A to U+202E, U+2066 to U+2069).
fn needs_escape(c: char) -> bool {
    c.is_control()
        || c == '\\'
        || matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_controls_and_line_breaks_are_escaped() {
        let hostile = "k\x1b]0;owned\x07\r\nfake row\u{202e}txt.exe\\";
        let shown = Escaped(hostile).to_string();
        assert_eq!(
            shown,
            "k\\u{1b}]0;owned\\u{7}\\r\\nfake row\\u{202e}txt.exe\\\\"
        );
        assert!(!shown.chars().any(needs_escape_but_backslash));
    }

    fn needs_escape_but_backslash(c: char) -> bool {
        c != '\\' && needs_escape(c)
    }

    #[test]
    fn printable_text_is_left_alone() {
        for s in ["order:42", "acct:{7}/é", "日本語", "a b\"'"] {
            assert_eq!(Escaped(s).to_string(), s);
        }
        assert_eq!(
            Escaped("\u{85}\u{9f}\x7f").to_string(),
            "\\u{85}\\u{9f}\\u{7f}"
        );
    }
}
