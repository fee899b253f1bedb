// A struct default of fp16 reaching an unannotated Linear inside a nested struct needs a scaler too.
use amp::nn::Linear;
use amp::AmpModule;

#[derive(AmpModule)]
struct Mlp {
    up: Linear,
}

#[derive(AmpModule)]
#[amp(default = fp16)]
struct Model {
    mlp: Mlp,
}

fn train(model: &Model, loss: &candle_core::Tensor) -> amp::Result<()> {
    amp::scaler::step_unscaled(model, loss, |_grads| Ok(()))?;
    Ok(())
}

fn main() {}
