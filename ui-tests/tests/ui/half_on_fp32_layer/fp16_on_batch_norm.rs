// BatchNorm keeps its statistics in fp32: asking it for fp16 is refused at its type.
use amp::nn::{BatchNorm, Conv2d};
use amp::AmpModule;

#[derive(AmpModule)]
struct ConvBlock {
    conv: Conv2d,
    #[amp(fp16)]
    norm: BatchNorm,
}

fn main() {}
