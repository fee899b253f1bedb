//! Moving gradients between working copies and fp32 masters, for optimizers that update masters
//! (candle-nn's, or any that takes a `GradStore`).

use candle_core::backprop::GradStore;
use candle_core::DType;

use crate::error::Result;
use crate::{AmpModule, AmpModuleExt};

/// Re-keys the gradients of O2 half working copies onto their fp32 masters, widened to f32, so that an
/// optimizer stepping the masters (`model.master_vars()`) sees them. Parameters without a separate
/// master keep their gradient where it is.
///
/// This widening pass is what the fused optimizers of `amp::optim` avoid; it is here so that any candle
/// optimizer works with O2 models.
pub fn grads_to_masters<M: AmpModule + ?Sized>(model: &M, grads: &mut GradStore) -> Result<()> {
    for (_, param) in model.named_params() {
        if let Some(working) = param.working() {
            if let Some(grad) = grads.remove(working.as_tensor()) {
                grads.insert(param.master().as_tensor(), grad.to_dtype(DType::F32)?);
            }
        }
    }
    Ok(())
}

/// Copies every fp32 master into its half working copy, after an optimizer updated the masters.
pub fn refresh_working_copies<M: AmpModule + ?Sized>(model: &M) -> Result<()> {
    for (_, param) in model.named_params() {
        param.refresh_working()?;
    }
    Ok(())
}
