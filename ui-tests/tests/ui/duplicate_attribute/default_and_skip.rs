// A repeated struct default and a repeated skip are each refused at the repeat.
use amp::AmpModule;

#[derive(AmpModule)]
#[amp(default = bf16)]
#[amp(default = bf16)]
struct Block {
    fc: amp::nn::Linear,
    #[amp(skip, skip)]
    dropout: f32,
}

fn main() {}
