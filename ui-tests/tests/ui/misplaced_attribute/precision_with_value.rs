// A precision given a value, `#[amp(fp16 = true)]` or `#[amp(fp16(x))]`, is refused with the bare form
// (it read as an unknown key `fp16`).
use amp::AmpModule;

#[derive(AmpModule)]
struct Block {
    #[amp(fp16 = true)]
    a: amp::nn::Linear,
    #[amp(bf16(x))]
    b: amp::nn::Linear,
}

fn main() {}
