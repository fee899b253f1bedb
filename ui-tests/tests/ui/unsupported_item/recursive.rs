// A module that holds itself (a tree of blocks) has no compile-time precision plan: the field is
// refused where it is written, with what to write instead (it was a cycle error at the derive line).
use amp::AmpModule;

#[derive(AmpModule)]
struct Tree {
    fc: amp::nn::Linear,
    children: Vec<Tree>,
}

#[derive(AmpModule)]
struct Chain {
    fc: amp::nn::Linear,
    next: Option<Box<Self>>,
}

fn main() {}
