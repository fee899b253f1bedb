// Precisions are words, not strings: `#[amp("fp16")]` on a field is refused with the unquoted form.
use amp::AmpModule;

#[derive(AmpModule)]
struct Block {
    #[amp("fp16")]
    fc: amp::nn::Linear,
}

fn main() {}
