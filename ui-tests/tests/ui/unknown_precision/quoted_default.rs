// Precisions are words, not strings: `default = "bf16"` is refused with the unquoted form.
use amp::AmpModule;

#[derive(AmpModule)]
#[amp(default = "bf16")]
struct Block {
    fc: amp::nn::Linear,
}

fn main() {}
