//! The words of the `#[amp(...)]` grammar, in one place (serde's `symbol.rs`).

use syn::{Ident, Path};

/// A keyword of the attribute grammar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Symbol(&'static str);

/// The attribute's own name: `#[amp(...)]`.
pub const AMP: Symbol = Symbol("amp");
/// `#[amp(default = bf16)]` on the struct.
pub const DEFAULT: Symbol = Symbol("default");
/// `#[amp(skip)]` on a field.
pub const SKIP: Symbol = Symbol("skip");

impl PartialEq<Symbol> for Path {
    fn eq(&self, word: &Symbol) -> bool {
        self.is_ident(word.0)
    }
}

/// A precision as the macro knows it; mirrors `amp_runtime::PrecisionSpec`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// `fp32`.
    Fp32,
    /// `fp16`.
    Fp16,
    /// `bf16`.
    Bf16,
    /// `half`: the device's best half type.
    Half,
}

/// Every accepted spelling and the precision it names. Must list exactly the spellings of
/// `PrecisionSpec::SPELLINGS` in the runtime (`ui-tests/tests/spellings.rs` checks that the derive's
/// error for an unknown precision lists them).
pub const SPELLINGS: &[(&str, Precision)] = &[
    ("fp32", Precision::Fp32),
    ("f32", Precision::Fp32),
    ("float32", Precision::Fp32),
    ("fp16", Precision::Fp16),
    ("f16", Precision::Fp16),
    ("float16", Precision::Fp16),
    ("bf16", Precision::Bf16),
    ("bfloat16", Precision::Bf16),
    ("half", Precision::Half),
];

/// The list shown in "unknown precision" errors; the same text as `PrecisionSpec::SPELLINGS` (checked by
/// ui-tests/tests/spellings.rs against the derive's pinned output).
pub const SPELLINGS_HELP: &str =
    "fp32 (f32, float32), fp16 (f16, float16), bf16 (bfloat16), half (the device's best half type)";

impl Precision {
    /// The precision a spelling names, if it is one.
    pub fn from_spelling(word: &Ident) -> Option<Precision> {
        SPELLINGS.iter().find(|(spelling, _)| word == spelling).map(|&(_, precision)| precision)
    }

    /// The canonical name, as `PrecisionSpec::name` writes it.
    pub const fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
            Precision::Half => "half",
        }
    }

    /// The name of the matching `PrecisionSpec` variant.
    pub const fn variant(self) -> &'static str {
        match self {
            Precision::Fp32 => "Fp32",
            Precision::Fp16 => "Fp16",
            Precision::Bf16 => "Bf16",
            Precision::Half => "Half",
        }
    }

    /// True for the 16-bit requests, which only layers implementing `HalfSafe` accept.
    pub const fn is_half(self) -> bool {
        !matches!(self, Precision::Fp32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_help_lists_every_spelling_under_its_canonical_name() {
        for &(spelling, precision) in SPELLINGS {
            let group = SPELLINGS_HELP.split("), ").find(|group| group.starts_with(precision.name()));
            let listed = group.is_some_and(|group| {
                group.split(|c: char| !c.is_ascii_alphanumeric()).any(|word| word == spelling)
            });
            assert!(listed, "{spelling} is not listed under {} in SPELLINGS_HELP", precision.name());
        }
    }
}
