// `#[amp[...]]` and `#[amp{...}]` are refused with the parenthesised form (they were read as if written
// with parentheses).
use amp::AmpModule;

#[derive(AmpModule)]
#[amp{default = bf16}]
struct Block {
    #[amp[fp16]]
    fc: amp::nn::Linear,
}

fn main() {}
