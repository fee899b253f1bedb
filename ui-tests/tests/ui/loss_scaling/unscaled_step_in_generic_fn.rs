// A training loop generic over the model: `step_unscaled` needs the bound that rules out fp16 layers,
// and the error's last note names it.
use amp::AmpModule;

fn train<M: AmpModule>(model: &M, loss: &candle_core::Tensor) -> amp::Result<()> {
    amp::scaler::step_unscaled(model, loss, |_grads| Ok(()))?;
    Ok(())
}

fn train_bounded<M>(model: &M, loss: &candle_core::Tensor) -> amp::Result<()>
where
    M: AmpModule + amp::module::NoFp16Under<amp::module::Inherit>,
{
    amp::scaler::step_unscaled(model, loss, |_grads| Ok(()))?;
    Ok(())
}

fn main() {}
