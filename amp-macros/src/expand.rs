//! The generated code: `AmpModule` and `HalfSafe` impls, the static plan, and spanned checks of the
//! field types. Every runtime item is named through `::amp::__private`.

use std::collections::BTreeSet;

use proc_macro2::{Ident, Span, TokenStream};
use quote::{quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::{DeriveInput, GenericParam, Generics};

use crate::ast::{Field, Input};
use crate::check::{self, Ctxt};
use crate::fallback;
use crate::symbol::Precision;

/// The derive: the impls, or on error the errors beside a stub impl.
pub fn derive(node: &DeriveInput) -> TokenStream {
    match try_expand(node) {
        Ok(expanded) => expanded,
        Err(error) => fallback::expand(node, &error),
    }
}

/// Parse, check, expand.
pub fn try_expand(node: &DeriveInput) -> syn::Result<TokenStream> {
    let mut cx = Ctxt::new();
    // An enum or union is refused before any attribute is read, so `cx` is empty on that path.
    let input = Input::from_syn(&mut cx, node)?;
    check::check(&mut cx, &input);
    cx.finish()?;
    Ok(expand(&input))
}

/// The runtime path every generated item goes through.
pub fn private() -> TokenStream {
    quote!(::amp::__private)
}

fn expand(input: &Input<'_>) -> TokenStream {
    let amp_module = impl_amp_module(input);
    let half_safe = impl_half_safe(input);
    let no_fp16 = impl_no_fp16_under(input);
    quote! {
        const _: () = {
            #amp_module
            #no_fp16
            #half_safe
        };
    }
}

fn impl_amp_module(input: &Input<'_>) -> TokenStream {
    let private = private();
    let ident = input.ident;
    let (impl_generics, ty_generics, _) = input.generics.split_for_impl();
    let where_clause = where_clause(input);
    let unlisted = unlisted(!where_clause.is_empty() || has_bounds(input.generics));
    let plan = plan(input);
    let visits: Vec<TokenStream> = input.modules().map(|field| visit_field(field, input, false)).collect();
    let visits_mut: Vec<TokenStream> = input.modules().map(|field| visit_field(field, input, true)).collect();
    let unused = visits.is_empty().then(|| quote!(let _ = (__amp_cursor, __amp_visitor);));
    let half_safe_checks = half_safe_checks(input);
    quote! {
        #[automatically_derived]
        #unlisted
        impl #impl_generics #private::AmpModule for #ident #ty_generics #where_clause {
            type Module = Self;
            const PLAN: #private::Plan = #plan;

            fn visit(
                &self,
                __amp_cursor: &mut #private::Cursor,
                __amp_visitor: &mut dyn #private::Visitor,
            ) {
                #half_safe_checks
                #unused
                #(#visits)*
            }

            fn visit_mut(
                &mut self,
                __amp_cursor: &mut #private::Cursor,
                __amp_visitor: &mut dyn #private::VisitorMut,
            ) {
                #unused
                #(#visits_mut)*
            }
        }
    }
}

/// The struct's where clause, plus a bound per module field whose type uses a generic parameter:
/// `AmpModule`, and `HalfSafe` where the field's own attribute asks for a half precision.
fn where_clause(input: &Input<'_>) -> TokenStream {
    let private = private();
    let written = input.generics.where_clause.iter().flat_map(|clause| clause.predicates.iter());
    let bounds = input.modules().filter(|field| field.is_generic).map(|field| {
        let ty = field.ty;
        let half_safe = field.asks_half().then(|| quote!(+ #private::HalfSafe));
        quote_spanned!(ty.span()=> #ty: #private::AmpModule #half_safe)
    });
    let predicates: Vec<TokenStream> = written.map(ToTokens::to_token_stream).chain(bounds).collect();
    if predicates.is_empty() {
        TokenStream::new()
    } else {
        quote!(where #(#predicates),*)
    }
}

/// `impl<R: Request> NoFp16Under<R>`: the struct is free of fixed fp16 under the request `R` when each
/// field is, under its own precision (attribute or struct default) or, without one, under `R`.
fn impl_no_fp16_under(input: &Input<'_>) -> TokenStream {
    let private = private();
    let ident = input.ident;
    let request = request_param(input.generics);
    let mut generics = input.generics.clone();
    generics.params.push(syn::parse_quote!(#request: #private::Request));
    let (impl_generics, _, _) = generics.split_for_impl();
    let (_, ty_generics, _) = input.generics.split_for_impl();
    let written = input.generics.where_clause.iter().flat_map(|clause| clause.predicates.iter());
    let bounds = input.modules().map(|field| {
        let ty = field.ty;
        let field_request = match field.own().or(input.default()) {
            None => quote!(#request),
            Some(Precision::Fp16 | Precision::Half) => {
                quote!(<#request as #private::Request>::Keep<#private::AskFp16>)
            }
            Some(Precision::Fp32 | Precision::Bf16) => {
                quote!(<#request as #private::Request>::Keep<#private::AskWide>)
            }
        };
        quote_spanned!(ty.span()=> #ty: #private::NoFp16Under<#field_request>)
    });
    let predicates: Vec<TokenStream> = written.map(ToTokens::to_token_stream).chain(bounds).collect();
    let where_clause = (!predicates.is_empty()).then(|| quote!(where #(#predicates),*));
    quote! {
        #[automatically_derived]
        impl #impl_generics #private::NoFp16Under<#request> for #ident #ty_generics #where_clause {}
    }
}

/// The type parameter the `NoFp16Under` impl adds for the request: `__AmpR`, with underscores appended
/// while the struct has a parameter of that name.
pub fn request_param(generics: &Generics) -> Ident {
    let taken: BTreeSet<String> = generics
        .params
        .iter()
        .filter_map(|param| match param {
            GenericParam::Type(param) => Some(param.ident.to_string()),
            GenericParam::Const(param) => Some(param.ident.to_string()),
            GenericParam::Lifetime(_) => None,
        })
        .collect();
    let mut name = String::from("__AmpR");
    while taken.contains(&name) {
        name.push('_');
    }
    Ident::new(&name, Span::call_site())
}

/// `Plan { type_name, node: PlanNode::Struct { default, fields } }`.
fn plan(input: &Input<'_>) -> TokenStream {
    let private = private();
    let type_name = input.ident.to_string();
    let default = precision(input.default());
    let fields = input.modules().map(|field| {
        let name = &field.name;
        let ty = field.ty;
        let ty_text = field.type_text();
        let precision = precision(field.own().or(input.default()));
        quote! {
            #private::PlanField {
                name: #name,
                ty: #ty_text,
                precision: #precision,
                plan: &<#ty as #private::AmpModule>::PLAN,
            }
        }
    });
    quote! {
        #private::Plan {
            type_name: #type_name,
            node: #private::PlanNode::Struct {
                default: #default,
                fields: &[#(#fields),*],
            },
        }
    }
}

/// Push the field's path segment and precision, visit it, pop.
fn visit_field(field: &Field<'_>, input: &Input<'_>, mutable: bool) -> TokenStream {
    let private = private();
    let name = &field.name;
    let member = &field.member;
    let precision = precision(field.own().or(input.default()));
    let ty = field.ty;
    // Named through the field's type, so that a type that is no module fails here with the same
    // diagnostic, at the same span, as in `PLAN`, and rustc reports it once.
    let call = if mutable {
        quote!(<#ty as #private::AmpModule>::visit_mut(&mut self.#member, __amp_cursor, __amp_visitor);)
    } else {
        quote!(<#ty as #private::AmpModule>::visit(&self.#member, __amp_cursor, __amp_visitor);)
    };
    quote! {
        __amp_cursor.push(#name, #precision);
        #call
        __amp_cursor.pop();
    }
}

/// A composite module accepts a half request: its fp32-pinned layers stay fp32 inside it.
fn impl_half_safe(input: &Input<'_>) -> TokenStream {
    let private = private();
    let ident = input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let unlisted = unlisted(has_bounds(input.generics));
    quote! {
        #[automatically_derived]
        #unlisted
        impl #impl_generics #private::HalfSafe for #ident #ty_generics #where_clause {}
    }
}

/// Assertions that the field types with a half attribute of their own are `HalfSafe`, spanned at each
/// type so that an fp32-pinned layer asked for a half precision is underlined in the user's code;
/// statements of `visit`'s body, where the struct's lifetimes and const parameters are in scope
/// (`[RmsNorm; L]`), checked at the definition. The type is named through `AmpModule::Module`: one that
/// is no module then gets only the error of `<#ty as AmpModule>::PLAN` in the plan (at the type's own
/// tokens), not a second, misleading one ("pinned to fp32") from its assertion. Field types that name
/// a type parameter are checked by where-clause bounds instead.
fn half_safe_checks(input: &Input<'_>) -> TokenStream {
    let private = private();
    let checks: Vec<TokenStream> = input
        .modules()
        .filter(|field| !field.is_generic && field.asks_half())
        .map(|field| {
            let ty = field.ty;
            // The path around the type spans its first to its last token, so that rustc underlines
            // the whole type, as it does the type alone.
            let last = ty.to_token_stream().into_iter().last().map_or_else(|| ty.span(), |t| t.span());
            let open = quote_spanned!(ty.span()=> __amp_assert_half_safe::< <);
            let close = quote_spanned!(last=> as #private::AmpModule>::Module>(););
            quote!(#open #ty #close)
        })
        .collect();
    if checks.is_empty() {
        return TokenStream::new();
    }
    quote! {
        const fn __amp_assert_half_safe<__AmpT: ?::core::marker::Sized + #private::HalfSafe>() {}
        #(#checks)*
    }
}

/// `#[diagnostic::do_not_recommend]` for an impl without bounds: it keeps the user's structs out of
/// rustc's "the following other types implement trait" lists, which would otherwise grow with every
/// model. An impl with bounds stays listed: there the attribute would also hide which bound failed.
pub fn unlisted(impl_has_bounds: bool) -> Option<TokenStream> {
    (!impl_has_bounds).then(|| quote!(#[diagnostic::do_not_recommend]))
}

/// True when the struct's generics carry bounds, inline or in a where clause.
pub fn has_bounds(generics: &Generics) -> bool {
    let where_bounds = generics.where_clause.as_ref().is_some_and(|clause| !clause.predicates.is_empty());
    let inline_bounds = generics.params.iter().any(|param| match param {
        GenericParam::Type(param) => !param.bounds.is_empty(),
        GenericParam::Lifetime(param) => !param.bounds.is_empty(),
        GenericParam::Const(_) => false,
    });
    where_bounds || inline_bounds
}

/// `Option<PrecisionSpec>` for a precision the macro knows.
fn precision(precision: Option<Precision>) -> TokenStream {
    let private = private();
    match precision {
        Some(precision) => {
            let variant = Ident::new(precision.variant(), Span::call_site());
            quote!(::core::option::Option::Some(#private::PrecisionSpec::#variant))
        }
        None => quote!(::core::option::Option::None),
    }
}
