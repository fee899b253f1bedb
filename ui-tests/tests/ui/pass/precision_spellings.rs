// Every spelling of a precision is accepted and maps to the canonical one.
use amp::nn::{LayerNorm, Linear};
use amp::{AmpModule, PlanNode, PrecisionSpec};

#[derive(AmpModule)]
#[amp(default = bfloat16)]
struct Spellings {
    #[amp(f32)]
    a: LayerNorm,
    #[amp(float32)]
    b: Linear,
    #[amp(f16)]
    c: Linear,
    #[amp(float16)]
    d: Linear,
    #[amp(fp16)]
    e: Linear,
    #[amp(bf16)]
    f: Linear,
    #[amp(half)]
    g: Linear,
    #[amp(fp32)]
    h: Linear,
    inherits: Linear,
}

fn main() {
    use PrecisionSpec::*;
    let PlanNode::Struct { default, fields } = Spellings::PLAN.node else { unreachable!() };
    assert_eq!(default, Some(Bf16));
    let precisions: Vec<_> = fields.iter().map(|field| field.precision).collect();
    let expected = [Fp32, Fp32, Fp16, Fp16, Fp16, Bf16, Half, Fp32, Bf16].map(Some);
    assert_eq!(precisions, expected);
}
