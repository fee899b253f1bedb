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

use std::collections::HashSet;

use amp_kernels::GradSliceMut;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, TensorId};

use super::GradScaler;
use crate::error::{Error, Result};
use crate::{AmpModule, AmpModuleExt};

/// The f32 sums of the gradients of the micro-batches seen since the last step
/// ([`GradScaler::accumulate`]). Hand it to [`GradScaler::step_fused_accumulated`] (or
/// [`GradScaler::step_accumulated`], or the data-parallel step of the same name) for the one step;
/// the step empties it, whether it applies or skips. A step refused before it starts (an empty
/// window, an interrupted one, an optimizer parameter the window does not cover) keeps the sums.
#[derive(Debug, Default)]
pub struct GradAccumulator {
    /// The sums, f32, keyed by each parameter's master (or the parameter itself where it has none);
    /// `None` before the first micro-batch.
    sums: Option<GradStore>,
    /// The masters of the parameters of the models given to `accumulate` in this window, with or
    /// without a gradient.
    covered: HashSet<TensorId>,
    /// Micro-batches summed.
    micro_batches: usize,
    /// False once a micro-batch's loss was inf or NaN.
    loss_finite: bool,
    /// The scaler's loss scale and step count at the window's first micro-batch.
    scale: f32,
    scaler_steps: u64,
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
    /// The sum grows in place with the window's later micro-batches: copy it to keep this value.
    pub fn gradient(&self, master: &Tensor) -> Option<&Tensor> {
        self.sums.as_ref()?.get(master)
    }

    /// The sums, if any micro-batch was added, and whether every micro-batch's loss was finite (a window
    /// with a non-finite loss is skipped before its gradients are looked at).
    pub(crate) fn sums(&self) -> Option<(&GradStore, bool)> {
        self.sums.as_ref().map(|sums| (sums, self.loss_finite))
    }

    /// The sums a micro-batch's pass may add gradients into in place ([`gradient_sink::backward_adding`]):
    /// those on the CPU, f32 and contiguous (all of them after the first micro-batch, on a CPU), keyed
    /// by the variable they sum the gradients of.
    ///
    /// [`gradient_sink::backward_adding`]: crate::gradient_sink::backward_adding
    fn running_sums(&self) -> crate::gradient_sink::Sums {
        let Some(sums) = &self.sums else { return Default::default() };
        sums.get_ids()
            .filter_map(|&id| sums.get_id(id).map(|sum| (id, sum)))
            .filter(|(_, sum)| sum.device().is_cpu() && sum.dtype() == DType::F32 && sum.is_contiguous())
            .map(|(id, sum)| (id, sum.clone()))
            .collect()
    }

    /// Bytes the sums hold.
    pub fn bytes(&self) -> usize {
        let Some(sums) = &self.sums else { return 0 };
        sums.get_ids()
            .filter_map(|id| sums.get_id(*id))
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }

    /// The window's interruption, if the scaler (at `scale`, after `steps` steps) stepped or was
    /// restored since the window's first micro-batch.
    fn interrupted(&self, scale: f32, steps: u64) -> Option<Error> {
        let moved = self.scale.to_bits() != scale.to_bits() || self.scaler_steps != steps;
        (!self.is_empty() && moved).then(|| Error::AccumulationInterrupted {
            steps: steps.wrapping_sub(self.scaler_steps),
            from: self.scale,
            to: scale,
        })
    }

    /// Adds the gradients of `keys` (the model's parameters: masters, and variables without one) from
    /// one micro-batch's backward pass, already folded onto the masters, in f32. The store may hold
    /// more (candle also stores the gradient of a binary op's operand that is data); those are not
    /// kept. An error empties the accumulator: its sums could be partly added.
    fn add(&mut self, grads: GradStore, keys: &[&Tensor], loss_finite: bool) -> Result<()> {
        let added = self.add_sums(&grads, keys);
        if added.is_err() {
            *self = GradAccumulator::default();
        }
        added?;
        self.covered.extend(keys.iter().map(|k| k.id()));
        self.loss_finite = loss_finite && (self.is_empty() || self.loss_finite);
        self.micro_batches += 1;
        Ok(())
    }

    fn add_sums(&mut self, grads: &GradStore, keys: &[&Tensor]) -> Result<()> {
        let sums = self.sums.get_or_insert_with(GradStore::default);
        // On the CPU, the window's sums grow in place: one pass over each, no new tensor.
        let (mut targets, mut sources) = (Vec::new(), Vec::new());
        for &key in keys {
            let Some(grad) = grads.get(key) else { continue };
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
        add_in_place(&targets, &sources)
    }

    /// [`Error::NotAccumulated`] for the first of `params` (paths and masters) that no model given to
    /// `accumulate` in this window holds.
    pub(crate) fn check_covers<'p>(
        &self,
        mut params: impl Iterator<Item = (&'p str, &'p Tensor)>,
    ) -> Result<()> {
        match params.find(|(_, master)| !self.covered.contains(&master.id())) {
            Some((path, _)) => Err(Error::NotAccumulated { path: path.to_string() }),
            None => Ok(()),
        }
    }

    /// Empties the accumulator for a step of a scaler at `scale` after `steps` steps, whose optimizer
    /// updates `updated` (masters); on an error it keeps its sums.
    pub(crate) fn take<'p>(
        &mut self,
        (scale, steps): (f32, u64),
        updated: impl Iterator<Item = (&'p str, &'p Tensor)>,
    ) -> Result<Window> {
        if self.is_empty() {
            return Err(Error::NothingAccumulated);
        }
        if let Some(interrupted) = self.interrupted(scale, steps) {
            return Err(interrupted);
        }
        self.check_covers(updated)?;
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
    /// outside `model` are not kept: give the model that holds every parameter the optimizer updates).
    /// On the CPU, once a parameter has a sum, amp's `Linear` adds an f32 weight's gradient into that
    /// sum inside the product, without writing the gradient first.
    /// Divide each micro-batch's loss by the number of micro-batches when the step should see the mean
    /// over the whole batch, as a single batch's mean loss would give. Nothing is stepped and the scale
    /// does not move: call [`step_fused_accumulated`](Self::step_fused_accumulated) (or
    /// [`step_accumulated`](Self::step_accumulated)) once the window is complete.
    ///
    /// A micro-batch whose loss is inf or NaN is still backpropagated and marks the window: its step
    /// is skipped as one with a non-finite loss.
    ///
    /// # Errors
    /// [`Error::AccumulationInterrupted`] when this scaler stepped or was restored since the window's
    /// first micro-batch (nothing is added); [`Error::Unsettled`] while deferred steps are queued;
    /// candle's errors (the accumulator is then emptied: its sums could be partly added).
    pub fn accumulate<M: AmpModule + ?Sized>(
        &mut self,
        model: &M,
        loss: &Tensor,
        accumulator: &mut GradAccumulator,
    ) -> Result<()> {
        self.reclaim()?;
        self.expect_settled("accumulate")?;
        let (scale, steps) = (self.scale(), self.state().steps);
        if let Some(interrupted) = accumulator.interrupted(scale, steps) {
            return Err(interrupted);
        }
        self.refuse_unscaled_fp16(|| super::first_fp16_layer(model))?;
        let value = super::loss_value(loss)?;
        // The sums so far, given to the pass: amp's Linear adds its weight's gradient into its sum
        // in the product itself. An error after that leaves sums partly added: the window is emptied.
        let passed =
            crate::gradient_sink::backward_adding(&self.scale_loss(loss)?, accumulator.running_sums())
                .and_then(|mut grads| crate::grads_to_masters(model, &mut grads).map(|()| grads));
        let grads = match passed {
            Ok(grads) => grads,
            Err(e) => {
                *accumulator = GradAccumulator::default();
                return Err(e);
            }
        };
        // The masters, each once: a variable shared by two layers (tied weights) is summed once.
        let mut masters = Vec::new();
        crate::module::for_each_unique_param(model, |_, _, _, param| {
            masters.push(param.master().as_tensor().clone());
        });
        let keys: Vec<&Tensor> = masters.iter().collect();
        if accumulator.is_empty() {
            (accumulator.scale, accumulator.scaler_steps) = (scale, steps);
        }
        accumulator.add(grads, &keys, value.is_finite())
    }

    /// The scale and step count an accumulation window checks ([`GradAccumulator::take`]).
    pub(crate) fn window_mark(&self) -> (f32, u64) {
        (self.scale(), self.state().steps)
    }

    /// One step of a user's optimizer from the accumulated gradients, as [`step`](Self::step) does
    /// from one batch's: unscale and check in f32, then `apply` (whose store holds the f32 sums keyed by
    /// the masters; a parameter without a master, O3, gets its sum rounded once to its own dtype) and
    /// the working-copy refresh, or a skip that changes no weight; then the scale update. Empties
    /// `accumulator`.
    ///
    /// # Errors
    /// [`Error::NothingAccumulated`] for an empty accumulator; [`Error::AccumulationInterrupted`];
    /// [`Error::NotAccumulated`] when the window's models do not hold a parameter of `model`; those of
    /// [`step`](Self::step).
    pub fn step_accumulated<M: AmpModule + ?Sized>(
        &mut self,
        model: &M,
        accumulator: &mut GradAccumulator,
        apply: impl FnOnce(&mut GradStore) -> Result<()>,
    ) -> Result<crate::scaler::StepReport> {
        self.reclaim()?;
        let params = model.unique_params();
        // `unscale` would refuse a half gradient without an fp32 master (O3 fp16) at a scale other than
        // 1: refused here, before the window is taken, so that its sums are kept.
        if accumulator.sums().is_some_and(|(_, loss_finite)| loss_finite) {
            let fp16_gradients = params.iter().filter_map(|(path, p)| {
                let master = p.master().as_tensor();
                (master.dtype() == DType::F16 && accumulator.gradient(master).is_some())
                    .then_some(path.as_str())
            });
            self.refuse_fp16_unscale(fp16_gradients)?;
        }
        let updated = params.iter().map(|(path, p)| (path.as_str(), p.master().as_tensor()));
        let Window { mut grads, loss_finite } = accumulator.take(self.window_mark(), updated)?;
        if !loss_finite {
            return self.update(Some(super::SkipReason::NonFiniteLoss));
        }
        for (_, param) in &params {
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
