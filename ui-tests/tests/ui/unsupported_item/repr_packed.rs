// A packed struct's fields may be unaligned, and amp visits each layer through a reference: refused at
// `packed`, with why (it was rustc's E0793 at the derive line, about references the user never wrote).
use amp::AmpModule;

#[derive(AmpModule)]
#[repr(C, packed)]
struct Packed {
    fc: amp::nn::Linear,
}

fn main() {}
