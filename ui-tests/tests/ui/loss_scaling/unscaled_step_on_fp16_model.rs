// A model with an fp16 layer nested two levels down cannot take the unscaled training step.
use amp::nn::Linear;
use amp::AmpModule;

#[derive(AmpModule)]
struct Mlp {
    #[amp(fp16)]
    down: Linear,
}

#[derive(AmpModule)]
#[amp(default = bf16)]
struct Model {
    mlp: Vec<Mlp>,
    head: Linear,
}

fn train(model: &Model, loss: &candle_core::Tensor) -> amp::Result<()> {
    amp::scaler::step_unscaled(model, loss, |_grads| Ok(()))?;
    Ok(())
}

fn main() {}
