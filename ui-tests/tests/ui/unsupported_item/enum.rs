// Enums have no static plan: refused with what to do instead.
use amp::AmpModule;

#[derive(AmpModule)]
enum Head {
    Linear(amp::nn::Linear),
    Embedding(amp::nn::Embedding),
}

fn main() {}
