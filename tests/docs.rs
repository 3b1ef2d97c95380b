//! The user's documentation (README.md and docs/) against the code: every list a user looks
//! things up in (migrations, error variants, cargo features, metrics, spans) names exactly what
//! the code has, every relative link resolves, every chapter with Rust in it is compiled as a
//! doctest (`dblock/src/lib.rs`, `doc_snippets`), and the README keeps the shape CI relies on.
//! Plain file reading: no database, every feature set.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// The `dblock` package's directory.
fn package() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The repository's top directory.
fn root() -> PathBuf {
    package()
        .parent()
        .expect("the package is inside the workspace")
        .to_path_buf()
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// README.md and every chapter of docs/, as (path relative to the top, text).
fn documents() -> Vec<(String, String)> {
    let mut docs = vec![("README.md".to_owned(), read(&root().join("README.md")))];
    let mut chapters: Vec<_> = fs::read_dir(root().join("docs"))
        .expect("docs/ exists")
        .map(|e| e.expect("a docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    chapters.sort();
    for path in chapters {
        let name = format!("docs/{}", path.file_name().unwrap().to_string_lossy());
        docs.push((name, read(&path)));
    }
    docs
}

fn document(name: &str) -> String {
    read(&root().join(name))
}

/// The lines of `text` outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut in_code = false;
    let mut lines = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if !in_code {
            lines.push(line);
        }
    }
    lines
}

/// The text of the section headed `heading` (e.g. `## Errors`), up to the next heading of the
/// same or a higher level, code blocks included.
fn section(text: &str, heading: &str) -> String {
    let level = heading.split(' ').next().unwrap().len();
    let mut lines = text.lines().skip_while(|l| l.trim_end() != heading);
    assert!(lines.next().is_some(), "no section `{heading}`");
    let mut in_code = false;
    let mut out = String::new();
    for line in lines {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        }
        let hashes = line.chars().take_while(|c| *c == '#').count();
        if !in_code && hashes > 0 && hashes <= level && line[hashes..].starts_with(' ') {
            break;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// The first column of every table row of `text`, with its backticks removed when the whole cell
/// is one code span (`| `Busy` | ... |` gives `Busy`); header and separator rows left out.
fn first_column(text: &str) -> Vec<String> {
    let rows: Vec<&str> = prose(text)
        .into_iter()
        .filter(|l| l.starts_with('|'))
        .collect();
    let mut cells = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let cell = row[1..].split('|').next().unwrap_or_default().trim();
        let next_is_separator = rows.get(i + 1).is_some_and(|r| r.starts_with("|---"));
        if cell.starts_with("---") || next_is_separator {
            continue;
        }
        cells.push(cell.to_owned());
    }
    cells
}

/// A cell that is one code span, without its backticks.
fn code(cell: &str) -> Option<&str> {
    let inner = cell.strip_prefix('`')?.strip_suffix('`')?;
    (!inner.contains('`')).then_some(inner)
}

/// Every code span (`...`) of `text`'s prose.
fn code_spans(text: &str) -> Vec<String> {
    let mut spans = Vec::new();
    for line in prose(text) {
        let mut parts = line.split('`');
        parts.next();
        while let (Some(inside), Some(_)) = (parts.next(), parts.next()) {
            spans.push(inside.to_owned());
        }
    }
    spans
}

fn sorted<I: IntoIterator<Item = S>, S: Into<String>>(items: I) -> BTreeSet<String> {
    items.into_iter().map(Into::into).collect()
}

/// Fails with both lists and what differs.
fn assert_same(what: &str, in_code: &BTreeSet<String>, in_docs: &BTreeSet<String>, docs: &str) {
    let missing: Vec<_> = in_code.difference(in_docs).collect();
    let stale: Vec<_> = in_docs.difference(in_code).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "{what}: {docs} is out of step with the code\n  in the code, not in {docs}: {missing:?}\n  \
         in {docs}, not in the code: {stale:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Migrations

/// The migrations directory: inside the package (`dblock/migrations`), else at the top.
fn migrations_dir() -> PathBuf {
    let inside = package().join("migrations");
    if inside.is_dir() {
        inside
    } else {
        root().join("migrations")
    }
}

/// The `.sql` files of one backend's migrations.
fn migration_files(backend: &str) -> BTreeSet<String> {
    let dir = migrations_dir().join(backend);
    fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| name.ends_with(".sql"))
        .collect()
}

/// `0004` in `0004_fair_queue.sql`, `migration 0004`: four digits.
fn is_migration_number(s: &str) -> bool {
    s.len() == 4 && s.bytes().all(|b| b.is_ascii_digit())
}

#[test]
fn the_migration_list_names_every_file_of_every_backend() {
    let backends = ["postgres", "mysql", "sqlite"];
    let files = migration_files(backends[0]);
    assert!(
        !files.is_empty(),
        "no migrations found in {}",
        migrations_dir().display()
    );
    for backend in &backends[1..] {
        assert_same(
            &format!("migrations of {backend} against postgres"),
            &files,
            &migration_files(backend),
            &format!("migrations/{backend}"),
        );
    }

    let reference = document("docs/reference.md");
    let listed: BTreeSet<String> = first_column(&section(&reference, "## Migrations"))
        .iter()
        .filter_map(|c| code(c))
        .map(str::to_owned)
        .collect();
    assert_same(
        "migrations",
        &files,
        &listed,
        "docs/reference.md, \"## Migrations\"",
    );

    // Any migration named anywhere (`0004_fair_queue.sql`, "migration 0005") exists.
    let numbers: BTreeSet<&str> = files.iter().map(|f| &f[..4]).collect();
    for (name, text) in documents() {
        for span in code_spans(&text) {
            if span.ends_with(".sql") && is_migration_number(span.get(..4).unwrap_or_default()) {
                assert!(
                    files.contains(&span),
                    "{name} names `{span}`, which is not a migration"
                );
            }
        }
        for line in prose(&text) {
            for (at, _) in line.match_indices("migration ") {
                let number = line[at + "migration ".len()..].get(..4).unwrap_or_default();
                if is_migration_number(number) {
                    assert!(
                        numbers.contains(number),
                        "{name} names migration {number}, which does not exist: {line}"
                    );
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Errors

/// The variants of `LockError`, read from `dblock/src/error.rs`.
fn error_variants() -> BTreeSet<String> {
    let source = read(&package().join("src/error.rs"));
    let body = source
        .split_once("pub enum LockError {")
        .expect("error.rs declares `pub enum LockError {`")
        .1;
    let body = &body[..body.find("\n}").expect("the enum ends")];
    body.lines()
        .filter_map(|line| line.strip_prefix("    "))
        .filter(|line| line.starts_with(|c: char| c.is_ascii_uppercase()))
        .map(|line| {
            line.split(|c: char| !c.is_ascii_alphanumeric())
                .next()
                .unwrap()
                .to_owned()
        })
        .collect()
}

#[test]
fn the_error_list_names_every_variant_of_lock_error() {
    let variants = error_variants();
    assert!(
        variants.contains("Busy") && variants.contains("Database"),
        "{variants:?}"
    );

    let reference = document("docs/reference.md");
    let listed: BTreeSet<String> = first_column(&section(&reference, "## Errors"))
        .iter()
        .filter_map(|c| code(c))
        .filter(|c| c.starts_with(|ch: char| ch.is_ascii_uppercase()))
        .map(str::to_owned)
        .collect();
    assert_same(
        "LockError variants",
        &variants,
        &listed,
        "docs/reference.md, \"## Errors\"",
    );

    // `LockError::Something` anywhere in the docs names a variant (or a method) that exists.
    for (name, text) in documents() {
        for (at, _) in text.match_indices("LockError::") {
            let rest = &text[at + "LockError::".len()..];
            let word: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if word.starts_with(|c: char| c.is_ascii_uppercase()) {
                assert!(
                    variants.contains(&word),
                    "{name} names `LockError::{word}`, which is not a variant"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Limits

/// The `MAX_*` constants dblock exports (`pub use ...::{.., MAX_PERMITS}` in lib.rs).
fn exported_limits() -> BTreeSet<String> {
    let lib = read(&package().join("src/lib.rs"));
    lib.lines()
        .filter(|l| l.starts_with("pub use "))
        .flat_map(|l| l.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')))
        .filter(|word| word.starts_with("MAX_"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_limits_table_names_every_exported_limit() {
    let limits = exported_limits();
    assert!(limits.contains("MAX_KEY_LEN"), "{limits:?}");
    let docs = section(&document("docs/reference.md"), "## Limits");
    let named: BTreeSet<String> = code_spans(&docs)
        .iter()
        .filter_map(|s| s.strip_prefix("dblock::"))
        .filter(|s| s.starts_with("MAX_"))
        .map(str::to_owned)
        .collect();
    assert_same(
        "limits",
        &limits,
        &named,
        "docs/reference.md, \"## Limits\"",
    );
}

// ---------------------------------------------------------------------------------------------
// Cargo features

/// Features a user can pick: `[features]` of dblock/Cargo.toml without `default`, private
/// ones (`_test-util`) and `admin`, the old operator tool's (the `dblock-cli` crate replaces it).
fn public_features() -> (BTreeSet<String>, BTreeSet<String>) {
    let manifest = read(&package().join("Cargo.toml"));
    let table = manifest
        .split_once("\n[features]\n")
        .expect("Cargo.toml has [features]")
        .1;
    let table = &table[..table.find("\n[").unwrap_or(table.len())];
    let mut features = BTreeSet::new();
    let mut defaults = BTreeSet::new();
    for line in table.lines() {
        let Some((name, value)) = line.split_once('=') else {
            continue;
        };
        let name = name.trim();
        if name.starts_with('#') {
            continue;
        }
        if name == "default" {
            defaults = value
                .split('"')
                .skip(1)
                .step_by(2)
                .map(str::to_owned)
                .collect();
        } else if !name.starts_with('_') && name != "admin" {
            features.insert(name.to_owned());
        }
    }
    (features, defaults)
}

#[test]
fn the_feature_tables_name_every_public_feature_and_the_defaults() {
    let (features, defaults) = public_features();
    for (file, heading) in [
        ("README.md", "## Install"),
        ("docs/reference.md", "## Cargo features"),
    ] {
        let text = section(&document(file), heading);
        let rows: Vec<&str> = prose(&text)
            .into_iter()
            .filter(|l| l.starts_with("| `"))
            .collect();
        let listed = sorted(
            rows.iter()
                .filter_map(|r| code(r[1..].split('|').next().unwrap().trim()).map(str::to_owned)),
        );
        let place = format!("{file}, \"{heading}\"");
        assert_same("cargo features", &features, &listed, &place);
        let listed_defaults = sorted(rows.iter().filter_map(|r| {
            let cells: Vec<&str> = r.split('|').map(str::trim).collect();
            (cells.get(cells.len().saturating_sub(2)) == Some(&"yes"))
                .then(|| code(cells[1]).unwrap_or_default().to_owned())
        }));
        assert_same("default features", &defaults, &listed_defaults, &place);
    }
}

// ---------------------------------------------------------------------------------------------
// Metrics and spans

/// Every `"..."` literal of `text`.
fn literals(text: &str) -> Vec<&str> {
    text.split('"').skip(1).step_by(2).collect()
}

/// The metric names, label keys and `outcome` values of `dblock/src/meter.rs`.
fn meter() -> (BTreeSet<String>, BTreeSet<String>, BTreeSet<String>) {
    let source = read(&package().join("src/meter.rs"));
    let code_only: String = source
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut names = BTreeSet::new();
    for macro_call in ["histogram!(", "counter!(", "gauge!("] {
        for (at, _) in code_only.match_indices(macro_call) {
            let rest = &code_only[at + macro_call.len()..];
            if let Some(name) = literals(rest).first() {
                names.insert((*name).to_owned());
            }
        }
    }
    let mut labels = BTreeSet::new();
    for (at, _) in code_only.match_indices("metrics::Label::new(") {
        let rest = &code_only[at + "metrics::Label::new(".len()..];
        if rest.starts_with('"') {
            labels.insert(literals(rest)[0].to_owned());
        }
    }
    // `"backend" => backend` in the renewal counter.
    for (at, _) in code_only.match_indices("\" =>") {
        let start = code_only[..at].rfind('"').unwrap();
        labels.insert(code_only[start + 1..at].to_owned());
    }
    let names_fn = code_only
        .split_once("fn name(self)")
        .expect("meter.rs has CallOutcome::name")
        .1;
    let names_fn = &names_fn[..names_fn.find("\n    }").unwrap()];
    let outcomes = literals(names_fn).into_iter().map(str::to_owned).collect();
    (names, labels, outcomes)
}

/// The `kind` label's values: every `meter::Kind::named("…")` in dblock/src (each kind names
/// its own label in its file).
fn metric_kinds() -> BTreeSet<String> {
    let mut kinds = BTreeSet::new();
    for file in rust_sources(&package().join("src")) {
        let source = read(&file);
        for (at, _) in source.match_indices("Kind::named(\"") {
            let rest = &source[at + "Kind::named(\"".len()..];
            kinds.insert(rest[..rest.find('"').unwrap()].to_owned());
        }
    }
    kinds
}

fn rust_sources(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).expect("a source directory") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            files.extend(rust_sources(&path));
        } else if path.extension().is_some_and(|x| x == "rs") {
            files.push(path);
        }
    }
    files.sort();
    files
}

#[test]
fn the_metrics_table_names_every_metric_and_label() {
    let (names, labels, outcomes) = meter();
    assert!(names.contains("dblock_acquire_seconds"), "{names:?}");
    let docs = section(&document("docs/production.md"), "## Metrics");
    let listed = sorted(first_column(&docs).iter().filter_map(|c| code(c)));
    assert_same(
        "metrics",
        &names,
        &listed,
        "docs/production.md, \"## Metrics\"",
    );
    let spans = sorted(code_spans(&docs));
    let kinds = metric_kinds();
    assert!(
        ["lock", "read", "permit", "leader"]
            .iter()
            .all(|k| kinds.contains(*k)),
        "{kinds:?}"
    );
    for value in labels.iter().chain(&outcomes).chain(&kinds) {
        assert!(
            spans.contains(value),
            "docs/production.md, \"## Metrics\" does not name the label or value `{value}`"
        );
    }
}

/// The names of the spans dblock/src opens (`tracing::debug_span!("dblock.lock", ...)`).
fn span_names() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for path in rust_sources(&package().join("src")) {
        let source = read(&path);
        for (at, _) in source.match_indices("_span!(") {
            if let Some(name) = literals(&source[at..]).first() {
                if name.starts_with("dblock.") {
                    names.insert((*name).to_owned());
                }
            }
        }
    }
    names
}

#[test]
fn the_tracing_table_names_every_span() {
    let names = span_names();
    assert!(names.contains("dblock.lock"), "{names:?}");
    let docs = section(&document("docs/production.md"), "## Tracing");
    let listed = sorted(first_column(&docs).iter().map(|c| {
        // `dblock.campaign` (`info`)
        c.split('`').nth(1).unwrap_or_default().to_owned()
    }));
    assert_same(
        "spans",
        &names,
        &listed,
        "docs/production.md, \"## Tracing\"",
    );
}

// ---------------------------------------------------------------------------------------------
// Snippets and links

/// Every opening code fence of `text` with its info string.
fn fences(text: &str) -> Vec<(usize, String)> {
    let mut in_code = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if let Some(info) = line.trim_start().strip_prefix("```") {
            if !in_code {
                out.push((i + 1, info.trim().to_owned()));
            }
            in_code = !in_code;
        }
    }
    out
}

#[test]
fn every_code_block_is_tagged_and_every_chapter_with_rust_is_a_doctest() {
    let lib = read(&package().join("src/lib.rs"));
    let rust = ["rust", "rust,no_run"];
    let other = ["toml", "sh", "text", "sql", "json"];
    for (name, text) in documents() {
        let mut has_rust = false;
        for (line, info) in fences(&text) {
            assert!(
                rust.contains(&info.as_str()) || other.contains(&info.as_str()),
                "{name}:{line}: a code block tagged {info:?}: tag Rust `rust` (or `rust,no_run`) \
                 so that it is compiled, anything else with its language (one of {other:?}), \
                 never nothing, which rustdoc compiles as Rust"
            );
            has_rust |= rust.contains(&info.as_str());
        }
        let include = format!("include_str!(\"../../{name}\")");
        if has_rust {
            assert!(
                lib.contains(&include),
                "{name} has Rust snippets but is not compiled: add `#[doc = {include}]` to \
                 `doc_snippets` in dblock/src/lib.rs"
            );
        }
    }
}

/// GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    prose(text)
        .into_iter()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|l| anchor(l.trim_start_matches('#')))
        .collect()
}

/// Files other changes add; a link to one may dangle until they land, and is checked like any
/// other once the file is there.
const ADDED_ELSEWHERE: [&str; 1] = ["docs/cli.md"];

#[test]
fn every_relative_link_resolves() {
    let root = root();
    for (name, text) in documents() {
        let dir = Path::new(&name).parent().unwrap().to_path_buf();
        for line in prose(&text) {
            for (at, _) in line.match_indices("](") {
                let rest = &line[at + 2..];
                let Some(end) = rest.find(')') else { continue };
                let target = &rest[..end];
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (file, fragment) = target.split_once('#').unwrap_or((target, ""));
                let path = if file.is_empty() {
                    PathBuf::from(&name)
                } else {
                    normalize(&dir.join(file))
                };
                let shown = path.to_string_lossy().replace('\\', "/");
                if !root.join(&path).exists() {
                    assert!(
                        ADDED_ELSEWHERE.contains(&shown.as_str()),
                        "{name}: the link `{target}` points to {shown}, which does not exist"
                    );
                    continue;
                }
                if !fragment.is_empty() && shown.ends_with(".md") {
                    assert!(
                        anchors(&read(&root.join(&path))).contains(fragment),
                        "{name}: the link `{target}`: {shown} has no heading `#{fragment}`"
                    );
                }
            }
        }
    }
}

/// `docs/../README.md` as `README.md`.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The README's shape

/// The first code block tagged `info` in `text`.
fn first_block(text: &str, info: &str) -> Option<String> {
    let mut lines = text
        .lines()
        .skip_while(|l| l.trim() != format!("```{info}"));
    lines.next()?;
    Some(
        lines
            .take_while(|l| l.trim() != "```")
            .collect::<Vec<_>>()
            .join("\n"),
    )
}

#[test]
fn the_readme_is_a_short_guide_with_the_blocks_ci_runs() {
    let readme = document("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= 300,
        "README.md has {lines} lines; the guide keeps to 300, the depth goes to docs/"
    );
    // SPEC §7: the links into docs/ it names, and the benchmark's one command.
    for chapter in [
        "guarantees",
        "production",
        "coalescing",
        "benchmarks",
        "testing",
        "cli",
    ] {
        let link = format!("](docs/{chapter}.md)");
        assert!(
            readme.contains(&link),
            "README.md links no docs/{chapter}.md"
        );
    }
    assert!(
        readme.contains("`cargo bench -p dblock-bench`"),
        "README.md names no benchmark command"
    );

    // CI runs the first `sh` block under "## Try it", line by line (comments stripped): the
    // example first, then the tests (under cargo-nextest), then the doc examples (which nextest
    // does not run).
    let try_it = first_block(&section(&readme, "## Try it"), "sh").expect("a sh block in Try it");
    let commands: Vec<&str> = try_it
        .lines()
        .map(|l| l.split(" #").next().unwrap().trim())
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(
        commands,
        [
            "cargo run --example settle_orders",
            "cargo nextest run --workspace --all-features",
            "cargo test --doc --workspace --all-features"
        ]
    );

    // CI builds a new crate from the quick start's first `toml` and first `rust` blocks.
    let quick = section(&readme, "## Quick start");
    let manifest = first_block(&quick, "toml").expect("a toml block in Quick start");
    let version = read(&root().join("Cargo.toml"))
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .map(|v| v.trim_end_matches('"').to_owned())
        .expect("a workspace version");
    let major_minor = version.rsplit_once('.').unwrap().0;
    assert!(manifest.starts_with("[dependencies]"), "{manifest}");
    assert!(
        manifest.contains(&format!("dblock = \"{major_minor}\"")),
        "the quick start depends on dblock {major_minor}: {manifest}"
    );
    assert!(manifest.contains("tokio = "), "{manifest}");
    let main = first_block(&quick, "rust").expect("a rust block in Quick start");
    assert!(
        main.contains("#[tokio::main]") && main.contains("async fn main()"),
        "the quick start's first Rust block is a whole src/main.rs"
    );
    assert!(
        main.contains("sqlite"),
        "the quick start runs on the default features: SQLite"
    );

    // The minimum Rust version the README states is the one Cargo.toml declares.
    let msrv = read(&root().join("Cargo.toml"))
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = \""))
        .map(|v| v.trim_end_matches('"').to_owned())
        .expect("a rust-version");
    assert!(
        readme.contains(&format!("Minimum supported Rust version: {msrv}.")),
        "README.md does not state the MSRV {msrv}"
    );
}
