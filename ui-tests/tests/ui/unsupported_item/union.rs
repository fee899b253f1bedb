// Unions are refused: their fields overlap.
use amp::AmpModule;

#[derive(AmpModule)]
union Bits {
    a: u32,
    b: f32,
}

fn main() {}
