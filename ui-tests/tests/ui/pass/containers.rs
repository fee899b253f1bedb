// Vec, Option, Box and arrays of modules are modules, in any nesting; their plan names the container.
use amp::nn::{LayerNorm, Linear};
use amp::{AmpModule, PlanNode};

#[derive(AmpModule)]
struct Layer {
    fc: Linear,
}

#[derive(AmpModule)]
struct Model {
    #[amp(bf16)]
    layers: Vec<Layer>,
    #[amp(fp16)]
    head: Option<Box<Linear>>,
    #[amp(fp16)]
    experts: [Linear; 4],
    norms: Vec<Option<LayerNorm>>,
    boxed: Box<Layer>,
}

fn main() {
    let PlanNode::Struct { fields, .. } = Model::PLAN.node else { unreachable!() };
    let types: Vec<&str> = fields.iter().map(|field| field.ty).collect();
    assert_eq!(
        types,
        ["Vec<Layer>", "Option<Box<Linear>>", "[Linear; 4]", "Vec<Option<LayerNorm>>", "Box<Layer>"]
    );
    assert!(matches!(fields[0].plan.node, PlanNode::Repeated { container: "Vec", .. }));
    assert!(matches!(fields[2].plan.node, PlanNode::Repeated { container: "array", .. }));
}
