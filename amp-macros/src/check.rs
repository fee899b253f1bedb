//! Rules on where each attribute belongs and which ones can go together, and the error context that
//! collects every mistake so one compile reports all of them (serde's `Ctxt`).

use std::collections::BTreeSet;
use std::fmt::Display;

use proc_macro2::{TokenStream, TokenTree};
use quote::ToTokens;

use crate::ast::{Field, Input};
use crate::attr::Attrs;

/// Collects errors; [`Ctxt::finish`] combines them into one `syn::Error`, in source order.
#[derive(Debug, Default)]
#[must_use = "call `finish` to report the collected errors"]
pub struct Ctxt {
    /// Where errors are being recorded: 0 for the struct, `i + 1` for field `i`.
    site: usize,
    errors: Vec<(usize, syn::Error)>,
}

impl Ctxt {
    /// An empty context.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records the following errors against the struct itself.
    pub fn at_struct(&mut self) {
        self.site = 0;
    }

    /// Records the following errors against field `index`.
    pub fn at_field(&mut self, index: usize) {
        self.site = index + 1;
    }

    /// Records an error spanning the tokens of `tokens`.
    pub fn error_spanned_by(&mut self, tokens: impl ToTokens, message: impl Display) {
        self.syn_error(syn::Error::new_spanned(tokens.into_token_stream(), message));
    }

    /// Records an error from `syn`.
    pub fn syn_error(&mut self, error: syn::Error) {
        self.errors.push((self.site, error));
    }

    /// Every recorded error combined, or `Ok` when there were none. Errors of the struct come first,
    /// then each field's in declaration order, whichever phase found them.
    pub fn finish(mut self) -> syn::Result<()> {
        self.errors.sort_by_key(|(site, _)| *site);
        let combined = self.errors.into_iter().map(|(_, error)| error).reduce(|mut all, error| {
            all.combine(error);
            all
        });
        match combined {
            Some(errors) => Err(errors),
            None => Ok(()),
        }
    }
}

/// Checks the rules that span more than one attribute entry.
pub fn check(cx: &mut Ctxt, input: &Input<'_>) {
    cx.at_struct();
    check_struct_attrs(cx, &input.attrs);
    check_repr(cx, input);
    check_generic_params(cx, input.generics);
    let own_names: BTreeSet<String> = [input.ident.to_string(), "Self".to_string()].into();
    for (index, field) in input.fields.iter().enumerate() {
        cx.at_field(index);
        check_field_attrs(cx, field);
        if field.attrs.skip.is_none() && names_unqualified(field.ty.to_token_stream(), &own_names) {
            cx.error_spanned_by(
                field.ty,
                format!(
                    "`{}` holds a `{ident}` inside a `{ident}`: a module's precision plan is a constant built \
                     at compile time, which a recursive module cannot have; give the nested levels a type \
                     of their own (`struct Level {{ .. }}`, `Vec<Level>`), or mark the field \
                     `#[amp(skip)]` (its layers are then not part of the model)",
                    field.name,
                    ident = input.ident
                ),
            );
        }
    }
}

/// Whether `tokens` name one of `names` as a path of its own (`Tree`, `Box<Self>`, `self::Tree`: this
/// module's), not as the last segment of another path (`amp::nn::Linear` in a struct of the user's
/// also named `Linear`; `crate::Tree` may be another `Tree` than one in a module below the root).
fn names_unqualified(tokens: TokenStream, names: &BTreeSet<String>) -> bool {
    let tokens: Vec<TokenTree> = tokens.into_iter().collect();
    let colon = |i: usize| matches!(&tokens[i], TokenTree::Punct(p) if p.as_char() == ':');
    let ident = |i: usize, name: &str| matches!(&tokens[i], TokenTree::Ident(id) if id == name);
    // `self ::` right before `i`, itself at the start of a path.
    let after_self = |i: usize| {
        i >= 3 && colon(i - 1) && colon(i - 2) && ident(i - 3, "self") && (i == 3 || !colon(i - 4))
    };
    (0..tokens.len()).any(|i| match &tokens[i] {
        TokenTree::Ident(id) => names.contains(&id.to_string()) && (i == 0 || !colon(i - 1) || after_self(i)),
        TokenTree::Group(group) => names_unqualified(group.stream(), names),
        TokenTree::Punct(_) | TokenTree::Literal(_) => false,
    })
}

/// `#[amp(default = ...)]` is the only attribute of a struct.
fn check_struct_attrs(cx: &mut Ctxt, attrs: &Attrs) {
    if let Some(written) = &attrs.precision {
        let token = &written.token;
        cx.error_spanned_by(
            token,
            format!(
                "`#[amp({token})]` is not expected on the struct; a struct's precision is the default of \
                 its fields, so write `#[amp(default = {token})]`"
            ),
        );
    }
    if let Some(span) = attrs.skip {
        cx.syn_error(syn::Error::new(
            span,
            "`#[amp(skip)]` is not expected on the struct; it belongs on a field that holds no layers \
             (a dropout rate, a config); to leave this struct out of a model, put `#[amp(skip)]` on the \
             field that holds it",
        ));
    }
}

/// A packed struct's fields may be unaligned, and the derived `visit` borrows each of them.
fn check_repr(cx: &mut Ctxt, input: &Input<'_>) {
    if let Some(packed) = &input.packed {
        cx.error_spanned_by(
            packed,
            format!(
                "`#[derive(AmpModule)]` does not support `#[repr(packed)]`: amp visits each layer of `{}` \
                 through a reference, and a field of a packed struct may be unaligned, where a reference \
                 is undefined behaviour; remove `packed` (a layer holds its tensors behind pointers, so \
                 packing saves no memory)",
                input.ident
            ),
        );
    }
}

/// A field is skipped, or a module with at most one precision, and has no default of its own.
fn check_field_attrs(cx: &mut Ctxt, field: &Field<'_>) {
    let attrs = &field.attrs;
    if let Some(default) = &attrs.default {
        let token = &default.token;
        cx.error_spanned_by(
            token,
            format!(
                "`#[amp(default = {token})]` is not expected on a field; it belongs on the struct, where it \
                 sets the precision of fields without one of their own; on a field write `#[amp({token})]`"
            ),
        );
    }
    if let (Some(_), Some(written)) = (attrs.skip, &attrs.precision) {
        let token = &written.token;
        cx.error_spanned_by(
            token,
            format!(
                "`#[amp(skip)]` and `#[amp({token})]` contradict each other: a skipped field is not a module \
                 and has no precision; remove `#[amp({token})]` to skip the field, or `#[amp(skip)]` to \
                 compute it in {}",
                written.precision.name()
            ),
        );
    }
}

/// rustc rejects `#[amp]` on a generic parameter only as an unknown attribute, suggesting a missing
/// derive; this says where the attribute belongs.
fn check_generic_params(cx: &mut Ctxt, generics: &syn::Generics) {
    for param in &generics.params {
        let attrs = match param {
            syn::GenericParam::Type(param) => &param.attrs,
            syn::GenericParam::Lifetime(param) => &param.attrs,
            syn::GenericParam::Const(param) => &param.attrs,
        };
        for attr in attrs.iter().filter(|attr| attr.path() == &crate::symbol::AMP) {
            cx.error_spanned_by(
                attr,
                "`#[amp(...)]` is not expected on a generic parameter; put it on the field whose type uses \
                 the parameter",
            );
        }
    }
}
