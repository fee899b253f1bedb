// candle-nn's own Linear carries no precision; amp asks for its layer, or `#[amp(skip)]`.
use amp::AmpModule;

#[derive(AmpModule)]
struct Block {
    fc: Vec<candle_nn::Linear>,
}

fn main() {}
