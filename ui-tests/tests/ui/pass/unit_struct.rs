// Unit structs and structs without fields are modules with an empty plan.
use amp::{AmpModule, PlanNode};

#[derive(AmpModule)]
struct Identity;

#[derive(AmpModule)]
#[amp(default = bf16)]
struct Empty {}

#[derive(AmpModule)]
struct EmptyTuple();

fn main() {
    for plan in [Identity::PLAN, Empty::PLAN, EmptyTuple::PLAN] {
        let PlanNode::Struct { fields, .. } = plan.node else { unreachable!() };
        assert!(fields.is_empty());
    }
    assert!(!Identity::NEEDS_LOSS_SCALING);
}
