// A misspelt precision on a field is refused, listing the valid spellings.
use amp::AmpModule;

#[derive(AmpModule)]
struct Block {
    #[amp(fp61)]
    fc: amp::nn::Linear,
}

fn main() {}
