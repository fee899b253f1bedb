// Loss modules inherit nothing: under a half default they stay fp32, and need no loss scaling.
use amp::nn::{BceWithLogitsLoss, CrossEntropyLoss, Linear};
use amp::AmpModule;

#[derive(AmpModule)]
#[amp(default = bf16)]
struct Classifier {
    head: Linear,
    loss: CrossEntropyLoss,
    #[amp(fp32)]
    bce: BceWithLogitsLoss,
}

const _: () = assert!(!<Classifier as AmpModule>::NEEDS_LOSS_SCALING);

fn main() {}
