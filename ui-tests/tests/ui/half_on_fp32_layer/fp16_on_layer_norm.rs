// `#[amp(fp16)]` on a LayerNorm is refused at the field's type: norms must compute in fp32.
use amp::AmpModule;

#[derive(AmpModule)]
struct Block {
    #[amp(fp16)]
    norm: amp::nn::LayerNorm,
    fc: amp::nn::Linear,
}

fn main() {}
