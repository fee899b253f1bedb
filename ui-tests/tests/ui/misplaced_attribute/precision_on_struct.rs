// A precision on the struct needs `default =`.
use amp::AmpModule;

#[derive(AmpModule)]
#[amp(bf16)]
struct Block {
    fc: amp::nn::Linear,
}

fn main() {}
