// Different precisions in two `#[amp]` attributes of one field are refused too.
use amp::AmpModule;

#[derive(AmpModule)]
struct Block {
    #[amp(bf16)]
    #[amp(fp32)]
    fc: amp::nn::Linear,
}

fn main() {}
