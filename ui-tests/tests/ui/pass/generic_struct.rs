// A generic field gets a where-clause bound (`AmpModule`, plus `HalfSafe` under a half attribute of its
// own); a generic field without an attribute takes any module, fp32-pinned ones included. Bounds on
// private field types of a public struct raise no lint.
#![deny(private_bounds, private_interfaces, unused)]

use amp::nn::{LayerNorm, Linear};
use amp::{AmpModule, PlanNode};

#[derive(AmpModule)]
#[amp(default = bf16)]
struct Block<A, N> {
    #[amp(fp16)]
    attn: A,
    norm: N,
    fc: Linear,
}

#[derive(AmpModule)]
struct Model<M: AmpModule>
where
    M: Send,
{
    blocks: Vec<Block<M, LayerNorm>>,
}

#[derive(AmpModule)]
pub struct Public<'a, M, const N: usize> {
    inner: [Block<M, M>; N],
    #[amp(skip)]
    name: &'a str,
}

const fn field_count<T: AmpModule>() -> usize {
    match T::PLAN.node {
        PlanNode::Struct { fields, .. } => fields.len(),
        _ => usize::MAX,
    }
}

const _: () = assert!(field_count::<Block<Linear, LayerNorm>>() == 3);
const _: () = assert!(field_count::<Model<Linear>>() == 1);
const _: () = assert!(<Model<Linear> as AmpModule>::NEEDS_LOSS_SCALING);
const _: () = assert!(field_count::<Public<'static, Linear, 2>>() == 1);

fn main() {
    let public: Option<Public<'_, Linear, 2>> = None;
    if let Some(public) = public {
        let _ = (public.inner, public.name);
    }
}
