//! Moving gradients between working copies and fp32 masters, for optimizers that update masters
//! (candle-nn's, or any that takes a `GradStore`), and finding a parameter's gradient wherever backward
//! put it.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::error::{Error, Result};
use crate::{AmpModule, Cursor, GradientRoute, Layer, LayerSite, Param};

/// Re-keys the gradients of O2 half working copies onto their fp32 masters, widened to f32, so that an
/// optimizer stepping the masters (`model.master_vars()`) sees them. A master that already has a
/// gradient (a product on amp's CPU GEMM read it: [`GradientRoute::Master`]) gets the working copy's
/// added to it. Parameters without a separate master keep their gradient where it is.
///
/// This widening pass is what the fused optimizers of `amp::optim` avoid; it is here so that any candle
/// optimizer works with O2 models.
pub fn grads_to_masters<M: AmpModule + ?Sized>(model: &M, grads: &mut GradStore) -> Result<()> {
    for param in unique(model) {
        if let Some(working) = param.working() {
            fold(grads, working, param.master())?;
        }
    }
    Ok(())
}

/// Sets the [`GradientRoute`] of every parameter of `model`.
pub fn set_gradient_route<M: AmpModule + ?Sized>(model: &mut M, route: GradientRoute) {
    model.visit_mut(&mut Cursor::new(), &mut |_: LayerSite<'_>, layer: &mut dyn Layer| {
        for (_, param) in layer.params_mut() {
            param.set_gradient_route(route);
        }
    });
}

/// Moves the gradient of `working` (if any) onto `master`, widened to f32 and added to the master's own.
pub(crate) fn fold(grads: &mut GradStore, working: &Var, master: &Var) -> Result<()> {
    if working.as_tensor().id() == master.as_tensor().id() {
        return Ok(());
    }
    if let Some(grad) = grads.remove(working.as_tensor()) {
        let grad = grad.to_dtype(DType::F32)?;
        let sum = match grads.get(master.as_tensor()) {
            Some(own) => (own + grad)?,
            None => grad,
        };
        grads.insert(master.as_tensor(), sum);
    }
    Ok(())
}

/// The gradient of the parameter `path` (trainable variable and master, the same variable when it has
/// no separate master): keyed by either, never both.
pub(crate) fn gradient<'g>(
    grads: &'g GradStore,
    path: &str,
    trainable: &Var,
    master: &Var,
) -> Result<Option<&'g Tensor>> {
    let of_trainable = grads.get(trainable.as_tensor());
    if trainable.as_tensor().id() == master.as_tensor().id() {
        return Ok(of_trainable);
    }
    match (of_trainable, grads.get(master.as_tensor())) {
        (Some(_), Some(_)) => Err(Error::SplitGradient { path: path.to_string() }),
        (of_trainable, of_master) => Ok(of_master.or(of_trainable)),
    }
}

/// Copies every fp32 master into its half working copy, after an optimizer updated the masters.
pub fn refresh_working_copies<M: AmpModule + ?Sized>(model: &M) -> Result<()> {
    for param in unique(model) {
        param.refresh_working()?;
    }
    Ok(())
}

/// Every parameter of `model` once (tied weights once), without their paths.
fn unique<M: AmpModule + ?Sized>(model: &M) -> Vec<Param> {
    let mut params = Vec::new();
    crate::module::for_each_unique_param(model, |_, _, _, param| params.push(param.clone()));
    params
}
