//! Collects every error of one expansion, so the user sees them all in one build.

#[derive(Default)]
pub(crate) struct Errors(Option<syn::Error>);

impl Errors {
    pub(crate) fn push(&mut self, e: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(e),
            None => self.0 = Some(e),
        }
    }

    pub(crate) fn into_compile_errors(self) -> Option<proc_macro2::TokenStream> {
        self.0.map(|e| e.to_compile_error())
    }
}
