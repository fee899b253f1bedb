// Field types that name only the struct's lifetimes or const parameters are checked where the struct
// is defined, as concrete types are (not left to bounds that would make the impl silently not apply):
// these are modules, and take their attributes.
use amp::nn::{Linear, RmsNorm};
use amp::AmpModule;

#[derive(AmpModule)]
struct Stack<const L: usize> {
    #[amp(bf16)]
    layers: [Linear; L],
    norms: [RmsNorm; L],
}

#[derive(AmpModule)]
struct Named<'a> {
    fc: Linear,
    #[amp(skip)]
    name: &'a str,
}

const _: () = assert!(!<Stack<3> as AmpModule>::NEEDS_LOSS_SCALING);

fn main() {
    let named: Option<Named<'_>> = None;
    if let Some(named) = named {
        let _ = (named.fc, named.name);
    }
}
