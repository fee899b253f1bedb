//! What the derive emits on error: the errors, and a stub impl so that the rest of the user's code,
//! which uses the type as a module, does not add a wave of follow-on errors (thiserror's `fallback.rs`).

use proc_macro2::TokenStream;
use quote::quote;
use syn::DeriveInput;

use crate::expand::{has_bounds, private, request_param, unlisted};

/// `compile_error!`s for `error`, and `AmpModule` and `HalfSafe` impls with an empty plan.
pub fn expand(node: &DeriveInput, error: &syn::Error) -> TokenStream {
    let private = private();
    let errors = error.to_compile_error();
    let ident = &node.ident;
    let type_name = ident.to_string();
    let (impl_generics, ty_generics, where_clause) = node.generics.split_for_impl();
    let unlisted = unlisted(has_bounds(&node.generics));
    let request = request_param(&node.generics);
    let mut with_request = node.generics.clone();
    with_request.params.push(syn::parse_quote!(#request: #private::Request));
    let (request_impl_generics, _, _) = with_request.split_for_impl();
    quote! {
        #errors
        const _: () = {
            #[automatically_derived]
            #unlisted
            impl #impl_generics #private::AmpModule for #ident #ty_generics #where_clause {
                type Module = Self;
                const PLAN: #private::Plan = #private::Plan {
                    type_name: #type_name,
                    node: #private::PlanNode::Struct {
                        default: ::core::option::Option::None,
                        fields: &[],
                    },
                };

                fn visit(&self, _: &mut #private::Cursor, _: &mut dyn #private::Visitor) {}

                fn visit_mut(&mut self, _: &mut #private::Cursor, _: &mut dyn #private::VisitorMut) {}
            }

            #[automatically_derived]
            #[diagnostic::do_not_recommend]
            impl #request_impl_generics #private::NoFp16Under<#request> for #ident #ty_generics #where_clause {}

            #[automatically_derived]
            #unlisted
            impl #impl_generics #private::HalfSafe for #ident #ty_generics #where_clause {}
        };
    }
}
