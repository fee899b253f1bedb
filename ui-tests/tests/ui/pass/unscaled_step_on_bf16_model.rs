// A bf16/fp32 model (even with a norm inheriting an fp16 default) may take the unscaled step.
use amp::nn::{LayerNorm, Linear};
use amp::AmpModule;

#[derive(AmpModule)]
struct Block {
    #[amp(bf16)]
    fc: Linear,
    #[amp(fp32)]
    head: Linear,
}

#[derive(AmpModule)]
#[amp(default = fp16)]
struct Norms {
    norm: LayerNorm,
}

#[allow(dead_code)]
fn train(model: &Block, norms: &Norms, loss: &candle_core::Tensor) -> amp::Result<()> {
    amp::scaler::step_unscaled(model, loss, |_grads| Ok(()))?;
    amp::scaler::step_unscaled(norms, loss, |_grads| Ok(()))?;
    Ok(())
}

const _: () = assert!(!<Block as AmpModule>::NEEDS_LOSS_SCALING);
const _: () = assert!(!<Norms as AmpModule>::NEEDS_LOSS_SCALING);

fn main() {}
