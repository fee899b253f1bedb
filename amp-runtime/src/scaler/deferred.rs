//! Deferred steps' bookkeeping on the scaler: who holds the state (the host, or a CUDA device while
//! steps are queued there), and reading it back when the host asks.
//!
//! The rule: the state lives on the device from the first deferred step until a host-side call
//! ([`GradScaler::step`], [`GradScaler::step_fused`], [`GradScaler::update`]) takes it back, which reads
//! it first. Reading it is the only wait for the device: [`GradScaler::settle`] does it on request.

use super::{GradScaler, ScaleState, Settled};
use crate::error::{Error, Result};

impl GradScaler {
    /// Reads what the steps queued by [`step_fused_deferred`](Self::step_fused_deferred) did: waits for
    /// the device once, brings [`scale`](Self::scale) and [`state`](Self::state) up to date, and returns
    /// the steps since the previous settle, summed up. On the CPU deferred steps ran at once and this
    /// only returns their sum.
    ///
    /// # Errors
    /// [`Error::ScaleAtFloor`] when a queued step met a non-finite value at the minimum scale and the
    /// config says to stop (those steps were skipped: no weight changed); the driver's errors.
    pub fn settle(&mut self) -> Result<Settled> {
        #[cfg(feature = "cuda")]
        self.read_device()?;
        let settled = std::mem::replace(&mut self.window, Settled::none(self.state.scale));
        Ok(if settled.steps == 0 { Settled::none(self.state.scale) } else { settled })
    }

    /// Deferred steps queued on a device whose outcome the host has not read yet.
    pub fn unsettled_steps(&self) -> u64 {
        #[cfg(feature = "cuda")]
        if let Some(queued) = &self.device {
            return queued.queued();
        }
        0
    }

    /// [`Error::Unsettled`] for `call` while deferred steps are queued.
    pub(crate) fn expect_settled(&self, call: &'static str) -> Result<()> {
        match self.unsettled_steps() {
            0 => Ok(()),
            steps => Err(Error::Unsettled { steps, call }),
        }
    }

    /// Takes the state back from the device (reading it if steps are queued) before a host-side step.
    pub(crate) fn reclaim(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if self.device.is_some() {
            self.read_device()?;
            self.device = None;
        }
        Ok(())
    }

    /// Drops any device copy and unread steps (a restore replaced the state).
    pub(crate) fn forget_deferred(&mut self) {
        #[cfg(feature = "cuda")]
        {
            self.device = None;
        }
        self.window = Settled::none(self.state.scale);
        // The skip log's window restarts at the restored count, which may be behind it (a rollback).
        self.log.restart(self.state.steps);
    }

    /// The state including queued steps (reads the device without settling): what a checkpoint saves.
    pub(crate) fn current_state(&self) -> Result<ScaleState> {
        #[cfg(feature = "cuda")]
        if let Some(queued) = self.device.as_ref().filter(|q| q.queued() > 0) {
            return Ok(queued.peek()?.state);
        }
        Ok(self.state)
    }

    /// Reads the device state into the host's and the settle window; stops at the floor when told to.
    #[cfg(feature = "cuda")]
    pub(crate) fn read_device(&mut self) -> Result<()> {
        let Some(queued) = self.device.as_mut().filter(|q| q.queued() > 0) else { return Ok(()) };
        let reading = queued.read()?;
        let (now, before) = (reading.state, self.state);
        let last_skip = (now.skipped > before.skipped).then(|| queued.skip_reason(reading.last_bad));
        let window = Settled {
            steps: now.steps - before.steps,
            applied: now.applied - before.applied,
            skipped: now.skipped - before.skipped,
            last_skip,
            scale_before: before.scale,
            scale_after: now.scale,
        };
        self.state = now;
        self.log.record_settled(&window, now.steps);
        self.window.add(window);
        if reading.new_floor_hits == 0 {
            return Ok(());
        }
        let what = match &self.window.last_skip {
            Some(super::SkipReason::GradientOverflow { param }) => format!("gradient of `{param}`"),
            _ => "the loss".to_string(),
        };
        tracing::warn!(
            "{} deferred step(s) met a non-finite {what} at the minimum scale {}, which cannot remove it",
            reading.new_floor_hits,
            now.scale
        );
        if self.enabled && self.config.at_floor == super::AtScaleFloor::Stop {
            return Err(Error::ScaleAtFloor { step: now.steps, scale: now.scale, what });
        }
        Ok(())
    }
}

impl GradScaler {
    /// [`step_fused`](Self::step_fused) without waiting for the device: on a CUDA device the loss is
    /// multiplied by the scale the device holds, the loss and gradient checks (or the clipping norm)
    /// write a flag there, the optimizer's kernels skip themselves when it is set, and the scale moves
    /// there, so a training loop never waits for the GPU. What the steps did is read by
    /// [`settle`](Self::settle), as often as you like (every 100 steps, at logging time). On the CPU
    /// it is `step_fused`, with the report kept for `settle`.
    ///
    /// A skipped step changes no weight, as with `step_fused`. A non-finite value at the minimum scale,
    /// where the config says to stop, is reported by the next `settle` on a CUDA device; on the CPU it is
    /// this call's error at once (`step_fused`'s [`Error::ScaleAtFloor`]), and that step is not among
    /// the ones `settle` sums.
    ///
    /// # Errors
    /// [`Error::NotDeferrable`] from an optimizer that cannot step this way (amp's fused optimizers
    /// can); those of `step_fused`.
    pub fn step_fused_deferred(
        &mut self,
        loss: &candle_core::Tensor,
        optimizer: &mut dyn crate::optim::FusedOptimizer,
        max_grad_norm: Option<f32>,
    ) -> Result<()> {
        crate::optim::check_max_grad_norm(max_grad_norm)?;
        // Refused here, before anything is queued: an optimizer's own refusal inside the queued step
        // would count as a skipped step on the device.
        crate::optim::validate::non_negative("lr", optimizer.learning_rate())?;
        optimizer.param_groups().ensure_current()?;
        super::ensure_one_value(loss)?;
        if !loss.device().is_cuda() {
            let report = self.step_fused(loss, optimizer, max_grad_norm)?;
            self.window.add_report(&report);
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        return self.queue_on_device(loss, optimizer, max_grad_norm);
        #[cfg(not(feature = "cuda"))]
        Err(Error::CudaNotBuilt)
    }

    #[cfg(feature = "cuda")]
    fn queue_on_device(
        &mut self,
        loss: &candle_core::Tensor,
        optimizer: &mut dyn crate::optim::FusedOptimizer,
        max_grad_norm: Option<f32>,
    ) -> Result<()> {
        use crate::cuda::{GradCheck, QueuedScaler};

        if self.device.as_ref().is_some_and(|q| !q.device().same_device(loss.device())) {
            self.reclaim()?;
        }
        if self.device.is_none() {
            self.device = Some(QueuedScaler::upload(loss.device(), &self.state)?);
        }
        let loss = crate::cuda::loss_f32(loss)?;
        let scaled = self.enabled;
        let mut grads = crate::gradient_sink::backward(&self.queued()?.scaled_loss(&loss, scaled)?)?;
        let params = optimizer.param_groups().params();
        crate::optim::fold_split_gradients(params, &mut grads)?;
        self.refuse_unscaled_fp16(|| crate::optim::first_fp16(params, &grads))?;
        self.check_gradients_once(params.iter().map(crate::optim::OptimParam::checked), &grads)?;
        let present = crate::optim::present_grads(optimizer, &grads)?;
        let paths = || present.iter().map(|(i, _)| params[*i].path.as_str());
        if !self.queued()?.checks(paths()) {
            // The queued steps' skip reasons index the old order: read them first.
            self.read_device()?;
            self.queued()?.set_checked(paths().map(str::to_owned).collect());
        }
        // Gradients are always checked, as `step_fused` checks them: a disabled scaler (bf16, fp32)
        // skips a step with an inf or NaN gradient too.
        let check = max_grad_norm.map_or(GradCheck::Finite, GradCheck::ClipNorm);
        let tensors: Vec<&candle_core::Tensor> = present.iter().map(|(_, g)| *g).collect();
        let (config, dynamic) = (self.config, self.enabled && self.config.dynamic);
        let queued = self.queued()?;
        match queued.check(&loss, &tensors, check).and_then(|gate| optimizer.step_gated(&grads, &gate)) {
            Ok(()) => queued.update(&config, dynamic),
            Err(e) => {
                // Record the step as skipped, so that the flag is cleared and the counts stay true.
                queued.abandon(&config, dynamic)?;
                Err(e)
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn queued(&mut self) -> Result<&mut crate::cuda::QueuedScaler> {
        self.device.as_mut().ok_or_else(|| Error::Internal { what: "no device scaler state".into() })
    }
}
