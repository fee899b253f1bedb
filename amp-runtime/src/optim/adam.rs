//! Fused Adam and AdamW: one pass per parameter reads the gradient (unscaling it inline), updates the
//! fp32 master and moments, and writes the half working copy.

use amp_kernels::optim::{adam_step, adam_step_bf16_state, AdamBf16Tensor, AdamParams, AdamTensor};
use candle_core::backprop::GradStore;

use super::core::Core;
use super::driver::{self, select_mut};
use super::params::{OptimParam, ParamGroups};
use super::state::{Buffers, Checkpointed};
use super::state_dtype::{self, StateDtype};
use super::validate;
use super::FusedOptimizer;
use crate::error::Result;

/// Settings of [`FusedAdam`]. The default is PyTorch's AdamW.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamConfig {
    /// Learning rate (1e-3).
    pub lr: f64,
    /// Decay of the first moment (0.9).
    pub beta1: f64,
    /// Decay of the second moment (0.999).
    pub beta2: f64,
    /// Added to the root of the second moment (1e-8); the moments are fp32, so 1e-8 is representable.
    pub eps: f64,
    /// Weight decay (0.01).
    pub weight_decay: f64,
    /// `true` (AdamW): decay the weights directly; `false` (Adam): add `weight_decay * w` to the gradient.
    pub decoupled_weight_decay: bool,
    /// Use the running maximum of the second moment (false).
    pub amsgrad: bool,
    /// Divide the moments by `1 - beta^t` (true).
    pub bias_correction: bool,
    /// The dtype the moments are kept in ([`StateDtype::F32`]). [`StateDtype::Bf16`] halves the
    /// optimizer's memory, rounding the moments stochastically (CPU only; no AMSGrad). With the default
    /// betas the rounding's noise is about 5% of `v` and well under 1% of `m` per element (measured in
    /// `kernels/tests/adam_bf16.rs`), which moves each step's size by about half as much as it moves `v`.
    #[serde(default)]
    pub state_dtype: StateDtype,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled_weight_decay: true,
            amsgrad: false,
            bias_correction: true,
            state_dtype: StateDtype::F32,
        }
    }
}

impl AdamConfig {
    /// PyTorch's `AdamW` defaults (the same as `default()`): decoupled weight decay 0.01.
    pub fn adamw() -> Self {
        Self::default()
    }

    /// PyTorch's `Adam` defaults: L2 penalty instead of decoupled decay, no weight decay.
    pub fn adam() -> Self {
        AdamConfig { weight_decay: 0.0, decoupled_weight_decay: false, ..Self::default() }
    }

    /// Checks the settings, naming the field that is out of range.
    pub fn validate(&self) -> Result<()> {
        validate::non_negative("lr", self.lr)?;
        validate::decay("beta1", self.beta1)?;
        validate::decay("beta2", self.beta2)?;
        validate::positive("eps", self.eps)?;
        validate::non_negative("weight_decay", self.weight_decay)?;
        if self.amsgrad && self.state_dtype == StateDtype::Bf16 {
            return Err(crate::Error::InvalidOptimizerConfig {
                reason: "`amsgrad` keeps a running maximum of the second moment, which bf16 state cannot \
                         hold (it is rounded stochastically): set `state_dtype: StateDtype::F32`, or \
                         `amsgrad: false`"
                    .into(),
            });
        }
        Ok(())
    }
}

/// Fused multi-tensor Adam / AdamW over fp32 masters with fp32 state (or bf16: [`StateDtype`]). The
/// config picks which:
/// `FusedAdam::new(groups, AdamConfig::adamw())` (decoupled weight decay, the default) or
/// `FusedAdam::new(groups, AdamConfig::adam())` (L2 penalty added to the gradient).
///
/// The bias correction counts the optimizer's applied steps, one count for every parameter, as Apex's
/// `FusedAdam` counts per group, not each parameter's own steps as `torch.optim.Adam` does: a parameter
/// that first receives a gradient after N steps (unfrozen part-way through training) takes its first
/// update with step N + 1's correction, larger than torch's first update (about 2.5x for the default
/// betas at N = 1000). To unfreeze parameters part-way with torch's first steps, give them an
/// optimizer of their own, created when they are unfrozen.
#[derive(Debug)]
pub struct FusedAdam {
    /// State: `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq` (used with AMSGrad only), in f32, or the
    /// first two in bf16 ([`StateDtype::Bf16`]).
    core: Core<AdamConfig, [Buffers; 3]>,
    /// Each parameter's random stream for bf16 moments' rounding.
    streams: Vec<u64>,
}

/// The same optimizer as [`FusedAdam`], named for readability: the config alone picks AdamW
/// ([`AdamConfig::adamw`], the default) or Adam ([`AdamConfig::adam`]), whichever name is used.
pub type FusedAdamW = FusedAdam;

impl FusedAdam {
    /// An optimizer over `groups` with zeroed moments; refuses settings out of range.
    pub fn new(groups: ParamGroups, config: AdamConfig) -> Result<Self> {
        config.validate()?;
        validate::groups(&groups.groups)?;
        let state = Self::fresh_state(&config, &groups.params);
        let streams = state_dtype::streams(&groups.params);
        Ok(FusedAdam { core: Core::new(groups, config, state), streams })
    }

    /// Names the optimizer in checkpoints (default `"optimizer"`), so that two optimizers (of two models,
    /// or of two parameter sets) can be saved in one checkpoint, as `GradScaler::named` does for scalers.
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.core.key = name.into();
        self
    }

    /// The settings.
    pub fn config(&self) -> &AdamConfig {
        &self.core.config
    }

    /// Applied steps so far (bias correction uses it). On a CUDA device this reads the device's count,
    /// waiting for the queued steps.
    pub fn steps(&self) -> Result<u64> {
        self.core.applied_steps()
    }

    /// One step on the CUDA device of the gradients (the state moves there on the first).
    #[cfg(feature = "cuda")]
    fn device_step(&mut self, grads: &GradStore, gate: crate::cuda::Gate<'_>) -> Result<()> {
        self.core.config.state_dtype.refuse_on_cuda()?;
        let params: Vec<AdamParams> =
            (0..self.core.groups.groups.len()).map(|g| self.kernel_params(g)).collect();
        self.core.device_step(grads, gate, |group, (kernels, stream, table, inputs)| {
            // SAFETY: the table holds live device buffers of the recorded types (gradients in `grads`,
            // masters and copies in the parameters, state in `on_device`), all of which outlive the
            // kernel, queued on candle's stream.
            unsafe { kernels.adam(stream, table, inputs, &params[group]) }.map_err(crate::cuda::cuda_error)
        })
    }

    fn kernel_params(&self, group: usize) -> AdamParams {
        let (config, options) = (&self.core.config, self.core.groups.groups[group]);
        AdamParams {
            lr: options.lr.unwrap_or(config.lr),
            beta1: config.beta1,
            beta2: config.beta2,
            eps: config.eps,
            weight_decay: options.weight_decay.unwrap_or(config.weight_decay),
            decoupled_weight_decay: config.decoupled_weight_decay,
            amsgrad: config.amsgrad,
            bias_correction: config.bias_correction,
            step: self.core.step,
        }
    }

    /// One group's step on the CPU with f32 moments.
    fn cpu_group_f32(
        &mut self,
        group: usize,
        params: &AdamParams,
        grads: &GradStore,
        inv_scale: f32,
    ) -> Result<()> {
        let core = &mut self.core;
        let present = driver::with_grads(&core.groups.params, Some(group), grads)?;
        let [m, v, vmax] = &mut core.state;
        let (m, v, vmax) = (m.f32_mut()?, v.f32_mut()?, vmax.f32_mut()?);
        driver::for_each_batch(&core.groups.params, &present, |indices, views| {
            let (m, v, vmax) = (select_mut(m, indices), select_mut(v, indices), select_mut(vmax, indices));
            let mut tensors: Vec<AdamTensor<'_>> = views
                .iter_mut()
                .zip(m.into_iter().zip(v).zip(vmax))
                .map(|(view, ((m, v), vmax))| {
                    let mut t = AdamTensor::new(&mut *view.master, view.grad, m, v);
                    if params.amsgrad {
                        t = t.with_max_exp_avg_sq(vmax);
                    }
                    t.working = view.working.as_mut().map(|w| w.reborrow());
                    t
                })
                .collect();
            adam_step(&mut tensors, params, inv_scale);
        })
    }

    /// One group's step on the CPU with bf16 moments, each parameter's rounding drawn from a stream
    /// named by its path.
    fn cpu_group_bf16(
        &mut self,
        group: usize,
        params: &AdamParams,
        grads: &GradStore,
        inv_scale: f32,
    ) -> Result<()> {
        let core = &mut self.core;
        let present = driver::with_grads(&core.groups.params, Some(group), grads)?;
        let streams = &self.streams;
        let [m, v, _] = &mut core.state;
        let (m, v) = (m.bf16_mut()?, v.bf16_mut()?);
        driver::for_each_batch(&core.groups.params, &present, |indices, views| {
            let (m, v) = (select_mut(m, indices), select_mut(v, indices));
            let mut tensors: Vec<AdamBf16Tensor<'_>> = views
                .iter_mut()
                .zip(m.into_iter().zip(v))
                .zip(indices)
                .map(|((view, (m, v)), &i)| AdamBf16Tensor {
                    master: &mut *view.master,
                    grad: view.grad,
                    exp_avg: m,
                    exp_avg_sq: v,
                    working: view.working.as_mut().map(|w| w.reborrow()),
                    stream: streams[i],
                })
                .collect();
            adam_step_bf16_state(&mut tensors, params, inv_scale);
        })
    }
}

impl FusedOptimizer for FusedAdam {
    fn step_scaled(&mut self, grads: &GradStore, inv_grad_scale: f32) -> Result<()> {
        // `set_learning_rate` takes any value; a step refuses one out of range before it changes anything.
        validate::non_negative("lr", self.core.config.lr)?;
        #[cfg(feature = "cuda")]
        if self.core.on_cuda(grads) {
            return self.device_step(grads, crate::cuda::Gate::Host(inv_grad_scale));
        }
        self.core.begin_cpu_step(grads)?;
        for group in 0..self.core.groups.groups.len() {
            let params = self.kernel_params(group);
            match self.core.config.state_dtype {
                StateDtype::F32 => self.cpu_group_f32(group, &params, grads, inv_grad_scale)?,
                StateDtype::Bf16 => self.cpu_group_bf16(group, &params, grads, inv_grad_scale)?,
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

impl Checkpointed for FusedAdam {
    type Config = AdamConfig;
    type State = [Buffers; 3];

    fn core(&self) -> &Core<AdamConfig, [Buffers; 3]> {
        &self.core
    }

    fn core_mut(&mut self) -> &mut Core<AdamConfig, [Buffers; 3]> {
        &mut self.core
    }

    fn validate_config(config: &AdamConfig) -> Result<()> {
        config.validate()
    }

    fn fresh_state(config: &AdamConfig, params: &[OptimParam]) -> [Buffers; 3] {
        let moments = match config.state_dtype {
            StateDtype::F32 => Buffers::zeros,
            StateDtype::Bf16 => Buffers::zeros_bf16,
        };
        [
            moments("exp_avg", params, true),
            moments("exp_avg_sq", params, true),
            Buffers::zeros("max_exp_avg_sq", params, config.amsgrad),
        ]
    }
}
