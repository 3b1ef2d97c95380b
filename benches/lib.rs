//! Nothing here: dblock's benchmark is `lock_cycle.rs`, run with `cargo bench -p dblock-bench`.
