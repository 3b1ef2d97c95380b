//! Compile-time behaviour of `#[distributed_lock]`: every error of SPEC section 2 with its message
//! and span (`tests/ui/fail/*.stderr`), and every accepted shape (`tests/ui/pass`).
//! Snapshots are made with the toolchain pinned in rust-toolchain.toml; refresh them with
//! `TRYBUILD=overwrite cargo test -p dblock-macros --test macro_ui`. The cases are built
//! against `dblock` with its default features (SQLite and the macro), as most users build it:
//! a test of the `dblock-macros` package, whose dev-dependency on `dblock` says so (a test of
//! `dblock` itself would build them with every feature the suite enables, in a second cold
//! build of all three drivers).

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("../tests/ui/fail/*.rs");
    t.pass("../tests/ui/pass/*.rs");
}
