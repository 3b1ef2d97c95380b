//! The `#[distributed_lock]` attribute of [dblock](https://docs.rs/dblock).
//!
//! Use it through the runtime crate, as `dblock::distributed_lock`; its documentation is there.
//! This crate only rewrites the function (parse → validate, all errors at once → expand); every
//! behaviour lives in the runtime's `__private::locked`, where it is tested against databases.

use proc_macro::TokenStream;

mod attr;
mod duration;
mod errors;
mod expand;
mod item;
mod template;

/// Runs an `async fn` while holding a distributed lock. Documented in the `dblock` crate.
#[proc_macro_attribute]
pub fn distributed_lock(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::expand(args.into(), item.into()).into()
}
