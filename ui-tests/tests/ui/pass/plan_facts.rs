// NEEDS_LOSS_SCALING is a compile-time fact of the plan: fp16 (or `half`) reaching a half-capable layer
// through any nesting needs a loss scaler; bf16 alone does not; an fp16 default reaching an inheriting
// Linear inside a nested struct does; an fp16 default that only reaches fp32-pinned norms does not.
use amp::nn::{Embedding, LayerNorm, Linear};
use amp::AmpModule;

#[derive(AmpModule)]
struct Inner {
    fc: Linear,
    norm: LayerNorm,
}

#[derive(AmpModule)]
struct NestedFp16 {
    #[amp(bf16)]
    embed: Embedding,
    inner: Vec<Outer>,
}

#[derive(AmpModule)]
struct Outer {
    #[amp(fp16)]
    fc: Linear,
}

#[derive(AmpModule)]
#[amp(default = bf16)]
struct Bf16Only {
    inner: Inner,
    #[amp(bf16)]
    embed: Embedding,
}

#[derive(AmpModule)]
#[amp(default = fp16)]
struct Fp16Default {
    inner: Inner,
}

#[derive(AmpModule)]
#[amp(default = fp16)]
struct Fp16OnNormsOnly {
    norm: LayerNorm,
    #[amp(fp32)]
    fc: Linear,
}

#[derive(AmpModule)]
struct HalfNested {
    #[amp(half)]
    inner: Inner,
}

#[derive(AmpModule)]
struct NoAttributes {
    inner: Inner,
}

const _: () = assert!(<NestedFp16 as AmpModule>::NEEDS_LOSS_SCALING);
const _: () = assert!(!<Bf16Only as AmpModule>::NEEDS_LOSS_SCALING);
const _: () = assert!(<Fp16Default as AmpModule>::NEEDS_LOSS_SCALING);
const _: () = assert!(!<Fp16OnNormsOnly as AmpModule>::NEEDS_LOSS_SCALING);
const _: () = assert!(<HalfNested as AmpModule>::NEEDS_LOSS_SCALING);
const _: () = assert!(!<NoAttributes as AmpModule>::NEEDS_LOSS_SCALING);

fn main() {}
