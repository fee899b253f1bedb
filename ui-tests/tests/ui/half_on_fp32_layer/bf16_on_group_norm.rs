// GroupNorm reduces over each group in fp32: a bf16 request on it is refused.
use amp::nn::{GroupNorm, Linear};
use amp::AmpModule;

#[derive(AmpModule)]
#[amp(default = bf16)]
struct Block {
    fc: Linear,
    #[amp(bf16)]
    norm: GroupNorm,
}

fn main() {}
