// Struct parameters may carry any name, the derive's own `__AmpR` included: the parameter the derive
// adds for a precision request takes another name then.
#![allow(non_upper_case_globals)]
use amp::nn::Linear;
use amp::AmpModule;

#[derive(AmpModule)]
#[amp(default = bf16)]
struct Stack<__AmpR, const __AmpR_: usize> {
    head: __AmpR,
    layers: [Linear; __AmpR_],
}

#[derive(AmpModule)]
struct Model {
    stack: Stack<Linear, 2>,
}

#[allow(dead_code)]
fn train(model: &Model, loss: &candle_core::Tensor) -> amp::Result<()> {
    // The unscaled step needs the derived `NoFp16Under` impls, the ones that carry the renamed parameter.
    amp::scaler::step_unscaled(model, loss, |_grads| Ok(()))?;
    Ok(())
}

const _: () = assert!(!<Model as AmpModule>::NEEDS_LOSS_SCALING);

fn main() {}
