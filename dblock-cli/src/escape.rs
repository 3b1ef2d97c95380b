//! Text that came from the lock table (keys, holder labels, owners) made safe to print on a
//! terminal: whoever can take a lock chooses its key and label, and a key holding ESC, OSC or a
//! newline must not be able to move the cursor, retitle the window or forge a row of the table.

use std::borrow::Cow;

/// `s` with everything that is not plain printable text written as an escape: `\n`, `\r`,
/// `\t`, `\\` for a backslash (so an escape is never ambiguous), and `\u{1b}` (hex) for the
/// other control characters (C0, DEL, C1) and the invisible formatting characters that can
/// reorder or hide text (bidirectional overrides and isolates, zero-width characters, line and
/// paragraph separators, soft hyphen, byte order mark, tag characters): [`dblock::Escaped`], the
/// one rule dblock prints by.
pub fn escape(s: &str) -> Cow<'_, str> {
    let shown = dblock::Escaped(s).to_string();
    if shown == s {
        Cow::Borrowed(s)
    } else {
        Cow::Owned(shown)
    }
}

/// `s`, a message the library already wrote with its keys and labels escaped: the controls and
/// invisible characters escaped as by [`escape`], its backslashes left as they are (escaping them
/// again would show a key's `\n` as `\\n`).
pub fn escape_message(s: &str) -> String {
    s.split('\\')
        .map(|part| escape(part).into_owned())
        .collect::<Vec<_>>()
        .join("\\")
}

/// `s` escaped and in double quotes (a `"` inside written `\"`), for messages.
pub fn quoted(s: &str) -> String {
    format!("\"{}\"", escape(s).replace('"', "\\\""))
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
    fn a_message_already_escaped_is_not_escaped_twice() {
        let said = format!("lock `{}` is busy", dblock::Escaped("a\nb\\c"));
        assert_eq!(escape_message(&said), "lock `a\\nb\\\\c` is busy");
        assert_eq!(escape_message("x\u{1b}[2J\\y"), "x\\u{1b}[2J\\y");
    }

    #[test]
    fn quoted_escapes_quotes_too() {
        assert_eq!(quoted("a\"b\n"), "\"a\\\"b\\n\"");
    }
}
