//! `#[derive(AmpModule)]`: per-layer precision attributes, checked at compile time.
//!
//! Use it through the `amp` crate, which re-exports it next to the trait it implements.

mod ast;
mod attr;
mod check;
mod expand;
mod fallback;
mod symbol;

#[cfg(test)]
mod tests;

use proc_macro::TokenStream;
use syn::{parse_macro_input, DeriveInput};

/// Derives `amp::AmpModule` for a struct whose fields are layers and other modules.
///
/// Attributes:
///
/// - `#[amp(default = bf16)]` on the struct: the precision of every field without an attribute of its
///   own. Without it, such fields inherit the precision requested for the struct by its parent.
/// - `#[amp(fp32)]`, `#[amp(fp16)]`, `#[amp(bf16)]` or `#[amp(half)]` on a field: the precision that
///   field computes in (`half`: bf16 on CPU, fp16 on CUDA). Also spelled `f32`, `float32`, `f16`,
///   `float16`, `bfloat16`. The innermost attribute wins.
/// - `#[amp(skip)]` on a field that holds no layers (a dropout rate, a config).
///
/// Every other field must be a module: a layer of `amp::nn`, a struct deriving `AmpModule`, or a
/// `Vec`, `Option`, `Box` or array of modules. A half precision on a layer that must compute in fp32
/// (`LayerNorm`, `RmsNorm`: types that do not implement `amp::HalfSafe`) is a compile error; such a
/// layer under a half `default` simply stays fp32.
///
/// Not derivable, each with a compile error: enums and unions (no static plan), structs that hold
/// themselves, and `#[repr(packed)]` structs (their fields may be unaligned, and each layer is visited
/// through a reference). A struct in a module under `#![no_implicit_prelude]` does not compile either:
/// the impls carry `#[diagnostic::do_not_recommend]` (it keeps every user's struct out of rustc's "other
/// types implement this trait" lists), and rustc does not resolve the `diagnostic` namespace there; the
/// derive cannot see that attribute of an enclosing module, so define the struct outside such a module.
#[proc_macro_derive(AmpModule, attributes(amp))]
pub fn derive_amp_module(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand::derive(&input).into()
}
