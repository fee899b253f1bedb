// The same precision twice in one attribute is refused at the repeat.
use amp::AmpModule;

#[derive(AmpModule)]
struct Block {
    #[amp(fp16, fp16)]
    fc: amp::nn::Linear,
}

fn main() {}
