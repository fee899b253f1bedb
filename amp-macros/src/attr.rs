//! The `#[amp(...)]` grammar. Struct and field attributes share one grammar; which words belong where
//! is a rule of `check.rs`. Repeated and contradicting values of one word are rejected here, where they
//! are parsed, so every attribute reports its own mistakes.

use proc_macro2::{Span, TokenTree};
use syn::meta::ParseNestedMeta;
use syn::spanned::Spanned;
use syn::{Attribute, Expr, Ident, Lit, MacroDelimiter, Meta, Token};

use crate::check::Ctxt;
use crate::symbol::{Precision, AMP, DEFAULT, SKIP, SPELLINGS, SPELLINGS_HELP};

/// A precision as written: what it means and the user's token, for spans and messages.
#[derive(Clone, Debug)]
pub struct Written {
    /// The precision the token names.
    pub precision: Precision,
    /// The token as the user spelled it (`f16`, `fp16`, ...).
    pub token: Ident,
}

/// What the `#[amp(...)]` attributes of one struct or field say.
#[derive(Clone, Debug, Default)]
pub struct Attrs {
    /// `#[amp(fp16)]`.
    pub precision: Option<Written>,
    /// `#[amp(default = bf16)]`.
    pub default: Option<Written>,
    /// `#[amp(skip)]`, with its span.
    pub skip: Option<Span>,
    /// Every `#[amp]` attribute, for "not expected here" errors.
    pub spans: Vec<Span>,
}

impl Attrs {
    /// Parses every `#[amp(...)]` among `attrs`, recording each mistake in `cx`.
    pub fn from_syn(cx: &mut Ctxt, attrs: &[Attribute]) -> Attrs {
        let mut out = Attrs::default();
        for attr in attrs.iter().filter(|attr| attr.path() == &AMP) {
            out.spans.push(attr.span());
            match &attr.meta {
                Meta::List(list) if !matches!(list.delimiter, MacroDelimiter::Paren(_)) => cx
                    .error_spanned_by(
                        attr,
                        "`#[amp]` takes its arguments in parentheses: `#[amp(fp16)]` or `#[amp(skip)]` on a \
                     field, `#[amp(default = bf16)]` on the struct",
                    ),
                Meta::List(list) if list.tokens.is_empty() => cx.error_spanned_by(
                    attr,
                    "empty `#[amp()]`; write a precision such as `#[amp(fp16)]` or `#[amp(skip)]` on a \
                     field, `#[amp(default = bf16)]` on the struct, or remove the attribute",
                ),
                Meta::List(list) => {
                    match leading_string(&list.tokens) {
                        Some(literal) => {
                            let word = literal.to_string().trim_matches('"').to_string();
                            cx.error_spanned_by(
                            literal,
                            format!("precisions are words, not strings: write `#[amp({word})]`, without quotes"),
                        );
                        }
                        None => {
                            if let Err(err) = attr.parse_nested_meta(|meta| out.parse_entry(cx, meta)) {
                                cx.syn_error(err);
                            }
                        }
                    }
                }
                Meta::Path(_) | Meta::NameValue(_) => cx.error_spanned_by(
                    attr,
                    "`#[amp]` takes its arguments in parentheses: `#[amp(fp16)]` or `#[amp(skip)]` on a \
                     field, `#[amp(default = bf16)]` on the struct",
                ),
            }
        }
        out
    }

    /// One comma-separated entry of `#[amp(...)]`. Mistakes in what an entry means go to `cx` and
    /// parsing goes on; an `Err` is returned only where the tokens cannot be read past.
    fn parse_entry(&mut self, cx: &mut Ctxt, meta: ParseNestedMeta<'_>) -> syn::Result<()> {
        if meta.path == SKIP {
            // #[amp(skip)]
            if has_value(&meta) {
                skip_value(&meta)?;
                cx.error_spanned_by(&meta.path, "`#[amp(skip)]` takes no value; write `#[amp(skip)]`");
            } else if self.skip.is_some() {
                cx.error_spanned_by(&meta.path, "duplicate `#[amp(skip)]` on this field; remove the repeat");
            } else {
                self.skip = Some(meta.path.span());
            }
        } else if meta.path == DEFAULT {
            // #[amp(default = bf16)]
            if let Some(written) = parse_default_value(cx, &meta)? {
                set_default(cx, &mut self.default, written);
            }
        } else if let Some(ident) = meta.path.get_ident().filter(|_| !has_value(&meta)) {
            // #[amp(fp16)]; #[amp(fp-16)] is read whole, so that its error quotes what was written
            let written = format!("{ident}{}", dashed_rest(&meta)?);
            match Precision::from_spelling(ident).filter(|_| *ident == written) {
                Some(precision) => {
                    set_precision(cx, &mut self.precision, Written { precision, token: ident.clone() })
                }
                None => cx.error_spanned_by(
                    ident,
                    format!(
                        "unknown precision `{written}` in `#[amp({written})]`; {}",
                        expected(&written, "")
                    ),
                ),
            }
        } else if let Some(ident) = meta.path.get_ident().filter(|i| Precision::from_spelling(i).is_some()) {
            // #[amp(fp16 = true)], #[amp(fp16(x))]: a precision given a value
            skip_value(&meta)?;
            cx.error_spanned_by(
                &meta.path,
                format!("the precision `{ident}` takes no value; write `#[amp({ident})]`"),
            );
        } else {
            // #[amp(precision = fp16)], #[amp(a::b)]: not part of the grammar
            let value = skip_value(&meta)?;
            let key = path_text(&meta.path);
            let message = match value.as_ref().and_then(precision_ident) {
                Some(precision) => format!(
                    "unknown key `{key}` in `#[amp({key} = {precision})]`; write the precision alone: \
                     `#[amp({precision})]` on a field, or `#[amp(default = {precision})]` on the struct"
                ),
                None => format!(
                    "unknown key `{key}` in `#[amp(...)]`; expected a precision ({SPELLINGS_HELP}) or `skip` \
                     on a field, or `default = <precision>` on the struct"
                ),
            };
            cx.error_spanned_by(&meta.path, message);
        }
        Ok(())
    }
}

/// Records a field precision, rejecting a second one.
fn set_precision(cx: &mut Ctxt, slot: &mut Option<Written>, new: Written) {
    match slot {
        None => *slot = Some(new),
        Some(old) if old.precision == new.precision => cx.error_spanned_by(
            &new.token,
            format!(
                "duplicate precision: `#[amp({})]` repeats `#[amp({})]` on this field; remove the repeat",
                new.token, old.token
            ),
        ),
        Some(old) => cx.error_spanned_by(
            &new.token,
            format!(
                "conflicting precisions `#[amp({})]` and `#[amp({})]` on one field; a field computes in one \
                 precision, so keep only the one you mean",
                old.token, new.token
            ),
        ),
    }
}

/// Records a struct default, rejecting a second one.
fn set_default(cx: &mut Ctxt, slot: &mut Option<Written>, new: Written) {
    match slot {
        None => *slot = Some(new),
        Some(old) if old.precision == new.precision => cx.error_spanned_by(
            &new.token,
            format!(
                "duplicate `#[amp(default = {})]`; the struct already has `#[amp(default = {})]`, remove the \
                 repeat",
                new.token, old.token
            ),
        ),
        Some(old) => cx.error_spanned_by(
            &new.token,
            format!(
                "conflicting defaults `#[amp(default = {})]` and `#[amp(default = {})]`; a struct has one \
                 default precision, so keep only the one you mean",
                old.token, new.token
            ),
        ),
    }
}

/// Parses `= bf16` after `default`. `Ok(None)`: the mistake is recorded in `cx`.
fn parse_default_value(cx: &mut Ctxt, meta: &ParseNestedMeta<'_>) -> syn::Result<Option<Written>> {
    if !meta.input.peek(Token![=]) {
        skip_value(meta)?;
        cx.error_spanned_by(
            &meta.path,
            format!("`default` needs a precision: write `#[amp(default = bf16)]`; one of: {SPELLINGS_HELP}"),
        );
        return Ok(None);
    }
    let value: Expr = meta.value()?.parse()?;
    if let Some(token) = expr_ident(&value) {
        return Ok(match Precision::from_spelling(token) {
            Some(precision) => Some(Written { precision, token: token.clone() }),
            None => {
                let message = format!(
                    "unknown precision `{token}` in `#[amp(default = {token})]`; {}",
                    expected(&token.to_string(), "default = ")
                );
                cx.error_spanned_by(token, message);
                None
            }
        });
    }
    let message = match &value {
        Expr::Lit(lit) if matches!(lit.lit, Lit::Str(_)) => {
            "write the precision without quotes, as in `#[amp(default = bf16)]`".to_string()
        }
        _ => format!("`#[amp(default = ...)]` expects a precision, one of: {SPELLINGS_HELP}"),
    };
    cx.error_spanned_by(&value, message);
    Ok(None)
}

/// What an unknown precision `written` should have been: the spelling it is in another case or without
/// dashes (`FP16`, `fp-16`: write `#[amp({key}fp16)]`), else the list of spellings.
fn expected(written: &str, key: &str) -> String {
    let plain: String = written.chars().filter(|&c| c != '-').flat_map(char::to_lowercase).collect();
    if SPELLINGS.iter().any(|(spelling, _)| *spelling == plain) {
        format!("precisions are written in lowercase, without dashes: `#[amp({key}{plain})]`")
    } else {
        format!("expected one of: {SPELLINGS_HELP}")
    }
}

/// Reads what follows an entry's word as `-16` and `-16-x` (a precision written with dashes), and
/// returns it as written; an empty string when no dash follows.
fn dashed_rest(meta: &ParseNestedMeta<'_>) -> syn::Result<String> {
    let mut rest = String::new();
    while meta.input.peek(Token![-]) {
        meta.input.parse::<Token![-]>()?;
        let part: TokenTree = meta.input.parse()?;
        rest.push('-');
        rest.push_str(&part.to_string());
    }
    Ok(rest)
}

/// True when the entry goes on with `= value` or `(...)`.
fn has_value(meta: &ParseNestedMeta<'_>) -> bool {
    meta.input.peek(Token![=]) || meta.input.peek(syn::token::Paren)
}

/// Reads past `= value` or `(...)` so that the entries after it are still checked.
fn skip_value(meta: &ParseNestedMeta<'_>) -> syn::Result<Option<Expr>> {
    if meta.input.peek(Token![=]) {
        return Ok(Some(meta.value()?.parse()?));
    }
    if meta.input.peek(syn::token::Paren) {
        meta.input.parse::<TokenTree>()?;
    }
    Ok(None)
}

/// The identifier of a value written as a bare word.
fn expr_ident(expr: &Expr) -> Option<&Ident> {
    match expr {
        Expr::Path(path) if path.attrs.is_empty() && path.qself.is_none() => path.path.get_ident(),
        _ => None,
    }
}

/// The value of `key = value` when it is a precision, to suggest the right form.
fn precision_ident(expr: &Expr) -> Option<&Ident> {
    expr_ident(expr).filter(|ident| Precision::from_spelling(ident).is_some())
}

/// A path as written, `a::b`.
fn path_text(path: &syn::Path) -> String {
    let segments: Vec<String> = path.segments.iter().map(|segment| segment.ident.to_string()).collect();
    segments.join("::")
}

/// The string literal an attribute's arguments start with (`#[amp("fp16")]`), if they do.
fn leading_string(tokens: &proc_macro2::TokenStream) -> Option<proc_macro2::Literal> {
    match tokens.clone().into_iter().next() {
        Some(TokenTree::Literal(literal)) if literal.to_string().starts_with('"') => Some(literal),
        _ => None,
    }
}
