//! Fused multi-tensor optimizers over fp32 master weights: one pass per parameter per step.
//!
//! An optimizer step is bandwidth-bound, so what counts is how often each parameter's bytes cross the
//! memory bus. The fused step reads the gradient in its own dtype (f32, f16 or bf16) and still scaled by
//! the loss scale, unscales it inline, updates the fp32 master and the fp32 state, and writes the half
//! working copy, all in one pass, with no temporary tensor. State is fp32 whatever the parameters are,
//! except Adam's and LAMB's moments and SGD's momentum buffer where asked for in bf16 ([`StateDtype::Bf16`]: half
//! the bytes, rounded stochastically).
//!
//! ```
//! use amp_runtime::nn::{linear, Linear};
//! use amp_runtime::optim::{AdamConfig, FusedAdamW, GroupOptions, OptimParam, ParamGroups};
//! use amp_runtime::scaler::ScalerConfig;
//! use amp_runtime::{AmpConfig, GradScaler, OptLevel};
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//!
//! # fn main() -> amp_runtime::Result<()> {
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let mut model: Vec<Linear> = vec![linear(4, 2, vb.pp("fc"))?]; // any AmpModule
//! amp_runtime::initialize(&mut model, AmpConfig::new(OptLevel::O2, &Device::Cpu))?;
//! let no_decay = GroupOptions { weight_decay: Some(0.0), ..Default::default() };
//! let groups = ParamGroups::from_model(&model)?.with_group(OptimParam::is_bias_or_norm, no_decay);
//! let mut optimizer = FusedAdamW::new(groups, AdamConfig::default())?;
//! let mut scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
//! let loss = model[0].forward(&Tensor::ones((3, 4), DType::F32, &Device::Cpu)?)?.sqr()?.mean_all()?;
//! let report = scaler.step_fused(&loss, &mut optimizer, None)?;
//! assert!(report.applied());
//! # Ok(()) }
//! ```

mod adam;
mod core;
#[cfg(feature = "cuda")]
mod device;
mod driver;
mod lamb;
mod params;
mod sgd;
mod state;
mod state_dtype;
pub(crate) mod validate;

pub use adam::{AdamConfig, FusedAdam, FusedAdamW};
pub use lamb::{FusedLamb, LambConfig};
pub use params::{GroupOptions, OptimParam, ParamGroups};
pub use sgd::{FusedSgd, SgdConfig};
pub use state_dtype::StateDtype;

use candle_core::backprop::GradStore;
use candle_core::DType;

use crate::error::Result;
use crate::scaler::stages::{Findings, OneProcess, StepStages};
use crate::scaler::{GradScaler, SkipReason, StepReport};

/// A fused optimizer: steps fp32 masters from (possibly scaled, possibly half) gradients in one pass.
pub trait FusedOptimizer {
    /// One step with gradients that still carry a factor `1 / inv_grad_scale` (the loss scale, and any
    /// clipping coefficient folded in). The caller has checked that they are finite: a skipped step
    /// must not call this.
    fn step_scaled(&mut self, grads: &GradStore, inv_grad_scale: f32) -> Result<()>;

    /// One step with unscaled gradients.
    fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.step_scaled(grads, 1.0)
    }

    /// One step queued on a CUDA device behind a loss scaler's verdict there: the kernels skip it when
    /// the scaler's flag says a value was not finite and read the gradient factor from device memory,
    /// so nothing waits for the device ([`GradScaler::step_fused_deferred`] calls it). amp's fused
    /// optimizers implement it; the default refuses with [`Error::NotDeferrable`](crate::Error::NotDeferrable).
    fn step_gated(&mut self, grads: &GradStore, gate: &crate::cuda::DeviceGate<'_>) -> Result<()> {
        let _ = (grads, gate);
        Err(crate::Error::NotDeferrable { what: "this optimizer".into() })
    }

    /// The base learning rate.
    fn learning_rate(&self) -> f64;

    /// Sets the base learning rate (for schedulers; groups with their own rate keep it). amp's fused
    /// optimizers refuse a rate that is not finite or is below 0 at their next step
    /// ([`Error::InvalidOptimizerConfig`](crate::Error::InvalidOptimizerConfig)), which then changes
    /// nothing: a NaN rate would turn every weight into NaN on a step reported as applied.
    fn set_learning_rate(&mut self, lr: f64);

    /// The parameters and their groups.
    fn param_groups(&self) -> &ParamGroups;

    /// Bytes of optimizer state (4 a value in f32, 2 in bf16), for memory accounting.
    fn state_bytes(&self) -> usize;
}

pub(crate) use params::fold_split_gradients;

/// The optimizer's parameters that have a gradient in `grads` (indices into its parameters), with it.
#[cfg(feature = "cuda")]
pub(crate) fn present_grads<'g>(
    optimizer: &dyn FusedOptimizer,
    grads: &'g GradStore,
) -> Result<Vec<(usize, &'g candle_core::Tensor)>> {
    driver::with_grads(optimizer.param_groups().params(), None, grads)
}

/// The global L2 norm of the optimizer's gradients after multiplying them by `inv_scale`, in one
/// read-only pass (deterministic; inf or NaN if any gradient is not finite).
pub fn global_grad_norm(optimizer: &dyn FusedOptimizer, grads: &GradStore, inv_scale: f32) -> Result<f32> {
    let params = optimizer.param_groups().params();
    let present = driver::with_grads(params, None, grads)?;
    let tensors: Vec<_> = present.iter().map(|(_, g)| *g).collect();
    crate::passes::global_l2_norm(&tensors, inv_scale)
}

/// Clamps every gradient of the optimizer's parameters into `[-clip_value, clip_value]`, in place, in one
/// multi-tensor pass. `clip_value` is in unscaled units: gradients that still carry a loss scale
/// (`inv_scale = 1 / scale`) are clamped at `clip_value / inv_scale`. Call it after the overflow check:
/// clamping would hide an infinity from it.
pub fn clip_grad_value(
    optimizer: &dyn FusedOptimizer,
    grads: &GradStore,
    clip_value: f32,
    inv_scale: f32,
) -> Result<()> {
    let params = optimizer.param_groups().params();
    let present = driver::with_grads(params, None, grads)?;
    let tensors: Vec<_> = present.iter().map(|(_, g)| *g).collect();
    let threshold = clip_value / inv_scale;
    crate::storage::for_each_batch_mut(&tensors, |s| amp_kernels::clip::clip_by_value(s, threshold))?;
    Ok(())
}

impl GradScaler {
    /// One whole step with a fused optimizer: checks the loss, backward on the scaled loss, one read-only
    /// pass that finds inf/NaN (and the global norm when `max_grad_norm` clips), then the fused step that
    /// unscales (and clips) inline and refreshes the working copies, or nothing at all when a value was
    /// not finite; then the scale update. No separate unscale pass, no f32 copy of half gradients.
    pub fn step_fused(
        &mut self,
        loss: &candle_core::Tensor,
        optimizer: &mut dyn FusedOptimizer,
        max_grad_norm: Option<f32>,
    ) -> Result<StepReport> {
        self.step_fused_staged(loss, optimizer, max_grad_norm, &mut OneProcess)
    }

    /// The fused step's protocol, with `stages` called after backward and for the verdict.
    pub(crate) fn step_fused_staged(
        &mut self,
        loss: &candle_core::Tensor,
        optimizer: &mut dyn FusedOptimizer,
        max_grad_norm: Option<f32>,
        stages: &mut dyn StepStages,
    ) -> Result<StepReport> {
        check_max_grad_norm(max_grad_norm)?;
        optimizer.param_groups().ensure_current()?;
        self.reclaim()?;
        let loss_finite = crate::scaler::loss_value(loss)?.is_finite();
        if !loss_finite && !stages.collective() {
            return self.update(Some(SkipReason::NonFiniteLoss));
        }
        let (mut grads, checked) = crate::gradient_sink::backward_checked(&self.scale_loss(loss)?)?;
        params::fold_split_gradients(optimizer.param_groups().params(), &mut grads)?;
        stages.fold_split_gradients(&mut grads)?;
        self.step_fused_from(grads, &checked, loss_finite, optimizer, max_grad_norm, stages)
    }

    /// One fused step from the gradients accumulated over micro-batches ([`GradScaler::accumulate`]):
    /// the protocol of [`step_fused`](Self::step_fused) from the check on, once for the whole window,
    /// reading the f32 sums. Empties `accumulator`, whether the step applies or skips.
    ///
    /// # Errors
    /// [`Error::NothingAccumulated`](crate::Error::NothingAccumulated) for an empty accumulator;
    /// [`Error::AccumulationInterrupted`](crate::Error::AccumulationInterrupted) when this scaler stepped
    /// inside the window; [`Error::NotAccumulated`](crate::Error::NotAccumulated) for an optimizer
    /// parameter that no model given to `accumulate` holds (each refused before anything changes,
    /// the sums kept); those of [`step_fused`](Self::step_fused).
    pub fn step_fused_accumulated(
        &mut self,
        accumulator: &mut crate::scaler::GradAccumulator,
        optimizer: &mut dyn FusedOptimizer,
        max_grad_norm: Option<f32>,
    ) -> Result<StepReport> {
        self.step_fused_accumulated_staged(accumulator, optimizer, max_grad_norm, &mut OneProcess)
    }

    /// The accumulated step's protocol, with `stages` called for the reduction and the verdict.
    pub(crate) fn step_fused_accumulated_staged(
        &mut self,
        accumulator: &mut crate::scaler::GradAccumulator,
        optimizer: &mut dyn FusedOptimizer,
        max_grad_norm: Option<f32>,
        stages: &mut dyn StepStages,
    ) -> Result<StepReport> {
        check_max_grad_norm(max_grad_norm)?;
        optimizer.param_groups().ensure_current()?;
        self.reclaim()?;
        let params = optimizer.param_groups().params();
        // A parameter without a gradient is refused before the window is taken, so that its sums are
        // kept (as for the accumulator's own refusals); a window to be skipped for its loss is not looked
        // at, as `step_fused` does not look at gradients after a non-finite loss.
        if let Some((sums, loss_finite)) = accumulator.sums() {
            if loss_finite || stages.collective() {
                self.check_gradients_once(params.iter().map(OptimParam::checked), sums)?;
            }
        }
        let updated = params.iter().map(|p| (p.path.as_str(), p.master.as_tensor()));
        // The sums are folded onto the masters already (`accumulate`), each in f32.
        let crate::scaler::Window { grads, loss_finite } = accumulator.take(self.window_mark(), updated)?;
        if !loss_finite && !stages.collective() {
            return self.update(Some(SkipReason::NonFiniteLoss));
        }
        let nothing_checked = crate::gradient_sink::CheckedFinite::default();
        self.step_fused_from(grads, &nothing_checked, loss_finite, optimizer, max_grad_norm, stages)
    }

    /// The fused protocol after backward: `grads` (still scaled, split gradients folded) are reduced,
    /// checked (except those in `checked`), and stepped or skipped; then the scale update.
    fn step_fused_from(
        &mut self,
        grads: GradStore,
        checked: &crate::gradient_sink::CheckedFinite,
        loss_finite: bool,
        optimizer: &mut dyn FusedOptimizer,
        max_grad_norm: Option<f32>,
        stages: &mut dyn StepStages,
    ) -> Result<StepReport> {
        let inv_scale = 1.0 / self.scale();
        let params = optimizer.param_groups().params();
        self.refuse_unscaled_fp16(|| first_fp16(params, &grads))?;
        self.check_gradients_once(params.iter().map(OptimParam::checked), &grads)?;
        let present = driver::with_grads(params, None, &grads)?;
        let tensors: Vec<_> = present.iter().map(|(_, g)| *g).collect();
        let path = |index: usize| params[present[index].0].path.as_str();
        let own = stages.reduce(&grads, &tensors, &path)?;
        // One read pass: the global norm when clipping (inf or NaN when any value is), else the check.
        // The parameter to blame is looked up only when a step is skipped.
        let norm = match max_grad_norm {
            Some(_) => Some(stages.global_norm(crate::passes::global_l2_norm(&tensors, inv_scale)?)?),
            None => None,
        };
        let first_bad = match norm {
            Some(norm) if norm.is_finite() => None,
            // Gradients checked when deposited are skipped, unless ranks have since summed theirs in.
            _ if !stages.collective() => {
                let unchecked: Vec<usize> =
                    (0..tensors.len()).filter(|&i| !checked.contains(tensors[i])).collect();
                let rest: Vec<_> = unchecked.iter().map(|&i| tensors[i]).collect();
                crate::passes::find_non_finite(&rest)?.map(|i| unchecked[i])
            }
            _ => crate::passes::find_non_finite(&tensors)?,
        };
        let reduced = match (first_bad, norm) {
            (Some(index), _) => Some(path(index).to_string()),
            // Every value finite, their norm not: as much an overflow as an infinite element.
            (None, Some(norm)) if !norm.is_finite() => {
                Some("(the global gradient norm overflows f32)".to_string())
            }
            _ => None,
        };
        if let Some(reason) = stages.verdict(Findings { loss_finite, own, reduced })? {
            return self.update(Some(reason));
        }
        let factor = match (norm, max_grad_norm) {
            (Some(norm), Some(max_norm)) => inv_scale * amp_kernels::clip::clip_coefficient(norm, max_norm),
            _ => inv_scale,
        };
        optimizer.step_scaled(&grads, factor)?;
        stages.after_step()?;
        self.update(None)
    }
}

/// Where a step's computation was fp16, for [`GradScaler::refuse_unscaled_fp16`]: a parameter stored
/// in fp16 (an O2 working copy or an O3 parameter) or read by a layer that computes in fp16 (O1), else
/// any fp16 gradient of the graph (an fp16 op outside amp's layers).
pub(crate) fn first_fp16(params: &[OptimParam], grads: &GradStore) -> Option<String> {
    if let Some(p) = params.iter().find(|p| p.trainable.dtype() == DType::F16) {
        return Some(format!("`{}` is stored in fp16", p.path));
    }
    if let Some(p) = params.iter().find(|p| p.link.as_ref().is_some_and(|(link, _)| link.computes_in_fp16()))
    {
        return Some(format!("the layer of `{}` computes in fp16", p.path));
    }
    let fp16 = grads.get_ids().filter_map(|id| grads.get_id(*id)).any(|g| g.dtype() == DType::F16);
    fp16.then(|| "gradients of its graph are fp16".to_string())
}

/// Refuses a clipping threshold that is not a positive finite number, before anything runs: NaN would
/// make every update NaN, and a negative threshold would reverse the step.
pub(crate) fn check_max_grad_norm(max_grad_norm: Option<f32>) -> Result<()> {
    match max_grad_norm {
        Some(max) if !(max.is_finite() && max > 0.0) => Err(crate::Error::InvalidOptimizerConfig {
            reason: format!(
                "max_grad_norm {max}: the gradient-clipping threshold must be a positive finite number \
                 (1.0 is usual), or None for no clipping"
            ),
        }),
        _ => Ok(()),
    }
}
