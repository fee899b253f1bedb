// `default = ...` belongs on the struct; on a field the precision is written alone.
use amp::AmpModule;

#[derive(AmpModule)]
struct Block {
    #[amp(default = bf16)]
    fc: amp::nn::Linear,
}

fn main() {}
