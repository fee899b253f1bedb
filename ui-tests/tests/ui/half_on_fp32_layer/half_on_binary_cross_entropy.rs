// Plain binary cross-entropy in half precision is banned (Apex and autocast ban it too): the error names
// the logits form to use instead.
use amp::nn::{BinaryCrossEntropyLoss, Linear};
use amp::AmpModule;

#[derive(AmpModule)]
struct Classifier {
    head: Linear,
    #[amp(half)]
    loss: BinaryCrossEntropyLoss,
}

fn main() {}
