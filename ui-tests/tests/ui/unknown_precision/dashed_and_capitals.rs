// A precision written with a dash or in capitals is quoted as written, with the spelling to use, and
// the dash is read as part of it (no second error at the `-`).
use amp::nn::Linear;
use amp::AmpModule;

#[derive(AmpModule)]
struct Block {
    #[amp(fp-16)]
    fc1: Linear,
    #[amp(BF16)]
    fc2: Linear,
}

fn main() {}
