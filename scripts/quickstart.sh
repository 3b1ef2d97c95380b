#!/usr/bin/env bash
# The README's quick start, built and run as a newcomer would, against the packaged crates (what
# crates.io would serve), not the workspace: a file missing from the `dblock` package, or a quick
# start that no longer compiles or runs, fails here.
#
# Needs `cargo package` to have run (<target dir>/package/dblock-<version>.crate and
# dblock-macros-<version>.crate). Takes the first ```toml block (the [dependencies] a newcomer
# pastes) and the first ```rust block (the whole src/main.rs) under "## Quick start" in README.md,
# builds them as a crate of their own in a temporary directory, with the packaged dblock and
# dblock-macros patched in for crates.io's, and runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
readme=${QUICKSTART_README:-README.md}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Where `cargo package` wrote them: the target directory, which CARGO_TARGET_DIR may move.
target=${CARGO_TARGET_DIR:-target}
for crate in dblock dblock-macros; do
    file="$target/package/$crate-$version.crate"
    [ -f "$file" ] || { echo "no $file: run cargo package first" >&2; exit 1; }
    tar -xzf "$file" -C "$work"
done

block() { # block <language>: the first fenced block of that language under "## Quick start"
    awk -v lang="$1" '
        /^## / { section = ($0 == "## Quick start") }
        section && !inside && $0 == "```" lang { inside = 1; next }
        inside && /^```/ { exit }
        inside { print }
    ' "$readme"
}
deps=$(block toml)
main=$(block rust)
if ! grep -q '^\[dependencies\]' <<<"$deps" || ! grep -q 'fn main' <<<"$main"; then
    echo "$readme: no [dependencies] toml block and main.rs rust block under '## Quick start'" >&2
    exit 1
fi

mkdir -p "$work/quickstart/src"
printf '%s\n' "$main" >"$work/quickstart/src/main.rs"
cat >"$work/quickstart/Cargo.toml" <<TOML
[package]
name = "quickstart"
version = "0.0.0"
edition = "2021"
publish = false

[workspace]

$deps

[patch.crates-io]
dblock = { path = "../dblock-$version" }
dblock-macros = { path = "../dblock-macros-$version" }
TOML
echo "quick start: $(grep -c '' "$work/quickstart/src/main.rs") lines of main.rs, dependencies:"
sed -n '/^\[dependencies\]/,/^$/p' "$work/quickstart/Cargo.toml"
cd "$work/quickstart"
CARGO_TARGET_DIR="$root/target/quickstart" cargo run --quiet
