// A field that borrows a layer is no module: refused where the struct is defined, not at the first
// use of the model (a lifetime parameter once made its check a bound of the impl).
use amp::nn::Linear;
use amp::AmpModule;

#[derive(AmpModule)]
pub struct Head<'a> {
    fc: Linear,
    shared: &'a Linear,
}

fn main() {}
