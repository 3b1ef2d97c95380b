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
                if let Some(bad) = path
                    .iter()
                    .enumerate()
                    .find_map(|(i, seg)| (!valid_segment(seg, i == 0)).then_some(seg))
                {
                    return Err(format!(
                        "`{{{inner}}}` in the key template is not a parameter name or field path (at `{bad}`)"
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

/// An identifier (raw `r#type` too), or (after the first segment) a tuple index such as `0`.
fn valid_segment(seg: &str, first: bool) -> bool {
    let seg = seg.strip_prefix("r#").unwrap_or(seg);
    let mut chars = seg.chars();
    match chars.next() {
        Some(c) if c.is_alphabetic() || c == '_' => {
            chars.all(|c| c.is_alphanumeric() || c == '_') && seg != "_"
        }
        Some(c) if c.is_ascii_digit() && !first => seg.chars().all(|c| c.is_ascii_digit()),
        _ => false,
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

        #[test]
        fn text_without_braces_is_kept_verbatim(s in "[^{}]{1,40}") {
            proptest::prop_assert_eq!(parse(&s).unwrap(), vec![Piece::Text(s.clone())]);
        }
    }
}
