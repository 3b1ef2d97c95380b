//! Key templates: `"order:{order_id}"`, `"{self.tenant}:{job.id}"`, `{{` / `}}` for braces.

/// One part of a parsed template.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Piece {
    /// Text copied as it is (braces already unescaped).
    Text(String),
    /// `{root.field.sub}`: a parameter (or `self`) and the fields reached from it.
    Path(Vec<String>),
}

/// Parses a template; the error says what is wrong in words fit for a compile error.
///
/// Input: `"a{{b}}:{x.y}"` — Output: `[Text("a{b}:"), Path(["x", "y"])]`.
pub(crate) fn parse(template: &str) -> Result<Vec<Piece>, String> {
    let mut pieces = Vec::new();
    let mut text = String::new();
    let mut chars = template.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        match c {
            '{' if chars.peek().map(|&(_, c)| c) == Some('{') => {
                chars.next();
                text.push('{');
            }
            '}' if chars.peek().map(|&(_, c)| c) == Some('}') => {
                chars.next();
                text.push('}');
            }
            '}' => {
                return Err(format!(
                "unmatched `}}` at byte {at} of the key template; write `}}}}` for a literal brace"
            ))
            }
            '{' => {
                let start = at + 1;
                let end = loop {
                    match chars.next() {
                        Some((i, '}')) => break i,
                        Some((_, '{')) | None => {
                            return Err(format!(
                                "unclosed `{{` at byte {at} of the key template; write `{{{{` for a literal brace"
                            ))
                        }
                        Some(_) => {}
                    }
                };
                let inner = template[start..end].trim();
                if inner.is_empty() {
                    return Err(
                        "positional `{}` in the key template; name a parameter, like `{order_id}`"
                            .into(),
                    );
                }
                if inner.contains(':') {
                    return Err(format!(
                        "format specs are not supported in key templates (`{{{inner}}}`); values are formatted with `Display`"
                    ));
                }
                let path: Vec<String> = inner.split('.').map(|s| s.trim().to_owned()).collect();
                if let Some((bad, why)) = path
                    .iter()
                    .enumerate()
                    .find_map(|(i, seg)| segment_error(seg, i == 0).map(|why| (seg, why)))
                {
                    return Err(format!(
                        "`{{{inner}}}` in the key template is not a parameter name or field path (at `{bad}`{why})"
                    ));
                }
                if !text.is_empty() {
                    pieces.push(Piece::Text(std::mem::take(&mut text)));
                }
                pieces.push(Piece::Path(path));
            }
            c => text.push(c),
        }
    }
    if !text.is_empty() {
        pieces.push(Piece::Text(text));
    }
    Ok(pieces)
}

/// Rust's keywords (strict and reserved since the 2018 edition; not the weak ones such as
/// `union`, nor 2024's `gen`, a name in older editions): a segment spelled as one does not make
/// an identifier unless written raw (`r#type`); `self` is the receiver, as a first segment.
const KEYWORDS: [&str; 51] = [
    "abstract", "as", "async", "await", "become", "box", "break", "const", "continue", "crate",
    "do", "dyn", "else", "enum", "extern", "false", "final", "fn", "for", "if", "impl", "in",
    "let", "loop", "macro", "match", "mod", "move", "mut", "override", "priv", "pub", "ref",
    "return", "self", "Self", "static", "struct", "super", "trait", "true", "try", "type",
    "typeof", "unsafe", "unsized", "use", "virtual", "where", "while", "yield",
];

/// Whether `word` is one of [`KEYWORDS`] (a name that is written raw, as `r#type`).
pub(crate) fn is_keyword(word: &str) -> bool {
    KEYWORDS.contains(&word)
}

/// `None` when `seg` is an identifier (raw `r#type` too) or, after the first segment, a tuple
/// index such as `0`; else what is wrong with it (`""` when its shape says it all). Whatever
/// passes here makes a valid `Ident` or `Index`: the expansion builds them without a check.
fn segment_error(seg: &str, first: bool) -> Option<&'static str> {
    if seg.starts_with(|c: char| c.is_ascii_digit()) {
        return if first || !seg.chars().all(|c| c.is_ascii_digit()) {
            Some("")
        } else if (seg.len() > 1 && seg.starts_with('0')) || seg.parse::<u32>().is_err() {
            Some(": not a tuple index")
        } else {
            None
        };
    }
    let (word, raw) = match seg.strip_prefix("r#") {
        Some(word) => (word, true),
        None => (seg, false),
    };
    let mut chars = word.chars();
    let ident = match chars.next() {
        Some(c) => {
            (unicode_ident::is_xid_start(c) || c == '_')
                && chars.all(unicode_ident::is_xid_continue)
        }
        None => false,
    };
    if !ident || word == "_" {
        Some("")
    } else if raw && matches!(word, "self" | "Self" | "super" | "crate") {
        Some(": not a raw identifier")
    } else if !raw && is_keyword(word) && !(first && word == "self") {
        Some(": a keyword; write it raw, `r#` before it")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::{parse, Piece};

    fn text(s: &str) -> Piece {
        Piece::Text(s.into())
    }
    fn path(p: &[&str]) -> Piece {
        Piece::Path(p.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn parses_names_paths_and_escapes() {
        assert_eq!(
            parse("order:{order_id}").unwrap(),
            vec![text("order:"), path(&["order_id"])]
        );
        assert_eq!(
            parse("{self.tenant}/{job.spec.id}").unwrap(),
            vec![
                path(&["self", "tenant"]),
                text("/"),
                path(&["job", "spec", "id"])
            ]
        );
        assert_eq!(parse("{{literal}}").unwrap(), vec![text("{literal}")]);
        assert_eq!(parse("{pair.0}").unwrap(), vec![path(&["pair", "0"])]);
        assert_eq!(parse("plain").unwrap(), vec![text("plain")]);
        assert_eq!(parse("").unwrap(), vec![]);
        assert_eq!(parse("{ a }").unwrap(), vec![path(&["a"])]);
        assert_eq!(
            parse("{r#type.r#match}").unwrap(),
            vec![path(&["r#type", "r#match"])]
        );
    }

    #[test]
    fn refuses_malformed_templates() {
        for (bad, why) in [
            ("{}", "positional"),
            ("{", "unclosed"),
            ("a{b", "unclosed"),
            ("a{b{c}}", "unclosed"),
            ("}", "unmatched"),
            ("a}b", "unmatched"),
            ("{a:?}", "format specs"),
            ("{0}", "not a parameter"),
            ("{a..b}", "not a parameter"),
            ("{a-b}", "not a parameter"),
            ("{a.}", "not a parameter"),
            ("{_}", "not a parameter"),
            ("{p.4294967296}", "not a tuple index"),
            ("{p.01}", "not a tuple index"),
            ("{p.1a}", "not a parameter"),
            ("{x.r#self}", "not a raw identifier"),
            ("{r#crate}", "not a raw identifier"),
            ("{type}", "a keyword"),
            ("{x.self}", "a keyword"),
            ("{r#}", "not a parameter"),
        ] {
            let e = parse(bad).expect_err(bad);
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    proptest::proptest! {
        #[test]
        fn never_panics(s in "\\PC*") {
            let _ = parse(&s);
        }

        #[test]
        fn never_panics_on_brace_soup(s in "[{}a-z._0-9: ]{0,24}") {
            let _ = parse(&s);
        }

        /// What `parse` accepts, the expansion makes into identifiers and tuple indexes with no
        /// further check (`Ident::new` panics on anything else).
        #[test]
        fn accepted_segments_make_identifiers(s in "[{}a-zA-Z_0-9#r. ]{0,24}|\\{[a-z]{1,8}\\}") {
            for piece in parse(&s).unwrap_or_default() {
                let Piece::Path(path) = piece else { continue };
                for seg in &path {
                    let span = proc_macro2::Span::call_site();
                    if seg.parse::<u32>().is_err() {
                        match seg.strip_prefix("r#") {
                            Some(raw) => drop(proc_macro2::Ident::new_raw(raw, span)),
                            None => drop(proc_macro2::Ident::new(seg, span)),
                        }
                    }
                }
            }
        }

        #[test]
        fn text_without_braces_is_kept_verbatim(s in "[^{}]{1,40}") {
            proptest::prop_assert_eq!(parse(&s).unwrap(), vec![Piece::Text(s.clone())]);
        }
    }
}
