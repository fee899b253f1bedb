// `#[amp(half)]` on a container of norms is refused: the container is half-safe only if its items are.
use amp::nn::LayerNorm;
use amp::AmpModule;

#[derive(AmpModule)]
struct Stack {
    #[amp(half)]
    norms: Vec<LayerNorm>,
}

fn main() {}
