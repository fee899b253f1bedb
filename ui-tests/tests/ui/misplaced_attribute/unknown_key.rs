// Keys outside the grammar are refused; `precision = fp16` is answered with the form to write.
use amp::AmpModule;

#[derive(AmpModule)]
struct Block {
    #[amp(precision = fp16)]
    fc: amp::nn::Linear,
    #[amp(dtype(f16))]
    out: amp::nn::Linear,
}

fn main() {}
