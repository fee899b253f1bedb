// Tuple struct fields are named by their index in the plan and in visit paths.
use amp::nn::{LayerNorm, Linear};
use amp::{AmpModule, PlanNode};

#[derive(AmpModule)]
struct Pair(#[amp(fp16)] Linear, LayerNorm, #[amp(skip)] f64);

fn main() {
    let PlanNode::Struct { fields, .. } = Pair::PLAN.node else { unreachable!() };
    let names: Vec<&str> = fields.iter().map(|field| field.name).collect();
    assert_eq!(names, ["0", "1"]);
}
