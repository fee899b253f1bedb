// A field that is neither a module nor skipped is refused at its type, naming both fixes.
use amp::AmpModule;

#[derive(AmpModule)]
struct Block {
    fc: amp::nn::Linear,
    steps: usize,
}

fn main() {}
