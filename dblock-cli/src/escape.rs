//! Text that came from the lock table (keys, holder labels, owners) made safe to print on a
//! terminal: whoever can take a lock chooses its key and label, and a key holding ESC, OSC or a
//! newline must not be able to move the cursor, retitle the window or forge a row of the table.

use std::borrow::Cow;

/// `s` with everything that is not plain printable text written as an escape: `\n`, `\r`,
/// `\t`, `\\` for a backslash (so an escape is never ambiguous), and `\u{1b}` (hex) for the
/// other control characters (C0, DEL, C1) and the invisible formatting characters that can
/// reorder or hide text (bidirectional overrides and isolates, zero-width characters, line and
/// paragraph separators, soft hyphen, byte order mark, tag characters).
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(needs_escape) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if needs_escape(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// `s` escaped and in double quotes (a `"` inside written `\"`), for messages.
pub fn quoted(s: &str) -> String {
    format!("\"{}\"", escape(s).replace('"', "\\\""))
}

fn needs_escape(c: char) -> bool {
    c == '\\' || c.is_control() || invisible(c)
}

/// Format characters (Unicode category Cf) and separators that change how the text around them
/// is shown, or show nothing themselves.
fn invisible(c: char) -> bool {
    matches!(c,
        '\u{ad}'                      // soft hyphen
        | '\u{34f}'                   // combining grapheme joiner
        | '\u{61c}'                   // Arabic letter mark
        | '\u{115f}' | '\u{1160}'     // Hangul fillers
        | '\u{17b4}' | '\u{17b5}'
        | '\u{180b}'..='\u{180f}'     // Mongolian variation selectors, vowel separator
        | '\u{200b}'..='\u{200f}'     // zero-width space/joiners, LRM, RLM
        | '\u{2028}'..='\u{202e}'     // line/paragraph separators, bidi embeddings and overrides
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
    fn plain_text_is_left_alone() {
        for s in [
            "job:nightly",
            "tenant/42 report",
            "état-clé",
            "日本語",
            "a\"b",
        ] {
            assert!(matches!(escape(s), Cow::Borrowed(_)), "{s}");
        }
    }

    #[test]
    fn terminal_controls_are_escaped() {
        assert_eq!(escape("a\nb"), "a\\nb");
        assert_eq!(escape("a\r\tb"), "a\\r\\tb");
        assert_eq!(
            escape("\u{1b}[2J\u{1b}]0;pwned\u{7}"),
            "\\u{1b}[2J\\u{1b}]0;pwned\\u{7}"
        );
        assert_eq!(escape("\u{9b}31m"), "\\u{9b}31m"); // C1 CSI
        assert_eq!(escape("x\u{7f}\0"), "x\\u{7f}\\u{0}");
        assert_eq!(escape("abc\u{202e}fdp.exe"), "abc\\u{202e}fdp.exe");
        assert_eq!(escape("zero\u{200b}width"), "zero\\u{200b}width");
    }

    #[test]
    fn backslashes_keep_escapes_unambiguous() {
        // A key that spells an escape is not shown like the character it names.
        assert_eq!(escape("\\u{1b}"), "\\\\u{1b}");
        assert_ne!(escape("\\n"), escape("\n"));
    }

    #[test]
    fn quoted_escapes_quotes_too() {
        assert_eq!(quoted("a\"b\n"), "\"a\\\"b\\n\"");
    }
}
