//! The `#[distributed_lock]` attribute of [dblock](https://docs.rs/dblock).
//!
//! Use it through the `dblock` crate (`dblock::distributed_lock`); this crate only
//! rewrites the function, all behaviour lives in the runtime.

use proc_macro::TokenStream;

/// Placeholder until the attribute lands: emits the item unchanged with an error.
#[proc_macro_attribute]
pub fn distributed_lock(_args: TokenStream, item: TokenStream) -> TokenStream {
    let mut out: TokenStream = "compile_error!(\"#[distributed_lock] is not implemented yet\");"
        .parse()
        .unwrap_or_default();
    out.extend(item);
    out
}
