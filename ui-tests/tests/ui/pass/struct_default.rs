// `#[amp(default = ...)]` sets the precision of fields without their own attribute; an fp32-pinned
// layer that only inherits a half default compiles and stays fp32 at run time.
use amp::nn::{LayerNorm, Linear, RmsNorm};
use amp::{AmpModule, PlanNode, PrecisionSpec};

#[derive(AmpModule)]
#[amp(default = fp16)]
struct Block {
    fc: Linear,
    norm: LayerNorm,
    rms: RmsNorm,
    #[amp(fp32)]
    head: Linear,
}

fn main() {
    let PlanNode::Struct { default, fields } = Block::PLAN.node else { unreachable!() };
    assert_eq!(default, Some(PrecisionSpec::Fp16));
    let precisions: Vec<_> = fields.iter().map(|field| field.precision).collect();
    let fp16 = Some(PrecisionSpec::Fp16);
    assert_eq!(precisions, [fp16, fp16, fp16, Some(PrecisionSpec::Fp32)]);
}
