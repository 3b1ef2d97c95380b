//! Code generation: only the body changes; the signature is emitted as written.
//!
//! Input:
//! ```text
//! #[distributed_lock(key = "order:{id}", ttl = "30s")]
//! async fn settle(id: u64) -> Result<Receipt, AppError> { body }
//! ```
//! Output:
//! ```text
//! async fn settle(id: u64) -> Result<Receipt, AppError> {
//!     let key = format!("order:{}", key_part(&id));          // on entry, before any .await
//!     let locker = default_locker();                          // or the `locker = ...` expression
//!     let request = request(locker, key, "module::settle").map(|r| r.ttl(..).wait(..));
//!     ::dblock::__private::locked(request, renew, "module::settle", on_error,
//!                                 async move { body }).await
//! }
//! ```

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::{FnArg, Ident, LitStr, Pat, ReturnType, Signature, Type};

use crate::attr::{self, Args, Dur, Key, Kind};
use crate::errors::Errors;
use crate::item::LockedFn;
use crate::template::{self, Piece};

pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut errors = Errors::default();
    let args = attr::parse(args, &mut errors);
    let func: LockedFn = match syn::parse2(item.clone()) {
        Ok(f) => f,
        Err(_) => {
            let span = item
                .clone()
                .into_iter()
                .next()
                .map_or_else(Span::call_site, |t| t.span());
            errors.push(syn::Error::new(
                span,
                "#[distributed_lock] only applies to `async fn` items (with a body)",
            ));
            let errors = errors.into_compile_errors();
            return quote! { #errors #item };
        }
    };

    check_signature(&func, &mut errors);
    let params = parameter_names(&func);
    if let Some(proof) = &args.proof {
        let name = proof.name.unraw_string();
        if params.contains(&name) {
            errors.push(syn::Error::new(
                proof.name.span(),
                format!(
                    "`proof = {name}` cannot apply: `{name}` is already a parameter of `{}`, and the proof would hide it; name the proof something else, like `proof = {name}_held`",
                    func.sig.ident
                ),
            ));
        }
    }
    if let Kind::InTx(tx) = &args.kind {
        let name = tx.unraw_string();
        if !params.contains(&name) {
            errors.push(syn::Error::new(
                tx.span(),
                format!(
                    "`tx = {name}` names no parameter of `{}`; name the body's transaction parameter, like `tx: &mut sqlx::Transaction<'_, sqlx::Postgres>`",
                    func.sig.ident
                ),
            ));
        }
    }
    let key = match &args.key {
        None if args.unparsed => None,
        None => {
            errors.push(syn::Error::new(
                Span::call_site(),
                "missing `key`: write #[distributed_lock(key = \"order:{order_id}\")]",
            ));
            None
        }
        Some(Key::List(keys, span)) if keys.is_empty() => {
            errors.push(syn::Error::new(
                *span,
                "the key list is empty; write at least one key, like `key = [\"acct:{from}\", \"acct:{to}\"]`",
            ));
            None
        }
        Some(Key::List(keys, _)) => {
            let built: Vec<Option<TokenStream>> = keys
                .iter()
                .map(|k| one_key(k, &params, &args, &mut errors))
                .collect();
            built
                .into_iter()
                .collect::<Option<Vec<_>>>()
                .map(|keys| quote! { ::std::vec![#(#keys),*] })
        }
        Some(k) => one_key(k, &params, &args, &mut errors).map(|k| quote! { ::std::vec![#k] }),
    };

    match (errors.into_compile_errors(), key) {
        (None, Some(key)) => rewrite(func, &args, key),
        (errors, _) => {
            let as_written = as_written(func, &args);
            quote! { #errors #as_written }
        }
    }
}

/// The function as written (the IDE keeps working) when the attribute has errors, with its
/// return type checked against the rule all the same, so that error comes in the same build.
fn as_written(func: LockedFn, args: &Args) -> TokenStream {
    let LockedFn {
        attrs,
        vis,
        sig,
        inner_attrs,
        body,
    } = func;
    let check = named_return(&sig, &krate(args)).map(|(_, check)| quote! { let _ = #check; });
    quote! {
        #(#attrs)*
        #vis #sig {
            #(#inner_attrs)*
            #check
            #body
        }
    }
}

/// A key as its template reads (a list: its templates joined by ", "; an expression: its
/// source), for the metrics' `key` label.
fn key_template(key: &Key) -> String {
    match key {
        Key::Template(lit) => lit.value(),
        Key::Expr(e) => e.to_token_stream().to_string(),
        Key::List(keys, _) => keys.iter().map(key_template).collect::<Vec<_>>().join(", "),
    }
}

/// One key's `String`-building code (a template, or an expression formatted with `Display`).
fn one_key(key: &Key, params: &[String], args: &Args, errors: &mut Errors) -> Option<TokenStream> {
    match key {
        Key::Template(lit) => key_from_template(lit, params, args, errors),
        Key::Expr(e) => {
            let krate = krate(args);
            Some(quote_spanned! {e.span()=> #krate::__private::key_string(&(#e)) })
        }
        Key::List(_, span) => {
            errors.push(syn::Error::new(
                *span,
                "a key list cannot hold another list",
            ));
            None
        }
    }
}

fn krate(args: &Args) -> TokenStream {
    args.krate
        .as_ref()
        .map_or_else(|| quote!(::dblock), ToTokens::to_token_stream)
}

fn check_signature(func: &LockedFn, errors: &mut Errors) {
    let sig = &func.sig;
    if let Some(c) = &sig.constness {
        errors.push(syn::Error::new(
            c.span,
            "#[distributed_lock] cannot be used on a `const fn`",
        ));
    }
    if let Some(abi) = &sig.abi {
        errors.push(syn::Error::new(
            abi.extern_token.span,
            "#[distributed_lock] cannot be used on an `extern` fn",
        ));
    }
    if sig.asyncness.is_none() {
        errors.push(syn::Error::new(
            sig.fn_token.span,
            "#[distributed_lock] requires an `async fn`: the lock is taken with `.await`",
        ));
    }
    if let ReturnType::Default = sig.output {
        errors.push(syn::Error::new(
            sig.paren_token.span.close(),
            "a #[distributed_lock] function must return `Result<T, E>` where `E: From<dblock::LockError>` \
             (so a busy lock can be returned as an error); add `-> Result<(), YourError>`",
        ));
    }
}

/// The names a template may use: `self` (with a receiver) and every binding in the patterns.
fn parameter_names(func: &LockedFn) -> Vec<String> {
    let mut names = Vec::new();
    for input in &func.sig.inputs {
        match input {
            FnArg::Receiver(_) => names.push("self".to_owned()),
            FnArg::Typed(t) => bindings(&t.pat, &mut names),
        }
    }
    names
}

fn bindings(pat: &Pat, out: &mut Vec<String>) {
    match pat {
        Pat::Ident(p) => {
            out.push(p.ident.unraw_string());
            if let Some((_, sub)) = &p.subpat {
                bindings(sub, out);
            }
        }
        Pat::Reference(p) => bindings(&p.pat, out),
        Pat::Tuple(p) => p.elems.iter().for_each(|p| bindings(p, out)),
        Pat::TupleStruct(p) => p.elems.iter().for_each(|p| bindings(p, out)),
        Pat::Struct(p) => p.fields.iter().for_each(|f| bindings(&f.pat, out)),
        Pat::Slice(p) => p.elems.iter().for_each(|p| bindings(p, out)),
        Pat::Type(p) => bindings(&p.pat, out),
        Pat::Paren(p) => bindings(&p.pat, out),
        // Shapes that bind nothing (or that rustc will reject with a better message).
        _ => {}
    }
}

trait UnrawString {
    fn unraw_string(&self) -> String;
}

impl UnrawString for Ident {
    fn unraw_string(&self) -> String {
        let s = self.to_string();
        s.strip_prefix("r#").map_or(s.clone(), str::to_owned)
    }
}

/// The end of every key-template error: the parameters a template can name.
fn parameters(params: &[String]) -> String {
    if params.is_empty() {
        return "this function has no parameters".to_owned();
    }
    let list = params
        .iter()
        .map(|p| match crate::template::is_keyword(p) && p != "self" {
            true => format!("`r#{p}`"),
            false => format!("`{p}`"),
        })
        .collect::<Vec<_>>()
        .join(", ");
    format!("parameters are: {list}")
}

/// `"order:{id}"` → `format!("order:{}", key_part(&id))`, every generated token spanned at the
/// literal, so a missing `Display` or unknown field underlines the string the user wrote.
fn key_from_template(
    lit: &LitStr,
    params: &[String],
    args: &Args,
    errors: &mut Errors,
) -> Option<TokenStream> {
    let span = lit.span();
    let pieces = match template::parse(&lit.value()) {
        Ok(p) => p,
        Err(msg) => {
            errors.push(syn::Error::new(
                span,
                format!("{msg}; {}", parameters(params)),
            ));
            return None;
        }
    };
    if pieces.is_empty() {
        errors.push(syn::Error::new(
            span,
            "the key template is empty; a lock key needs at least one character",
        ));
        return None;
    }
    let krate = krate(args);
    let mut format = String::new();
    let mut values = Vec::new();
    let mut ok = true;
    for piece in &pieces {
        match piece {
            Piece::Text(t) => format.push_str(&t.replace('{', "{{").replace('}', "}}")),
            Piece::Path(path) => {
                let root = path[0].strip_prefix("r#").unwrap_or(&path[0]);
                if !params.iter().any(|p| p == root) {
                    ok = false;
                    let msg = if root == "self" {
                        format!(
                            "`{{self...}}` in the key template, but this function has no `self` parameter (it is not a method); {}",
                            parameters(params)
                        )
                    } else {
                        format!(
                            "unknown parameter `{root}` in the key template; {}",
                            parameters(params)
                        )
                    };
                    errors.push(syn::Error::new(span, msg));
                    continue;
                }
                format.push_str("{}");
                let root_tokens = if root == "self" {
                    quote_spanned!(span=> self)
                } else {
                    ident(&path[0], span).into_token_stream()
                };
                let fields = path[1..].iter().map(|seg| match seg.parse::<u32>() {
                    Ok(index) => syn::Index { index, span }.into_token_stream(),
                    Err(_) => ident(seg, span).into_token_stream(),
                });
                values.push(quote_spanned! {span=> #krate::__private::key_part(&#root_tokens #(.#fields)*) });
            }
        }
    }
    if !ok {
        return None;
    }
    Some(if values.is_empty() {
        // No value: the text as it reads, its `{{`/`}}` single braces (not `format!`'s escapes).
        let text: String = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Text(t) => Some(t.as_str()),
                Piece::Path(_) => None,
            })
            .collect();
        quote_spanned! {span=> ::std::string::String::from(#text) }
    } else {
        let format = LitStr::new(&format, span);
        quote_spanned! {span=> ::std::format!(#format, #(#values),*) }
    })
}

/// An identifier from a template segment, raw (`r#type`) when written so.
fn ident(segment: &str, span: Span) -> Ident {
    match segment.strip_prefix("r#") {
        Some(raw) => Ident::new_raw(raw, span),
        None => Ident::new(segment, span),
    }
}

fn duration_tokens(d: &Dur) -> TokenStream {
    match d {
        Dur::Lit(d, span) => {
            let (secs, nanos) = (d.as_secs(), d.subsec_nanos());
            quote_spanned! {*span=> ::core::time::Duration::new(#secs, #nanos) }
        }
        Dur::Expr(e) => {
            let d = Ident::new("__dblock_duration", Span::mixed_site());
            quote_spanned! {e.span()=> { let #d: ::core::time::Duration = #e; #d } }
        }
    }
}

/// The declared return type, when the rule `Result<T, E: From<LockError>>` can be checked
/// against it by name, and that check: `must_return_result::<R>()`, spanned at the type so the
/// error points there. `None` without a type, or with `impl Trait` in it (a turbofish cannot
/// name one; the rule is then checked on the type the body infers).
fn named_return<'s>(sig: &'s Signature, krate: &TokenStream) -> Option<(&'s Type, TokenStream)> {
    match &sig.output {
        ReturnType::Type(_, ty) if !contains_impl_trait(ty) => Some((
            ty,
            quote_spanned! {ty.span()=> #krate::__private::must_return_result::<#ty>() },
        )),
        _ => None,
    }
}

fn contains_impl_trait(ty: &Type) -> bool {
    fn any_impl(tokens: TokenStream) -> bool {
        tokens.into_iter().any(|t| match t {
            proc_macro2::TokenTree::Ident(i) => i == "impl",
            // Inside parentheses, brackets and braces too: `Result<(impl Display, u8), E>`.
            proc_macro2::TokenTree::Group(g) => any_impl(g.stream()),
            _ => false,
        })
    }
    any_impl(ty.to_token_stream())
}

fn rewrite(func: LockedFn, args: &Args, key: TokenStream) -> TokenStream {
    let LockedFn {
        attrs,
        vis,
        sig,
        inner_attrs,
        body,
    } = func;
    let krate = krate(args);
    // Generated locals: mixed-site hygiene, so the body cannot name (or shadow) them.
    let key_var = Ident::new("__dblock_key", Span::mixed_site());
    let locker_var = Ident::new("__dblock_locker", Span::mixed_site());
    let ret_var = Ident::new("__dblock_ret", Span::mixed_site());

    let builder = Ident::new("__dblock_builder", Span::mixed_site());
    // Options the builder only gets when the attribute names them: otherwise the runtime's own
    // defaults hold (`dblock::DEFAULT_TTL`, no wait), never a copy of them here. Each value is
    // worked out in the function itself (`values`), where an expression may `.await` or use
    // `?`, in the order written here; the builder's closure only passes them on.
    let mut values = TokenStream::new();
    let mut option = |value: Option<TokenStream>, name: &str, switch: bool| {
        let value = value?;
        let var = Ident::new(&format!("__dblock_{name}"), Span::mixed_site());
        let setter = Ident::new(name, Span::call_site());
        values.extend(quote! { let #var = #value; });
        Some(match switch {
            true => quote! { let #builder = if #var { #builder.#setter() } else { #builder }; },
            false => quote! { let #builder = #builder.#setter(#var); },
        })
    };
    let duration = |d: &Option<Dur>| d.as_ref().map(duration_tokens);
    let flag = |e: &Option<syn::Expr>| {
        e.as_ref().map(|e| {
            let f = Ident::new("__dblock_flag", Span::mixed_site());
            quote_spanned! {e.span()=> { let #f: bool = #e; #f } }
        })
    };
    let ttl = option(duration(&args.ttl), "ttl", false);
    let wait = option(duration(&args.wait), "wait", false);
    let min_hold = option(duration(&args.min_hold), "min_hold", false);
    let max_hold = option(duration(&args.max_hold), "max_hold", false);
    let lock_delay = option(duration(&args.lock_delay), "lock_delay", false);
    let once = option(flag(&args.once), "once", true);
    let fair = option(flag(&args.fair), "fair", true);
    let reentrant = option(flag(&args.reentrant), "reentrant", false);
    let renew = match &args.renew {
        None => quote!(true),
        Some(e) => {
            let r = Ident::new("__dblock_renew", Span::mixed_site());
            quote_spanned! {e.span()=> { let #r: bool = #e; #r } }
        }
    };
    let locker = match &args.locker {
        None => quote!(#krate::__private::default_locker()),
        Some(e) => {
            quote_spanned! {e.span()=> ::core::result::Result::Ok(#krate::__private::to_locker(&(#e))) }
        }
    };
    let function = sig.ident.unraw_string();
    // The metrics' `key` label: the template as written (never the key it builds).
    let template = args.key.as_ref().map(key_template).unwrap_or_default();

    // The declared return type, tied to the body (a "fake return edge") and checked against the
    // rule `Result<T, E: From<LockError>>` with the error spanned at the return type.
    let on_error = Ident::new("__dblock_on_error", Span::mixed_site());
    let (return_check, return_edge) = match named_return(&sig, &krate) {
        Some((ty, check)) => (
            quote! { let #on_error = #check; },
            quote! {
                #[allow(unreachable_code, clippy::diverging_sub_expression)]
                if false {
                    let #ret_var: #ty = loop {};
                    return #ret_var;
                }
            },
        ),
        // Checked on the type the body infers: spanned at the declared type when there is one
        // (`impl Trait` in it), so the error still points there.
        _ => {
            let check = match &sig.output {
                ReturnType::Type(_, ty) => {
                    quote_spanned! {ty.span()=> #krate::__private::must_return_result::<_>() }
                }
                ReturnType::Default => quote! { #krate::__private::must_return_result() },
            };
            (quote! { let #on_error = #check; }, TokenStream::new())
        }
    };

    // The lock (one key or a list), or a permit of a semaphore (`permits = N`).
    let take = match &args.kind {
        Kind::Read(_) => quote!(#krate::__private::read),
        Kind::Lock | Kind::InTx(_) => quote!(#krate::__private::request),
        Kind::Permit(n) => {
            let p = Ident::new("__dblock_permits", Span::mixed_site());
            quote_spanned! {n.span()=> {
                let #p: u32 = #n;
                move |locker, keys, function| #krate::__private::semaphore(locker, keys, #p, function)
            }}
        }
    };
    // `proof = held`: a local the proof borrows, so it cannot leave this function.
    let (proof_scope, proof_arg, proof_binding) = match &args.proof {
        None => (
            TokenStream::new(),
            quote!(::core::option::Option::None),
            TokenStream::new(),
        ),
        Some(attr::Proof { name, marker }) => {
            let scope = Ident::new("__dblock_proof_scope", Span::mixed_site());
            // The body's own local, named as the proof: a proof that escapes the body is
            // reported as borrowing it.
            let local = Ident::new(
                &name.unraw_string(),
                Span::mixed_site().located_at(name.span()),
            );
            let marker = marker
                .as_ref()
                .map_or_else(|| quote!(#krate::AnyLock), ToTokens::to_token_stream);
            let mode = match &args.kind {
                Kind::Lock | Kind::InTx(_) => quote!(#krate::mode::Exclusive),
                Kind::Read(_) => quote!(#krate::mode::Shared),
                Kind::Permit(_) => quote!(#krate::mode::Permit),
            };
            (
                quote! { let #scope = #krate::__private::ProofScope::new(); },
                quote!(::core::option::Option::Some(::core::clone::Clone::clone(&#scope))),
                quote_spanned! {name.span()=>
                    let #local = #scope;
                    let #name: #krate::Held<'_, #marker, #mode> = #local.held();
                },
            )
        }
    };
    let request_var = Ident::new("__dblock_request", Span::mixed_site());
    if let Kind::InTx(tx) = &args.kind {
        // The key is taken on the transaction first (a reborrow that ends there), then the body
        // runs with the parameter as written.
        let taken_var = Ident::new("__dblock_taken", Span::mixed_site());
        let tx_conn = quote_spanned! {tx.span()=> #krate::__private::tx_conn(&mut *#tx) };
        return quote! {
            #(#attrs)*
            #vis #sig {
                #(#inner_attrs)*
                #return_check
                #proof_scope
                let #key_var: ::std::vec::Vec<::std::string::String> = #key;
                let #locker_var = #locker;
                #values
                let #request_var = #krate::__private::request_in(
                    #locker_var,
                    #key_var,
                    ::core::concat!(::core::module_path!(), "::", #function),
                )
                .map(|#builder| {
                    #wait
                    #builder
                });
                let #taken_var = #krate::__private::take_in(#request_var, #tx_conn).await;
                #krate::__private::locked_in(
                    #taken_var,
                    #on_error,
                    #proof_arg,
                    async move {
                        #proof_binding
                        #return_edge
                        #body
                    },
                )
                .await
            }
        };
    }
    quote! {
        #(#attrs)*
        #vis #sig {
            #(#inner_attrs)*
            #return_check
            #proof_scope
            let #key_var: ::std::vec::Vec<::std::string::String> = #key;
            let #locker_var = #locker;
            #values
            let #request_var = #take(
                #locker_var,
                #key_var,
                ::core::concat!(::core::module_path!(), "::", #function),
            )
            .map(|#builder| {
                let #builder = #builder.metrics_key(#template);
                #ttl
                #wait
                #min_hold
                #max_hold
                #lock_delay
                #once
                #fair
                #reentrant
                #builder
            });
            #krate::__private::locked(
                #request_var,
                #renew,
                ::core::concat!(::core::module_path!(), "::", #function),
                #on_error,
                #proof_arg,
                // The body's own tokens, not wrapped in a block of their own: `{ Ok(x) }` must
                // not become `{ { Ok(x) } }` (rustc's `unused_braces`, with a fix that breaks).
                async move {
                    #proof_binding
                    #return_edge
                    #body
                },
            )
            .await
        }
    }
}
