// `#[amp(skip)]` fields may be anything and are absent from the plan; a struct of only skipped fields
// is an empty module.
use amp::nn::Linear;
use amp::{AmpModule, PlanNode};

struct Config {
    hidden: usize,
}

#[derive(AmpModule)]
struct Block {
    #[amp(skip)]
    dropout: f32,
    fc: Linear,
    #[amp(skip)]
    config: Config,
}

#[derive(AmpModule)]
struct OnlyConfig {
    #[amp(skip)]
    config: Config,
}

fn main() {
    let PlanNode::Struct { fields, .. } = Block::PLAN.node else { unreachable!() };
    assert_eq!(fields.len(), 1);
    assert_eq!(fields[0].name, "fc");
    let PlanNode::Struct { fields, .. } = OnlyConfig::PLAN.node else { unreachable!() };
    assert!(fields.is_empty());
    let _ = Config { hidden: 0 }.hidden;
}
