//! Fused SGD with momentum, dampening, Nesterov and weight decay (PyTorch's semantics), one pass per
//! parameter including the half working copy.

use amp_kernels::optim::{sgd_step, sgd_step_bf16_state, SgdBf16Tensor, SgdParams, SgdTensor};
use candle_core::backprop::GradStore;

use super::core::Core;
use super::driver::{self, select_mut};
use super::params::{OptimParam, ParamGroups};
use super::state::{Buffers, Checkpointed};
use super::state_dtype::{self, StateDtype};
use super::validate;
use super::FusedOptimizer;
use crate::error::{Error, Result};

/// Settings of [`FusedSgd`].
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SgdConfig {
    /// Learning rate (0.01).
    pub lr: f64,
    /// Momentum factor (0: no momentum buffer).
    pub momentum: f64,
    /// Dampening of the gradient's contribution to the momentum (0).
    pub dampening: f64,
    /// L2 penalty added to the gradient (0).
    pub weight_decay: f64,
    /// Nesterov momentum (needs momentum > 0 and no dampening).
    pub nesterov: bool,
    /// The dtype of the momentum buffer ([`StateDtype::F32`]); [`StateDtype::Bf16`] halves it, rounded
    /// stochastically (CPU only).
    #[serde(default)]
    pub state_dtype: StateDtype,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 0.01,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            state_dtype: StateDtype::F32,
        }
    }
}

impl SgdConfig {
    /// Checks the settings, naming the field that is out of range; refuses Nesterov without momentum or
    /// with dampening, as PyTorch does.
    pub fn validate(&self) -> Result<()> {
        validate::non_negative("lr", self.lr)?;
        validate::non_negative("momentum", self.momentum)?;
        validate::fraction("dampening", self.dampening)?;
        validate::non_negative("weight_decay", self.weight_decay)?;
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(Error::InvalidOptimizerConfig {
                reason: "`nesterov` needs momentum > 0 and dampening 0".into(),
            });
        }
        Ok(())
    }
}

/// Fused multi-tensor SGD over fp32 masters with fp32 momentum buffers (or bf16: [`StateDtype`]).
///
/// The momentum buffers start as the gradient (no dampening) on the optimizer's first applied step,
/// as `torch.optim.SGD` starts each parameter's; a parameter whose first gradient comes later starts
/// from a zero buffer, so its first update is `(1 - dampening)` times the gradient. To unfreeze
/// parameters part-way with torch's first steps, give them an optimizer of their own.
#[derive(Debug)]
pub struct FusedSgd {
    /// State: `momentum_buffer` (used with momentum only), f32 or bf16.
    core: Core<SgdConfig, [Buffers; 1]>,
    /// Each parameter's random stream for a bf16 buffer's rounding.
    streams: Vec<u64>,
}

impl FusedSgd {
    /// An optimizer over `groups`; refuses Nesterov without momentum or with dampening, as PyTorch does.
    pub fn new(groups: ParamGroups, config: SgdConfig) -> Result<Self> {
        config.validate()?;
        validate::groups(&groups.groups)?;
        let state = Self::fresh_state(&config, &groups.params);
        let streams = state_dtype::streams(&groups.params);
        Ok(FusedSgd { core: Core::new(groups, config, state), streams })
    }

    /// Names the optimizer in checkpoints (default `"optimizer"`), so that two optimizers (of two models,
    /// or of two parameter sets) can be saved in one checkpoint, as `GradScaler::named` does for scalers.
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.core.key = name.into();
        self
    }

    /// The settings.
    pub fn config(&self) -> &SgdConfig {
        &self.core.config
    }

    /// One step on the CUDA device of the gradients (the state moves there on the first).
    #[cfg(feature = "cuda")]
    fn device_step(&mut self, grads: &GradStore, gate: crate::cuda::Gate<'_>) -> Result<()> {
        self.core.config.state_dtype.refuse_on_cuda()?;
        let params: Vec<SgdParams> =
            (0..self.core.groups.groups.len()).map(|g| self.kernel_params(g)).collect();
        self.core.device_step(grads, gate, |group, (kernels, stream, table, inputs)| {
            // SAFETY: as for FusedAdam: every address in the table is a live buffer that outlives the
            // kernel, queued on candle's stream.
            unsafe { kernels.sgd(stream, table, inputs, &params[group]) }.map_err(crate::cuda::cuda_error)
        })
    }

    fn kernel_params(&self, group: usize) -> SgdParams {
        let (config, options) = (&self.core.config, self.core.groups.groups[group]);
        SgdParams {
            lr: options.lr.unwrap_or(config.lr),
            momentum: config.momentum,
            dampening: config.dampening,
            weight_decay: options.weight_decay.unwrap_or(config.weight_decay),
            nesterov: config.nesterov,
            first_step: self.core.step == 1,
        }
    }

    /// One group's step on the CPU with f32 buffers (or none, without momentum).
    fn cpu_group_f32(
        &mut self,
        group: usize,
        params: &SgdParams,
        grads: &GradStore,
        inv_scale: f32,
    ) -> Result<()> {
        let core = &mut self.core;
        let present = driver::with_grads(&core.groups.params, Some(group), grads)?;
        let [momentum] = &mut core.state;
        let buffers = momentum.f32_mut()?;
        driver::for_each_batch(&core.groups.params, &present, |indices, views| {
            let mut tensors: Vec<SgdTensor<'_>> = views
                .iter_mut()
                .zip(select_mut(buffers, indices))
                .map(|(view, buffer)| SgdTensor {
                    master: &mut *view.master,
                    grad: view.grad,
                    momentum_buffer: (params.momentum != 0.0).then_some(buffer.as_mut_slice()),
                    working: view.working.as_mut().map(|w| w.reborrow()),
                })
                .collect();
            sgd_step(&mut tensors, params, inv_scale);
        })
    }

    /// One group's step on the CPU with bf16 momentum buffers, each parameter's rounding drawn from its
    /// own stream, the applied-step count numbering the step.
    fn cpu_group_bf16(
        &mut self,
        group: usize,
        params: &SgdParams,
        grads: &GradStore,
        inv_scale: f32,
    ) -> Result<()> {
        let (core, streams) = (&mut self.core, &self.streams);
        let present = driver::with_grads(&core.groups.params, Some(group), grads)?;
        let step = core.step;
        let [momentum] = &mut core.state;
        let buffers = momentum.bf16_mut()?;
        driver::for_each_batch(&core.groups.params, &present, |indices, views| {
            let mut tensors: Vec<SgdBf16Tensor<'_>> = views
                .iter_mut()
                .zip(select_mut(buffers, indices))
                .zip(indices)
                .map(|((view, buffer), &i)| SgdBf16Tensor {
                    master: &mut *view.master,
                    grad: view.grad,
                    momentum_buffer: buffer,
                    working: view.working.as_mut().map(|w| w.reborrow()),
                    stream: streams[i],
                })
                .collect();
            sgd_step_bf16_state(&mut tensors, params, step, inv_scale);
        })
    }
}

impl FusedOptimizer for FusedSgd {
    fn step_scaled(&mut self, grads: &GradStore, inv_grad_scale: f32) -> Result<()> {
        // `set_learning_rate` takes any value; a step refuses one out of range before it changes anything.
        validate::non_negative("lr", self.core.config.lr)?;
        #[cfg(feature = "cuda")]
        if self.core.on_cuda(grads) {
            return self.device_step(grads, crate::cuda::Gate::Host(inv_grad_scale));
        }
        self.core.begin_cpu_step(grads)?;
        let bf16 = self.core.config.state_dtype == StateDtype::Bf16 && self.core.config.momentum != 0.0;
        for group in 0..self.core.groups.groups.len() {
            let params = self.kernel_params(group);
            if bf16 {
                self.cpu_group_bf16(group, &params, grads, inv_grad_scale)?;
            } else {
                self.cpu_group_f32(group, &params, grads, inv_grad_scale)?;
            }
        }
        crate::CastCache::clear();
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn step_gated(&mut self, grads: &GradStore, gate: &crate::cuda::DeviceGate<'_>) -> Result<()> {
        validate::non_negative("lr", self.core.config.lr)?;
        self.device_step(grads, crate::cuda::Gate::Device(*gate))
    }

    fn learning_rate(&self) -> f64 {
        self.core.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.core.config.lr = lr;
    }

    fn param_groups(&self) -> &ParamGroups {
        &self.core.groups
    }

    fn state_bytes(&self) -> usize {
        self.core.state_bytes()
    }
}

impl Checkpointed for FusedSgd {
    type Config = SgdConfig;
    type State = [Buffers; 1];

    fn core(&self) -> &Core<SgdConfig, [Buffers; 1]> {
        &self.core
    }

    fn core_mut(&mut self) -> &mut Core<SgdConfig, [Buffers; 1]> {
        &mut self.core
    }

    fn validate_config(config: &SgdConfig) -> Result<()> {
        config.validate()
    }

    fn fresh_state(config: &SgdConfig, params: &[OptimParam]) -> [Buffers; 1] {
        // Without momentum there is no buffer to store: an unused f32 one, whatever the dtype.
        let buffer = match config.state_dtype {
            StateDtype::Bf16 if config.momentum != 0.0 => Buffers::zeros_bf16,
            _ => Buffers::zeros,
        };
        [buffer("momentum_buffer", params, config.momentum != 0.0)]
    }
}
