// `skip` and a precision on one field contradict each other.
use amp::AmpModule;

#[derive(AmpModule)]
struct Block {
    #[amp(skip, fp16)]
    fc: amp::nn::Linear,
}

fn main() {}
