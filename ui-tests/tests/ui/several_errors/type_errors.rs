// Every bad field type of a struct is reported in one compile, each at its own field.
use amp::nn::{LayerNorm, Linear, RmsNorm};
use amp::AmpModule;

#[derive(AmpModule)]
struct Block {
    #[amp(fp16)]
    norm: LayerNorm,
    steps: usize,
    #[amp(bf16)]
    rms: RmsNorm,
    fc: Linear,
    name: String,
}

fn main() {}
