//! Fused LAMB: Adam's moments with a per-tensor trust ratio `||w|| / ||update||` (Apex `FusedLAMB`).
//! Two passes per parameter (the ratio needs the update's norm before the update is applied).

use amp_kernels::optim::{
    lamb_step, lamb_step_bf16_state, LambBf16Tensor, LambParams, LambTensor, TensorNorms,
};
use candle_core::backprop::GradStore;

use super::core::Core;
use super::driver::{self, select_mut};
use super::params::{OptimParam, ParamGroups};
use super::state::{Buffers, Checkpointed};
use super::state_dtype::{self, StateDtype};
use super::validate;
use super::FusedOptimizer;
use crate::error::Result;

/// Settings of [`FusedLamb`]; defaults are Apex `FusedLAMB`'s.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LambConfig {
    /// Learning rate (1e-3).
    pub lr: f64,
    /// Decay of the first moment (0.9).
    pub beta1: f64,
    /// Decay of the second moment (0.999).
    pub beta2: f64,
    /// Added to the root of the second moment (1e-6).
    pub eps: f64,
    /// Weight decay (0.01), added to the update (decoupled) or to the gradient.
    pub weight_decay: f64,
    /// Decoupled weight decay (true).
    pub decoupled_weight_decay: bool,
    /// Divide the moments by `1 - beta^t` (true).
    pub bias_correction: bool,
    /// Scale the gradient's contribution to `m` by `1 - beta1` (true).
    pub grad_averaging: bool,
    /// Apply the trust ratio even to tensors without weight decay (false; Apex's `use_nvlamb`).
    pub always_adapt: bool,
    /// The dtype the moments are kept in ([`StateDtype::F32`]). [`StateDtype::Bf16`] halves the
    /// optimizer's memory, rounding the moments stochastically (CPU only); the trust ratio is measured
    /// on the update computed from the rounded moments, the one applied.
    #[serde(default)]
    pub state_dtype: StateDtype,
}

impl Default for LambConfig {
    fn default() -> Self {
        LambConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-6,
            weight_decay: 0.01,
            decoupled_weight_decay: true,
            bias_correction: true,
            grad_averaging: true,
            always_adapt: false,
            state_dtype: StateDtype::F32,
        }
    }
}

impl LambConfig {
    /// Checks the settings, naming the field that is out of range.
    pub fn validate(&self) -> Result<()> {
        validate::non_negative("lr", self.lr)?;
        validate::decay("beta1", self.beta1)?;
        validate::decay("beta2", self.beta2)?;
        validate::positive("eps", self.eps)?;
        validate::non_negative("weight_decay", self.weight_decay)
    }
}

/// Fused multi-tensor LAMB over fp32 masters with fp32 state (or bf16: [`StateDtype`]).
///
/// Its bias correction counts the optimizer's applied steps, as Apex's `FusedLAMB` counts per group:
/// see [`FusedAdam`](super::FusedAdam) for what that means for parameters unfrozen part-way.
#[derive(Debug)]
pub struct FusedLamb {
    /// State: `exp_avg`, `exp_avg_sq`, in f32 or bf16 ([`StateDtype::Bf16`]).
    core: Core<LambConfig, [Buffers; 2]>,
    norms: Vec<TensorNorms>,
    /// Each parameter's random stream for bf16 moments' rounding.
    streams: Vec<u64>,
    /// Per group, the device scratch space of the last step (per-block partial norms, trust ratios),
    /// kept while it is large enough.
    #[cfg(feature = "cuda")]
    scratch: Vec<Option<amp_kernels::cuda::LambBuffers>>,
}

impl FusedLamb {
    /// An optimizer over `groups` with zeroed moments; refuses settings out of range.
    pub fn new(groups: ParamGroups, config: LambConfig) -> Result<Self> {
        config.validate()?;
        validate::groups(&groups.groups)?;
        let state = Self::fresh_state(&config, &groups.params);
        Ok(FusedLamb {
            #[cfg(feature = "cuda")]
            scratch: (0..groups.groups.len()).map(|_| None).collect(),
            streams: state_dtype::streams(&groups.params),
            core: Core::new(groups, config, state),
            norms: Vec::new(),
        })
    }

    /// The settings.
    pub fn config(&self) -> &LambConfig {
        &self.core.config
    }

    /// The trust-ratio norms of the last step's last batch (`||w||`, `||update||` per tensor), for steps
    /// on the CPU (on a CUDA device they stay there: reading them back would wait for the device).
    pub fn last_norms(&self) -> &[TensorNorms] {
        &self.norms
    }

    /// Names the optimizer in checkpoints (default `"optimizer"`), so that two optimizers (of two models,
    /// or of two parameter sets) can be saved in one checkpoint, as `GradScaler::named` does for scalers.
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.core.key = name.into();
        self
    }

    /// One step on the CUDA device of the gradients (the state moves there on the first).
    #[cfg(feature = "cuda")]
    fn device_step(&mut self, grads: &GradStore, gate: crate::cuda::Gate<'_>) -> Result<()> {
        use amp_kernels::cuda::LambBuffers;
        self.core.config.state_dtype.refuse_on_cuda()?;
        let params: Vec<LambParams> =
            (0..self.core.groups.groups.len()).map(|g| self.kernel_params(g)).collect();
        let scratch = &mut self.scratch;
        self.core.device_step(grads, gate, |group, (kernels, stream, table, inputs)| {
            let cuda_error = crate::cuda::cuda_error;
            let kept = scratch[group].take().filter(|s| s.fits(table));
            let scratch = match kept {
                Some(kept) => scratch[group].insert(kept),
                None => scratch[group].insert(LambBuffers::new(stream, table).map_err(cuda_error)?),
            };
            // SAFETY: as for FusedAdam: every address in the table is a live buffer that outlives the
            // kernels, queued on candle's stream; the scratch is large enough for the table.
            unsafe { kernels.lamb(stream, table, inputs, &params[group], scratch) }.map_err(cuda_error)
        })
    }

    fn kernel_params(&self, group: usize) -> LambParams {
        let (config, options) = (&self.core.config, self.core.groups.groups[group]);
        LambParams {
            lr: options.lr.unwrap_or(config.lr),
            beta1: config.beta1,
            beta2: config.beta2,
            eps: config.eps,
            weight_decay: options.weight_decay.unwrap_or(config.weight_decay),
            decoupled_weight_decay: config.decoupled_weight_decay,
            bias_correction: config.bias_correction,
            grad_averaging: config.grad_averaging,
            always_adapt: config.always_adapt,
            step: self.core.step,
        }
    }

    /// One group's step on the CPU with f32 moments.
    fn cpu_group_f32(
        &mut self,
        group: usize,
        params: &LambParams,
        grads: &GradStore,
        inv_scale: f32,
    ) -> Result<()> {
        let core = &mut self.core;
        let present = driver::with_grads(&core.groups.params, Some(group), grads)?;
        let [m, v] = &mut core.state;
        let (m, v, norms) = (m.f32_mut()?, v.f32_mut()?, &mut self.norms);
        driver::for_each_batch(&core.groups.params, &present, |indices, views| {
            let mut tensors: Vec<LambTensor<'_>> = views
                .iter_mut()
                .zip(select_mut(m, indices).into_iter().zip(select_mut(v, indices)))
                .map(|(view, (m, v))| LambTensor {
                    master: &mut *view.master,
                    grad: view.grad,
                    exp_avg: m,
                    exp_avg_sq: v,
                    working: view.working.as_mut().map(|w| w.reborrow()),
                })
                .collect();
            norms.resize(tensors.len(), TensorNorms::default());
            lamb_step(&mut tensors, params, inv_scale, norms);
        })
    }

    /// One group's step on the CPU with bf16 moments, each parameter's rounding drawn from a stream
    /// named by its path.
    fn cpu_group_bf16(
        &mut self,
        group: usize,
        params: &LambParams,
        grads: &GradStore,
        inv_scale: f32,
    ) -> Result<()> {
        let core = &mut self.core;
        let present = driver::with_grads(&core.groups.params, Some(group), grads)?;
        let streams = &self.streams;
        let [m, v] = &mut core.state;
        let (m, v, norms) = (m.bf16_mut()?, v.bf16_mut()?, &mut self.norms);
        driver::for_each_batch(&core.groups.params, &present, |indices, views| {
            let mut tensors: Vec<LambBf16Tensor<'_>> = views
                .iter_mut()
                .zip(select_mut(m, indices).into_iter().zip(select_mut(v, indices)))
                .zip(indices)
                .map(|((view, (m, v)), &i)| LambBf16Tensor {
                    master: &mut *view.master,
                    grad: view.grad,
                    exp_avg: m,
                    exp_avg_sq: v,
                    working: view.working.as_mut().map(|w| w.reborrow()),
                    stream: streams[i],
                })
                .collect();
            norms.resize(tensors.len(), TensorNorms::default());
            lamb_step_bf16_state(&mut tensors, params, inv_scale, norms);
        })
    }
}

impl FusedOptimizer for FusedLamb {
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

impl Checkpointed for FusedLamb {
    type Config = LambConfig;
    type State = [Buffers; 2];

    fn core(&self) -> &Core<LambConfig, [Buffers; 2]> {
        &self.core
    }

    fn core_mut(&mut self) -> &mut Core<LambConfig, [Buffers; 2]> {
        &mut self.core
    }

    fn validate_config(config: &LambConfig) -> Result<()> {
        config.validate()
    }

    fn fresh_state(config: &LambConfig, params: &[OptimParam]) -> [Buffers; 2] {
        let moments = match config.state_dtype {
            StateDtype::F32 => Buffers::zeros,
            StateDtype::Bf16 => Buffers::zeros_bf16,
        };
        [moments("exp_avg", params, true), moments("exp_avg_sq", params, true)]
    }
}
