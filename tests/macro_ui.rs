//! Compile-time behaviour of `#[distributed_lock]`: every error of SPEC section 2 with its message
//! and span (`tests/ui/fail/*.stderr`), and every accepted shape (`tests/ui/pass`).
//! Snapshots are made with the toolchain pinned in rust-toolchain.toml; refresh them with
//! `TRYBUILD=overwrite cargo test --all-features --test macro_ui`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("../tests/ui/fail/*.rs");
    t.pass("../tests/ui/pass/*.rs");
}
