// A generic field with a half attribute of its own requires a HalfSafe type argument; using the struct
// with a LayerNorm there is refused where the module is used.
use amp::nn::{LayerNorm, Linear};
use amp::AmpModule;

#[derive(AmpModule)]
struct Block<A> {
    #[amp(fp16)]
    attn: A,
    fc: Linear,
}

fn train<M: AmpModule>(_model: &M) {}

fn main() {
    let block: Option<Block<LayerNorm>> = None;
    if let Some(block) = &block {
        train(block);
    }
}
