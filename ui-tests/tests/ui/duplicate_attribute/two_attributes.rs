// A precision repeated in a second `#[amp]` attribute, even under another spelling, is refused.
use amp::AmpModule;

#[derive(AmpModule)]
struct Block {
    #[amp(fp16)]
    #[amp(f16)]
    fc: amp::nn::Linear,
}

fn main() {}
