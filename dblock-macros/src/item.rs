//! The annotated function, with its body kept as tokens.
//!
//! Only the signature is parsed. The body is not: a syntax error inside it is then reported by
//! rustc alone, where it is, instead of making the whole item unparsable and adding a misleading
//! "not an async fn" error. Inner attributes (`#![allow(..)]` as the body's first line) are kept
//! apart so they can be put back inside the function, where they belong.

use proc_macro2::TokenStream;
use syn::parse::{Parse, ParseStream};
use syn::{braced, Attribute, Signature, Visibility};

/// Input: `#[doc] pub async fn name(args) -> R where .. { #![inner] body }`.
pub(crate) struct LockedFn {
    pub(crate) attrs: Vec<Attribute>,
    pub(crate) vis: Visibility,
    pub(crate) sig: Signature,
    pub(crate) inner_attrs: Vec<Attribute>,
    /// The body's tokens, without its braces and inner attributes.
    pub(crate) body: TokenStream,
}

impl Parse for LockedFn {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let attrs = input.call(Attribute::parse_outer)?;
        let vis = input.parse()?;
        let sig = input.parse()?;
        let content;
        braced!(content in input);
        let inner_attrs = content.call(Attribute::parse_inner)?;
        let body = content.parse()?;
        Ok(LockedFn {
            attrs,
            vis,
            sig,
            inner_attrs,
            body,
        })
    }
}
