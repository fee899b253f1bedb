//! The derive input as the macro sees it: a struct, its fields and their parsed attributes.

use std::collections::BTreeSet;

use proc_macro2::{Delimiter, Spacing, TokenStream, TokenTree};
use quote::ToTokens;
use syn::ext::IdentExt;
use syn::{parenthesized, token, Attribute, Data, DeriveInput, Generics, Ident, Member, Type};

use crate::attr::Attrs;
use crate::check::Ctxt;
use crate::symbol::Precision;

const ENUM_UNSUPPORTED: &str = "`#[derive(AmpModule)]` supports structs; an enum is not supported because \
    its layers change with the variant, so it has no static precision plan; put the layers of each variant \
    in a struct that derives `AmpModule`, or implement `amp::AmpModule` for the enum by hand";

const UNION_UNSUPPORTED: &str = "`#[derive(AmpModule)]` supports structs; a union is not supported because \
    its fields overlap, so its layers cannot be visited; use a struct";

/// A struct deriving `AmpModule`.
#[derive(Debug)]
pub struct Input<'a> {
    /// The struct's name.
    pub ident: &'a Ident,
    /// Its generics, as written.
    pub generics: &'a Generics,
    /// Its `#[amp(...)]` attributes.
    pub attrs: Attrs,
    /// Every field, skipped ones included, in declaration order.
    pub fields: Vec<Field<'a>>,
    /// The `packed` of a `#[repr(packed)]` or `#[repr(C, packed(2))]`, as written.
    pub packed: Option<Ident>,
}

/// One field of the struct.
#[derive(Debug)]
pub struct Field<'a> {
    /// `self.<member>`: a name, or an index in a tuple struct.
    pub member: Member,
    /// The path segment of the field: its name, or its index.
    pub name: String,
    /// Its type, as written.
    pub ty: &'a Type,
    /// Its `#[amp(...)]` attributes.
    pub attrs: Attrs,
    /// True when the type names a type parameter of the struct (or `Self`): its checks are where-clause
    /// bounds of the impl rather than assertions in its body. Lifetimes and const parameters do not
    /// count: a type that names only those (`&'a Linear`, `[RmsNorm; L]`) is checked in the impl's
    /// body at the definition, where a bound would make the impl silently not apply.
    pub is_generic: bool,
}

impl<'a> Input<'a> {
    /// Reads a struct; enums and unions are an error. Attribute mistakes are recorded in `cx`.
    pub fn from_syn(cx: &mut Ctxt, node: &'a DeriveInput) -> syn::Result<Self> {
        let fields = match &node.data {
            Data::Struct(data) => &data.fields,
            Data::Enum(data) => return Err(syn::Error::new_spanned(data.enum_token, ENUM_UNSUPPORTED)),
            Data::Union(data) => return Err(syn::Error::new_spanned(data.union_token, UNION_UNSUPPORTED)),
        };
        cx.at_struct();
        let attrs = Attrs::from_syn(cx, &node.attrs);
        let params = type_param_names(&node.generics);
        let fields = fields
            .iter()
            .enumerate()
            .map(|(index, field)| {
                cx.at_field(index);
                let member = match &field.ident {
                    Some(ident) => Member::Named(ident.clone()),
                    None => Member::Unnamed(index.into()),
                };
                // The name a parameter path carries: `r#type` is the field `type`, as candle-nn's
                // `vb.pp("type")` names it.
                let name = match &field.ident {
                    Some(ident) => ident.unraw().to_string(),
                    None => index.to_string(),
                };
                Field {
                    member,
                    name,
                    ty: &field.ty,
                    attrs: Attrs::from_syn(cx, &field.attrs),
                    is_generic: mentions_any(field.ty.to_token_stream(), &params),
                }
            })
            .collect();
        let packed = repr_packed(&node.attrs);
        Ok(Input { ident: &node.ident, generics: &node.generics, attrs, fields, packed })
    }
}

impl Input<'_> {
    /// The struct's `#[amp(default = ...)]`.
    pub fn default(&self) -> Option<Precision> {
        self.attrs.default.as_ref().map(|written| written.precision)
    }

    /// The fields that are modules, that is, not `#[amp(skip)]`.
    pub fn modules(&self) -> impl Iterator<Item = &Field<'_>> {
        self.fields.iter().filter(|field| field.attrs.skip.is_none())
    }
}

impl Field<'_> {
    /// The field's own precision attribute.
    pub fn own(&self) -> Option<Precision> {
        self.attrs.precision.as_ref().map(|written| written.precision)
    }

    /// True when the field's own attribute asks for a half precision: its type must be `HalfSafe`.
    /// A half precision it only inherits from the struct's default is no error: an fp32-pinned layer
    /// stays fp32 under a half default.
    pub fn asks_half(&self) -> bool {
        self.own().is_some_and(Precision::is_half)
    }

    /// The field's type as written, with spaces only where Rust needs them (`Vec<amp::nn::Linear>`).
    pub fn type_text(&self) -> String {
        let mut text = String::new();
        write_tokens(&mut text, self.ty.to_token_stream());
        text
    }
}

/// The `packed` word of the struct's `#[repr(...)]` attributes, if one names it. A `repr` that does not
/// parse is left to rustc, which reports it.
fn repr_packed(attrs: &[Attribute]) -> Option<Ident> {
    let mut packed = None;
    for attr in attrs.iter().filter(|attr| attr.path().is_ident("repr")) {
        let _ = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("packed") {
                packed = meta.path.get_ident().cloned();
            }
            // `packed(2)`, `align(8)`: the argument is not needed.
            if meta.input.peek(token::Paren) {
                let argument;
                parenthesized!(argument in meta.input);
                argument.parse::<TokenStream>()?;
            }
            Ok(())
        });
    }
    packed
}

/// The names of the struct's type parameters, and `Self`.
fn type_param_names(generics: &Generics) -> BTreeSet<String> {
    let mut names = BTreeSet::from(["Self".to_string()]);
    names.extend(generics.type_params().map(|param| param.ident.to_string()));
    names
}

/// True when some identifier in `tokens` is one of `names`. A token-level walk sees every place a
/// parameter can appear, macros in type position included; a false positive only moves a check into
/// the impl's where clause, where it is still enforced.
fn mentions_any(tokens: TokenStream, names: &BTreeSet<String>) -> bool {
    tokens.into_iter().any(|token| match token {
        TokenTree::Ident(ident) => names.contains(&ident.to_string()),
        TokenTree::Group(group) => mentions_any(group.stream(), names),
        TokenTree::Punct(_) | TokenTree::Literal(_) => false,
    })
}

/// Appends `tokens` to `text` as a person writes a type: a space between two words (`dyn Trait`,
/// `&'a mut T`), after `,` and `;`, and around `=`, `+` and `->`; none elsewhere.
fn write_tokens(text: &mut String, tokens: TokenStream) {
    let mut after_word = false;
    for token in tokens {
        let is_word = matches!(token, TokenTree::Ident(_) | TokenTree::Literal(_));
        match token {
            TokenTree::Ident(_) | TokenTree::Literal(_) => {
                if after_word {
                    text.push(' ');
                }
                text.push_str(&token.to_string());
            }
            TokenTree::Group(group) => {
                let (open, close) = match group.delimiter() {
                    Delimiter::Parenthesis => ("(", ")"),
                    Delimiter::Bracket => ("[", "]"),
                    Delimiter::Brace => ("{", "}"),
                    Delimiter::None => ("", ""),
                };
                text.push_str(open);
                write_tokens(text, group.stream());
                text.push_str(close);
            }
            TokenTree::Punct(punct) => {
                let ch = punct.as_char();
                let arrow = ch == '-' && punct.spacing() == Spacing::Joint;
                if matches!(ch, '=' | '+') || arrow {
                    text.push(' ');
                }
                text.push(ch);
                if matches!(ch, ',' | ';' | '=' | '+') || (ch == '>' && text.ends_with("->")) {
                    text.push(' ');
                }
            }
        }
        after_word = is_word;
    }
    let trimmed = text.trim_end().len();
    text.truncate(trimmed);
}
