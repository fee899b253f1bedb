// A generic field requires a module type argument; using the struct with `f32` there is refused where
// the module is used.
use amp::AmpModule;

#[derive(AmpModule)]
struct Block<A> {
    attn: A,
}

fn train<M: AmpModule>(_model: &M) {}

fn main() {
    train(&Block { attn: 0.5f32 });
}
