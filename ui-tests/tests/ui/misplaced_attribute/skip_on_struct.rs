// `skip` belongs on a field; on the struct it is refused.
use amp::AmpModule;

#[derive(AmpModule)]
#[amp(skip)]
struct Block {
    fc: amp::nn::Linear,
}

fn main() {}
