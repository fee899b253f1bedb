//! Loss scaling: keeps fp16 gradients out of the underflow range and skips steps whose gradients
//! overflowed, so that nothing non-finite ever reaches the weights.
//!
//! The step protocol ([`GradScaler::step`] does all of it):
//! 1. check the loss is finite (a NaN loss is the model's problem, reported as such, not fp16's);
//! 2. backward on `loss * scale`;
//! 3. unscale every gradient in place and look for inf/NaN in the same pass (one multi-tensor kernel);
//! 4. apply the optimizer, or skip it, leaving every weight and state bit-identical;
//! 5. update the scale (back off on overflow, grow after `growth_interval` clean steps).
//!
//! Models without fp16 (bf16 or fp32 only) need none of this: [`GradScaler::for_model`] then makes a
//! disabled scaler whose scale is 1 and which multiplies nothing; it still guards against non-finite
//! gradients with one read-only pass ([`GradScaler::with_finite_guard`]), as the fused steps do.
//!
//! On a CUDA device, [`GradScaler::step_fused_deferred`] runs the whole protocol there without the host
//! waiting for anything (the loss check and the skip decision included); [`GradScaler::settle`] reads
//! what the queued steps did when the host wants to know.

mod accumulate;
mod checkpoint;
mod config;
mod deferred;
pub(crate) mod no_grad;
mod report;
mod settled;
pub(crate) mod stages;
mod state;

pub use accumulate::GradAccumulator;
pub(crate) use accumulate::Window;
pub use config::{AtScaleFloor, ScalerConfig};
pub use no_grad::{LikelyCause, MissingGradients, NoGradient, NoGradients};
pub use report::{SkipReason, StepReport};
pub use settled::Settled;
pub use state::{ScaleChange, ScaleState};

use std::collections::HashSet;
use std::sync::{Mutex, PoisonError};

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, TensorId};

use crate::error::{Error, Result};
use crate::{AmpModule, AmpModuleExt};

/// A dynamic or static loss scaler (PyTorch's `GradScaler`, Apex's `LossScaler`).
#[derive(Debug)]
pub struct GradScaler {
    config: ScalerConfig,
    /// The truth, except while deferred steps are queued on a device: then as of the last settle.
    state: ScaleState,
    enabled: bool,
    finite_guard: bool,
    log: report::SkipLog,
    key: String,
    /// Deferred steps read but not yet returned by `settle`.
    window: Settled,
    /// What the first step does about parameters without a gradient.
    missing_gradients: MissingGradients,
    /// True once a step of this scaler has looked for parameters without a gradient.
    gradients_checked: bool,
    /// True when [`for_model`](Self::for_model) disabled it because the model computed in no fp16 then:
    /// a step that meets fp16 after all (the model was initialized afterwards) is refused.
    judged_unneeded: bool,
    /// The gradients (by tensor) that the last [`unscale`](Self::unscale) divided by the scale, until
    /// the next [`update`](Self::update): unscaling one of them again would divide it twice. One call's
    /// worth, so a loop that never calls `update` keeps no more.
    unscaled: Mutex<HashSet<TensorId>>,
    /// The state on a CUDA device since the last deferred step (the truth while steps are queued).
    #[cfg(feature = "cuda")]
    device: Option<crate::cuda::QueuedScaler>,
}

/// The loss's value, refusing a loss of more or fewer than one element ([`Error::LossNotScalar`]).
pub(crate) fn loss_value(loss: &Tensor) -> Result<f32> {
    ensure_one_value(loss)?;
    Ok(loss.to_dtype(DType::F32)?.flatten_all()?.get(0)?.to_scalar::<f32>()?)
}

/// Refuses a loss that is not one value: backward would differentiate the sum of its elements (a
/// per-sample loss not yet reduced) or, for an empty one, nothing at all.
pub(crate) fn ensure_one_value(loss: &Tensor) -> Result<()> {
    match loss.elem_count() {
        1 => Ok(()),
        _ => Err(Error::LossNotScalar { shape: loss.dims().to_vec() }),
    }
}

/// Where `model` computes in fp16, for [`GradScaler::refuse_unscaled_fp16`].
pub(crate) fn first_fp16_layer<M: AmpModule + ?Sized>(model: &M) -> Option<String> {
    let plan = model.precision_plan();
    let row = plan.rows.iter().find(|r| r.compute == crate::Precision::Fp16)?;
    Some(format!("`{}` computes in fp16", row.path))
}

/// The result of [`GradScaler::unscale`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unscaled {
    /// Path of the first parameter (in model order) whose gradient is not finite, if any.
    pub first_non_finite: Option<String>,
}

impl GradScaler {
    /// An enabled scaler.
    pub fn new(config: ScalerConfig) -> Result<Self> {
        config.validate()?;
        Ok(GradScaler {
            state: ScaleState::new(&config),
            config,
            enabled: true,
            finite_guard: true,
            log: report::SkipLog::new(1000),
            key: "scaler".into(),
            window: Settled::none(1.0),
            missing_gradients: MissingGradients::Error,
            gradients_checked: false,
            judged_unneeded: false,
            unscaled: Mutex::default(),
            #[cfg(feature = "cuda")]
            device: None,
        })
    }

    /// A scaler that does nothing: scale 1, no unscale pass, no check unless
    /// [`with_finite_guard`](Self::with_finite_guard) turns the read-only check on.
    pub fn disabled() -> Self {
        let config = ScalerConfig::fixed(1.0);
        GradScaler {
            state: ScaleState::new(&config),
            config,
            enabled: false,
            finite_guard: false,
            log: report::SkipLog::new(1000),
            key: "scaler".into(),
            window: Settled::none(1.0),
            missing_gradients: MissingGradients::Error,
            gradients_checked: false,
            judged_unneeded: false,
            unscaled: Mutex::default(),
            #[cfg(feature = "cuda")]
            device: None,
        }
    }

    /// Enabled when some layer of `model` computes in fp16 now (after `amp::initialize`) or is marked
    /// `#[amp(fp16)]`, disabled otherwise (bf16 and fp32 have fp32's range) but guarded: its
    /// [`step`](Self::step) still skips a step with an inf or NaN gradient, leaving the weights as they
    /// were, as every `step_fused` does (one read-only pass over the gradients;
    /// `.with_finite_guard(false)` drops it). Build it after `amp::initialize`: a scaler this disabled
    /// refuses the steps of a model that computes in fp16 after all ([`Error::ScalerBuiltBeforeFp16`]).
    /// An O3 fp16 model, which has no fp32 masters to unscale its gradients into, trains with
    /// `GradScaler::new(ScalerConfig::fixed(1.0))` (Apex O3's scale): at another scale
    /// [`unscale`](Self::unscale) refuses its gradients.
    ///
    /// # Errors
    /// [`Error::InvalidScalerConfig`] for a `config` [`GradScaler::new`] refuses, whether
    /// or not the scaler is enabled.
    pub fn for_model<M: AmpModule + ?Sized>(model: &M, config: ScalerConfig) -> Result<Self> {
        config.validate()?;
        if M::NEEDS_LOSS_SCALING || model.precision_plan().computes_in_fp16() {
            GradScaler::new(config)
        } else {
            let disabled = GradScaler::disabled().with_finite_guard(true);
            Ok(GradScaler { judged_unneeded: true, ..disabled })
        }
    }

    /// Refuses a step of fp16 computation on a scaler that [`for_model`](Self::for_model) disabled
    /// because the model computed in no fp16 then: unscaled, small fp16 gradients flush to zero.
    /// `fp16` says where fp16 is found (`None`: nowhere); it is only asked on such a scaler.
    pub(crate) fn refuse_unscaled_fp16(&self, fp16: impl FnOnce() -> Option<String>) -> Result<()> {
        match self.judged_unneeded.then(fp16).flatten() {
            Some(found) => Err(Error::ScalerBuiltBeforeFp16 { found }),
            None => Ok(()),
        }
    }

    /// Turns the read-only non-finite check of a disabled scaler on or off (enabled scalers always check).
    pub fn with_finite_guard(mut self, on: bool) -> Self {
        self.finite_guard = on || self.enabled;
        self
    }

    /// Logs a summary of skips at most once per `steps` steps (default 1000).
    pub fn with_summary_every(mut self, steps: u64) -> Self {
        self.log = report::SkipLog::new(steps);
        self
    }

    /// Names the scaler in checkpoints (default `"scaler"`); give each scaler of a multi-loss setup its
    /// own name (Apex's `num_losses`).
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.key = name.into();
        self
    }

    /// What the first step does when a trainable parameter received no gradient: fail naming every
    /// such parameter with its likely cause ([`MissingGradients::Error`], the default), or log that and
    /// train the rest ([`MissingGradients::Warn`], for parameters frozen on purpose). Later steps do
    /// the same when no parameter at all received one (the loss of another model, or a detached one).
    pub fn on_missing_gradients(mut self, policy: MissingGradients) -> Self {
        self.missing_gradients = policy;
        self
    }

    /// On this scaler's first step: the parameters among `params` without a gradient in `grads`,
    /// handled as [`on_missing_gradients`](Self::on_missing_gradients) says; on later steps, the same
    /// when none has one.
    pub(crate) fn check_gradients_once<'a>(
        &mut self,
        params: impl IntoIterator<Item = no_grad::Checked<'a>>,
        grads: &GradStore,
    ) -> Result<()> {
        if self.gradients_checked {
            // Later steps refuse only a loss that reached no parameter at all (another model's, or a
            // detached one): it would be reported as applied with nothing trained. The lookups stop
            // at the first parameter reached.
            let params: Vec<no_grad::Checked<'a>> = params.into_iter().collect();
            if params.iter().any(|p| p.reached(grads)) {
                return Ok(());
            }
            return no_grad::enforce(no_grad::find(params, grads), self.missing_gradients);
        }
        no_grad::enforce(no_grad::find(params, grads), self.missing_gradients)?;
        self.gradients_checked = true;
        Ok(())
    }

    /// True when the scaler multiplies and unscales.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// The current loss scale (1 when disabled); after deferred steps, as of the last
    /// [`settle`](Self::settle).
    pub fn scale(&self) -> f32 {
        self.state.scale
    }

    /// The settings.
    pub fn config(&self) -> &ScalerConfig {
        &self.config
    }

    /// The evolving state (scale, trackers, counts); after deferred steps, as of the last
    /// [`settle`](Self::settle).
    pub fn state(&self) -> &ScaleState {
        &self.state
    }

    /// `loss * scale` in f32, to call `backward` on. The loss itself when disabled.
    ///
    /// # Errors
    /// [`Error::Unsettled`] while deferred steps are queued: their scale is on the device;
    /// [`Error::LossNotScalar`] for a loss of more or fewer than one value (as every step refuses it).
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        self.expect_settled("scale_loss")?;
        ensure_one_value(loss)?;
        if !self.enabled {
            return Ok(loss.clone());
        }
        Ok((loss.to_dtype(DType::F32)? * f64::from(self.state.scale))?)
    }

    /// Prepares the gradients of `model` for an optimizer that steps the fp32 masters: re-keys the
    /// gradients of half working copies onto their masters, widened to f32 (exact), then divides every
    /// gradient by the scale in place in one multi-tensor pass that also finds inf/NaN. Unscaling
    /// happens in f32, never in fp16, where small unscaled gradients would flush to zero. A disabled
    /// scaler re-keys and, when guarded, only checks. Parameters without a gradient are ignored.
    ///
    /// Each gradient is unscaled once per step: an enabled scaler refuses the gradients its last
    /// `unscale` divided, until [`update`](Self::update) (PyTorch's `unscale_` refuses a second call
    /// too), so clip between `unscale` and the optimizer, then call `update`. Gradients of another
    /// backward pass are new tensors and are unscaled as usual.
    ///
    /// # Errors
    /// [`Error::Fp16Unscale`] for an fp16 gradient with no fp32 master (O3 fp16) at a scale other than
    /// 1, and [`Error::AlreadyUnscaled`] for a gradient the last `unscale` divided (before an update),
    /// each dividing nothing; [`Error::SplitGradient`] and candle's errors otherwise.
    pub fn unscale<M: AmpModule + ?Sized>(&self, model: &M, grads: &mut GradStore) -> Result<Unscaled> {
        self.expect_settled("unscale")?;
        crate::grads_to_masters(model, grads)?;
        let params = model.unique_params();
        let present: Vec<(&str, &Tensor)> = params
            .iter()
            .filter_map(|(path, p)| grads.get(p.master().as_tensor()).map(|g| (path.as_str(), g)))
            .collect();
        let tensors: Vec<&Tensor> = present.iter().map(|(_, g)| *g).collect();
        self.refuse_fp16_unscale(
            present.iter().filter(|(_, g)| g.dtype() == DType::F16).map(|(path, _)| *path),
        )?;
        let first = if self.enabled {
            let mut unscaled = self.unscaled.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some((path, _)) = present.iter().find(|(_, g)| unscaled.contains(&g.id())) {
                return Err(Error::AlreadyUnscaled { path: path.to_string() });
            }
            let first = crate::passes::unscale_and_check(&tensors, 1.0 / self.state.scale)?;
            *unscaled = tensors.iter().map(|g| g.id()).collect();
            first
        } else if self.finite_guard {
            crate::passes::find_non_finite(&tensors)?
        } else {
            None
        };
        Ok(Unscaled { first_non_finite: first.map(|i| present[i].0.to_string()) })
    }

    /// [`Error::Fp16Unscale`] naming the first of `fp16_gradients` (the paths of fp16 gradients with no
    /// fp32 master to unscale into, O3 fp16) when unscaling would divide by a scale other than 1: in fp16
    /// that would flush small gradients to zero.
    fn refuse_fp16_unscale<'p>(&self, mut fp16_gradients: impl Iterator<Item = &'p str>) -> Result<()> {
        if self.enabled && self.state.scale != 1.0 {
            if let Some(path) = fp16_gradients.next() {
                return Err(Error::Fp16Unscale { path: path.to_string(), scale: self.state.scale });
            }
        }
        Ok(())
    }

    /// Records a step's outcome and moves the scale. `skipped` is `None` when the optimizer was applied.
    /// Fails with [`Error::ScaleAtFloor`] when non-finite values persist at the minimum scale and the
    /// config says to stop.
    pub fn update(&mut self, skipped: Option<SkipReason>) -> Result<StepReport> {
        self.reclaim()?;
        self.unscaled.get_mut().unwrap_or_else(PoisonError::into_inner).clear();
        let scale_before = self.state.scale;
        let warmup = skipped.is_some() && self.state.applied == 0;
        let change = self.state.update(skipped.is_some(), &self.config);
        let report = StepReport {
            step: self.state.steps,
            skipped,
            scale_before,
            scale_after: self.state.scale,
            change,
            warmup,
        };
        self.log.record(&report);
        if self.enabled && ScaleState::must_stop(change, &self.config) {
            let what = match &report.skipped {
                Some(SkipReason::GradientOverflow { param }) => format!("gradient of `{param}`"),
                Some(SkipReason::NonFiniteLoss) | None => "the loss".to_string(),
                Some(reason) => reason.group_words(),
            };
            return Err(Error::ScaleAtFloor { step: report.step, scale: report.scale_after, what });
        }
        Ok(report)
    }

    /// One whole step: checks the loss, backward on the scaled loss, unscale and check, then `apply`
    /// (your optimizer's step over `model.master_vars()` with the unscaled f32 gradients) and the refresh
    /// of the half working copies, only when everything is finite; then the scale update. A skipped step
    /// calls nothing and changes no weight.
    pub fn step<M: AmpModule + ?Sized>(
        &mut self,
        model: &M,
        loss: &Tensor,
        apply: impl FnOnce(&mut GradStore) -> Result<()>,
    ) -> Result<StepReport> {
        self.reclaim()?;
        if !loss_value(loss)?.is_finite() {
            return self.update(Some(SkipReason::NonFiniteLoss));
        }
        let grads = crate::gradient_sink::backward(&self.scale_loss(loss)?)?;
        self.apply_gradients(model, grads, apply)
    }

    /// [`step`](Self::step) after backward: from the gradients of the scaled loss on.
    fn apply_gradients<M: AmpModule + ?Sized>(
        &mut self,
        model: &M,
        mut grads: GradStore,
        apply: impl FnOnce(&mut GradStore) -> Result<()>,
    ) -> Result<StepReport> {
        self.refuse_unscaled_fp16(|| first_fp16_layer(model))?;
        let params = no_grad::model_params(model);
        self.check_gradients_once(params.iter().map(no_grad::ModelParam::checked), &grads)?;
        let unscaled = self.unscale(model, &mut grads)?;
        if let Some(param) = unscaled.first_non_finite {
            return self.update(Some(SkipReason::GradientOverflow { param }));
        }
        apply(&mut grads)?;
        crate::refresh_working_copies(model)?;
        self.update(None)
    }

    /// Restores a state saved from [`state`](Self::state) and [`config`](Self::config): the run goes on
    /// exactly as if uninterrupted. A state the scaler could not have reached under `config` (a scale
    /// outside its bounds, a tracker past its interval) is refused, as a checkpoint's is, and nothing
    /// changes.
    pub fn load_state(&mut self, config: ScalerConfig, state: ScaleState) -> Result<()> {
        config.validate()?;
        checkpoint::check_state(&state, &config)
            .map_err(|what| Error::InvalidScalerConfig { reason: format!("scaler state: {what}") })?;
        self.config = config;
        self.state = state;
        self.forget_deferred();
        Ok(())
    }
}

/// One training step without loss scaling, for models that cannot underflow: bf16 and fp32 layers only.
/// Checks the loss, backward, re-keys half gradients onto the fp32 masters, skips the step if any
/// gradient is not finite (one read-only pass), else `apply` and the working-copy refresh.
///
/// Calling it on a model with a layer fixed to fp16 (or `half`), at any depth, does not compile: see
/// the `compile_fail` example in the `amp` crate's documentation and `ui-tests/tests/ui/loss_scaling`.
/// A layer without an attribute computes in its opt level's half type, known only at run time: when
/// that is fp16, the step is refused.
///
/// It keeps no state between calls, so the check that every trainable parameter received a gradient
/// (a scaler's first-step check, [`MissingGradients::Error`](crate::scaler::MissingGradients)) runs
/// on every call. For a model with parameters frozen on purpose, or that some batches leave without
/// a gradient, keep a scaler instead, whose `step` is this one with that check made once:
/// `GradScaler::disabled().with_finite_guard(true).on_missing_gradients(MissingGradients::Warn)`.
///
/// # Errors
/// [`Error::NeedsLossScaler`] when a layer computes in fp16 (nothing is changed); those of
/// [`GradScaler::step`], [`Error::NoGradient`] on any call.
pub fn step_unscaled<M>(
    model: &M,
    loss: &Tensor,
    apply: impl FnOnce(&mut GradStore) -> Result<()>,
) -> Result<StepReport>
where
    M: AmpModule + crate::NoFp16Under<crate::Inherit> + ?Sized,
{
    if let Some(row) = model.precision_plan().rows.iter().find(|r| r.compute == crate::Precision::Fp16) {
        return Err(Error::NeedsLossScaler { path: row.path.clone() });
    }
    GradScaler::disabled().with_finite_guard(true).step(model, loss, apply)
}
