// Structs deriving AmpModule nest: the inner struct's plan sits under the outer field, and an fp32
// layer inside a half-precision parent is fine.
use amp::nn::{Embedding, LayerNorm, Linear};
use amp::{AmpModule, PlanNode};

#[derive(AmpModule)]
struct Mlp {
    up: Linear,
    down: Linear,
}

#[derive(AmpModule)]
struct Block {
    #[amp(fp32)]
    norm: LayerNorm,
    #[amp(bf16)]
    mlp: Mlp,
}

#[derive(AmpModule)]
struct Model {
    #[amp(fp16)]
    embed: Embedding,
    #[amp(half)]
    block: Block,
}

const fn field_names_match<T: AmpModule>(expected: &[&str]) -> bool {
    let PlanNode::Struct { fields, .. } = T::PLAN.node else { return false };
    if fields.len() != expected.len() {
        return false;
    }
    let mut i = 0;
    while i < fields.len() {
        if !fields[i].name.eq_ignore_ascii_case(expected[i]) {
            return false;
        }
        i += 1;
    }
    true
}

const _: () = assert!(field_names_match::<Model>(&["embed", "block"]));
const _: () = assert!(field_names_match::<Block>(&["norm", "mlp"]));

fn main() {
    let plan = Model::PLAN;
    let PlanNode::Struct { fields, default: None } = plan.node else { unreachable!() };
    assert_eq!(plan.type_name, "Model");
    assert_eq!(fields[1].ty, "Block");
    assert_eq!(fields[1].plan.type_name, "Block");
}
