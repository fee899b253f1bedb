// A half attribute on candle-nn's own Linear (the usual first step of a port): the one error says it is
// no amp module, with no second one claiming it is pinned to fp32.
use amp::AmpModule;

#[derive(AmpModule)]
struct Block {
    #[amp(bf16)]
    fc: candle_nn::Linear,
    #[amp(fp16)]
    head: Vec<candle_nn::Linear>,
}

fn main() {}
