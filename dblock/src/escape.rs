//! Text that came from a caller (keys, holder labels, owners) or from a database, shown in an
//! error message, a log field or a terminal: escaped, so that it can neither move a terminal's
//! cursor, set its title or ring its bell, nor forge a line of a log or a row of a table.

use std::fmt;

/// Shows a string with its control characters, its backslashes and the Unicode characters that
/// reorder or hide text (bidi overrides and isolates, zero-width characters, separators, ...)
/// escaped as Rust writes them (`\n`, `\\`, `\u{1b}`); every other character, printable ASCII
/// or not, as it is. The CLI and every message and log field of dblock use it.
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

/// A list of keys as a log field, as `Debug` writes a list of strings (`["k1", "k2"]`), each
/// key [`Escaped`] (`Debug` leaves invisible characters as they are) and its quotes as `\"`.
pub(crate) struct Keys<'a>(pub Vec<&'a str>);

impl fmt::Display for Keys<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, key) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            let escaped = Escaped(key).to_string();
            write!(f, "\"{}\"", escaped.replace('"', "\\\""))?;
        }
        f.write_str("]")
    }
}

/// Characters shown escaped: C0 and C1 controls and DEL, the backslash (so that an escape in
/// the output always means one), and the format characters and separators that reorder text,
/// hide it or show nothing themselves (bidi marks, embeddings, overrides and isolates,
/// zero-width spaces and joiners, line and paragraph separators, soft hyphen, fillers,
/// variation selectors, the byte order mark, tags).
fn needs_escape(c: char) -> bool {
    c.is_control() || c == '\\' || invisible(c)
}

fn invisible(c: char) -> bool {
    matches!(c,
        '\u{ad}'                      // soft hyphen
        | '\u{34f}'                   // combining grapheme joiner
        | '\u{61c}'                   // Arabic letter mark
        | '\u{115f}' | '\u{1160}'     // Hangul fillers
        | '\u{17b4}' | '\u{17b5}'
        | '\u{180b}'..='\u{180f}'     // Mongolian variation selectors, vowel separator
        | '\u{200b}'..='\u{200f}'     // zero-width space and joiners, LRM, RLM
        | '\u{2028}'..='\u{202e}'     // line and paragraph separators, bidi embeddings, overrides
        | '\u{2060}'..='\u{206f}'     // word joiner, invisible operators, bidi isolates
        | '\u{3164}'                  // Hangul filler
        | '\u{fe00}'..='\u{fe0f}'     // variation selectors
        | '\u{feff}'                  // byte order mark
        | '\u{ffa0}'
        | '\u{fff0}'..='\u{fffb}'     // interlinear annotations
        | '\u{1d173}'..='\u{1d17a}'
        | '\u{e0000}'..='\u{e0fff}'   // tags, variation selectors supplement
    )
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
    fn a_key_list_reads_as_debug_writes_one_with_each_key_escaped() {
        let keys = Keys(vec!["job:7", "a\"b", "k\u{115f}\n"]);
        assert_eq!(keys.to_string(), r#"["job:7", "a\"b", "k\u{115f}\n"]"#);
        assert_eq!(Keys(vec!["job:7"]).to_string(), format!("{:?}", ["job:7"]));
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
