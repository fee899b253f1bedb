//! Gradient accumulation: the gradients of several micro-batches summed in f32 for one optimizer step.
//!
//! A large batch that does not fit in memory is split into micro-batches whose gradients are summed
//! before one step (PyTorch's "gradient accumulation" recipe). Under mixed precision the sum is where
//! precision is lost: a half working copy's gradient summed in its own dtype stops growing once the
//! sum is large against the term (a bf16 sum of 0.01s stops at 4, an fp16 one at 32), and candle's
//! store adds in the dtype it is given. [`GradAccumulator`] widens each micro-batch's gradients to f32
//! (exact) and sums them there, keyed by each parameter's fp32 master, so the step sees the sum that
//! a single batch of all the micro-batches would have given, rounded in f32 only.
//!
//! Every micro-batch is backpropagated at the same loss scale: the scale moves only when the window
//! steps. A non-finite value in any micro-batch skips the whole step, as it would with one batch.
//! The sums hold one f32 value per parameter element (as PyTorch's fp32 `.grad` does); each
//! micro-batch adds to them with one elementwise pass, in place on the CPU (no tensor per parameter
//! per micro-batch; on a GPU, candle's add). With `DataParallel`, the sums travel once per
//! window ([`DataParallel::step_fused_accumulated`](crate::distributed::DataParallel::step_fused_accumulated)).
//!
//! ```
//! use amp_runtime::nn::{linear, Linear};
//! use amp_runtime::optim::{AdamConfig, FusedAdamW, ParamGroups};
//! use amp_runtime::scaler::{GradAccumulator, ScalerConfig};
//! use amp_runtime::{AmpConfig, GradScaler, OptLevel, Precision};
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//!
//! # fn main() -> amp_runtime::Result<()> {
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let mut model: Vec<Linear> = vec![linear(4, 2, vb.pp("fc"))?];
//! let config = AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Fp16);
//! amp_runtime::initialize(&mut model, config)?;
//! let mut optimizer = FusedAdamW::new(ParamGroups::from_model(&model)?, AdamConfig::default())?;
//! let mut scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
//! let mut accumulator = GradAccumulator::new();
//! let micro_batches = 4;
//! for _ in 0..micro_batches {
//!     let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
//!     let loss = model[0].forward(&x)?.sqr()?.mean_all()?;
//!     // The mean over the whole batch: each micro-batch's mean, divided by their number.
//!     scaler.accumulate(&model, &(loss / micro_batches as f64)?, &mut accumulator)?;
//! }
//! let report = scaler.step_fused_accumulated(&mut accumulator, &mut optimizer, Some(1.0))?;
//! assert!(report.applied() && accumulator.is_empty());
//! # Ok(()) }
//! ```

use amp_kernels::GradSliceMut;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};

use super::GradScaler;
use crate::error::{Error, Result};
use crate::{AmpModule, AmpModuleExt};

/// The f32 sums of the gradients of the micro-batches seen since the last step
/// ([`GradScaler::accumulate`]). Hand it to [`GradScaler::step_fused_accumulated`] (or
/// [`GradScaler::step_accumulated`], or the data-parallel step of the same name) for the one step;
/// the step empties it, whether it applies or skips (a step refused for a moved scale keeps the sums).
#[derive(Debug, Default)]
pub struct GradAccumulator {
    /// The sums, f32, keyed by each parameter's master (or the parameter itself where it has none);
    /// `None` before the first micro-batch.
    sums: Option<GradStore>,
    /// Micro-batches summed.
    micro_batches: usize,
    /// False once a micro-batch's loss was inf or NaN.
    loss_finite: bool,
    /// The loss scale every micro-batch was backpropagated at.
    scale: f32,
}

/// A window of micro-batches taken for a step.
pub(crate) struct Window {
    pub grads: GradStore,
    pub loss_finite: bool,
}

impl GradAccumulator {
    /// An empty accumulator.
    pub fn new() -> Self {
        Self::default()
    }

    /// Micro-batches summed since the last step.
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// True before the first micro-batch of a window.
    pub fn is_empty(&self) -> bool {
        self.micro_batches == 0
    }

    /// The summed gradient (f32, still multiplied by the loss scale) of the parameter whose master is
    /// `master` (the variable itself for a parameter without one: [`Param::master`](crate::Param::master)).
    pub fn gradient(&self, master: &Tensor) -> Option<&Tensor> {
        self.sums.as_ref()?.get(master)
    }

    /// Bytes the sums hold.
    pub fn bytes(&self) -> usize {
        let Some(sums) = &self.sums else { return 0 };
        sums.get_ids()
            .filter_map(|id| sums.get_id(*id))
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }

    /// Adds the gradients of `keys` (the model's parameters: masters, and variables without one) from
    /// one micro-batch's backward pass at `scale`, already folded onto the masters, in f32. The store
    /// may hold more (candle also stores the gradient of a binary op's operand that is data); those
    /// are not kept.
    fn add(&mut self, grads: GradStore, keys: &[&Tensor], loss_finite: bool, scale: f32) -> Result<()> {
        let present: Vec<(&Tensor, &Tensor)> =
            keys.iter().filter_map(|&key| grads.get(key).map(|grad| (key, grad))).collect();
        let sums = self.sums.get_or_insert_with(GradStore::default);
        // On the CPU, the window's sums grow in place: one pass over each, no new tensor.
        let (mut targets, mut sources) = (Vec::new(), Vec::new());
        for (key, grad) in present {
            match sums.get(key) {
                None => {
                    sums.insert(key, owned_f32(grad)?);
                }
                Some(sum) if sum.device().is_cpu() && grad.device().is_cpu() => {
                    targets.push(sum.clone());
                    sources.push(grad.contiguous()?);
                }
                Some(sum) => {
                    let total = (sum + grad.to_dtype(DType::F32)?)?;
                    sums.insert(key, total);
                }
            }
        }
        add_in_place(&targets, &sources)?;
        self.loss_finite = loss_finite && (self.is_empty() || self.loss_finite);
        self.micro_batches += 1;
        self.scale = scale;
        Ok(())
    }

    /// Empties the accumulator for a step at `scale`; on an error it keeps its sums.
    pub(crate) fn take(&mut self, scale: f32) -> Result<Window> {
        if self.is_empty() {
            return Err(Error::NothingAccumulated);
        }
        if self.scale.to_bits() != scale.to_bits() {
            return Err(Error::AccumulationScaleChanged { from: self.scale, to: scale });
        }
        let taken = std::mem::take(self);
        let grads = taken.sums.ok_or(Error::NothingAccumulated)?;
        Ok(Window { grads, loss_finite: taken.loss_finite })
    }
}

/// A gradient as the start of a window's sum: f32, contiguous, in memory of its own (the sums grow in
/// place, so they must share no storage with a tensor that something else reads).
fn owned_f32(grad: &Tensor) -> Result<Tensor> {
    Ok(match grad.dtype() {
        DType::F32 => grad.force_contiguous()?,
        // A new tensor, written contiguously.
        _ => grad.to_dtype(DType::F32)?,
    })
}

/// `targets[i] += sources[i]` widened to f32, in place (CPU tensors; the targets f32 sums of their own).
fn add_in_place(targets: &[Tensor], sources: &[Tensor]) -> Result<()> {
    let targets: Vec<&Tensor> = targets.iter().collect();
    let sources: Vec<&Tensor> = sources.iter().collect();
    crate::storage::with_slices(&sources, |sources| {
        let mut sources = sources.iter();
        crate::storage::for_each_batch_mut(&targets, |targets| {
            for target in targets.iter_mut() {
                match (target, sources.next()) {
                    (GradSliceMut::F32(sum), Some(&grad)) => amp_kernels::convert::add_widened(grad, sum),
                    _ => return Err(Error::Internal { what: "a gradient sum that is not f32".into() }),
                }
            }
            Ok(())
        })
    })??
    .into_iter()
    .collect()
}

impl GradScaler {
    /// Backpropagates one micro-batch's loss at the current loss scale and adds the gradients of
    /// `model`'s parameters, widened to f32, into `accumulator`, keyed by their fp32 masters (variables
    /// outside `model` are not kept). Divide each micro-batch's loss
    /// by the number of micro-batches when the step should see the mean over the whole batch, as a
    /// single batch's mean loss would give. Nothing is stepped and the scale does not move: call
    /// [`step_fused_accumulated`](Self::step_fused_accumulated) (or
    /// [`step_accumulated`](Self::step_accumulated)) once the window is complete.
    ///
    /// A micro-batch whose loss is inf or NaN is still backpropagated and marks the window: its step
    /// is skipped as one with a non-finite loss.
    ///
    /// # Errors
    /// [`Error::AccumulationScaleChanged`] when the scale moved since the window's first micro-batch
    /// (another step of this scaler ran in between; nothing is added); [`Error::Unsettled`] while
    /// deferred steps are queued; candle's errors.
    pub fn accumulate<M: AmpModule + ?Sized>(
        &mut self,
        model: &M,
        loss: &Tensor,
        accumulator: &mut GradAccumulator,
    ) -> Result<()> {
        self.reclaim()?;
        self.expect_settled("accumulate")?;
        let scale = self.scale();
        if !accumulator.is_empty() && accumulator.scale.to_bits() != scale.to_bits() {
            return Err(Error::AccumulationScaleChanged { from: accumulator.scale, to: scale });
        }
        let value = loss.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
        let mut grads = crate::gradient_sink::backward(&self.scale_loss(loss)?)?;
        crate::grads_to_masters(model, &mut grads)?;
        let params = model.named_params();
        let keys: Vec<&Tensor> = params.iter().map(|(_, p)| p.master().as_tensor()).collect();
        accumulator.add(grads, &keys, value.is_finite(), scale)
    }

    /// One step of a user's optimizer from the accumulated gradients, as [`step`](Self::step) does
    /// from one batch's: unscale and check in f32, then `apply` (whose store holds the f32 sums keyed by
    /// the masters; a parameter without a master, O3, gets its sum rounded once to its own dtype) and
    /// the working-copy refresh, or a skip that changes no weight; then the scale update. Empties
    /// `accumulator`.
    ///
    /// # Errors
    /// [`Error::NothingAccumulated`] for an empty accumulator; [`Error::AccumulationScaleChanged`];
    /// those of [`step`](Self::step).
    pub fn step_accumulated<M: AmpModule + ?Sized>(
        &mut self,
        model: &M,
        accumulator: &mut GradAccumulator,
        apply: impl FnOnce(&mut GradStore) -> Result<()>,
    ) -> Result<crate::scaler::StepReport> {
        self.reclaim()?;
        let Window { mut grads, loss_finite } = accumulator.take(self.scale())?;
        if !loss_finite {
            return self.update(Some(super::SkipReason::NonFiniteLoss));
        }
        for (_, param) in model.named_params() {
            let var = param.master().as_tensor();
            if var.dtype() != DType::F32 {
                if let Some(sum) = grads.remove(var) {
                    grads.insert(var, sum.to_dtype(var.dtype())?);
                }
            }
        }
        self.apply_gradients(model, grads, apply)
    }
}
