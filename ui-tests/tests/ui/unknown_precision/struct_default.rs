// A misspelt precision in the struct default is refused, listing the valid spellings.
use amp::AmpModule;

#[derive(AmpModule)]
#[amp(default = bf61)]
struct Block {
    fc: amp::nn::Linear,
}

fn main() {}
