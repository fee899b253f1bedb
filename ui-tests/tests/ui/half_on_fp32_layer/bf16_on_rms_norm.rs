// bf16 is a half precision too: `#[amp(bf16)]` on an RmsNorm is refused, also under a type alias.
use amp::nn::RmsNorm;
use amp::AmpModule;

type Norm = RmsNorm;

#[derive(AmpModule)]
struct Block {
    #[amp(bf16)]
    norm: Norm,
}

fn main() {}
