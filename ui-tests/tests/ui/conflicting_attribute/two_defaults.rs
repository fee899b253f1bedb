// Two different struct defaults are refused: a struct has one default precision.
use amp::AmpModule;

#[derive(AmpModule)]
#[amp(default = bf16, default = fp16)]
struct Block {
    fc: amp::nn::Linear,
}

fn main() {}
