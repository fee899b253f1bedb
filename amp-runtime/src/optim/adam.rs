//! Fused Adam and AdamW: one pass per parameter reads the gradient (unscaling it inline), updates the
//! fp32 master and moments, and writes the half working copy.

use amp_kernels::optim::{adam_step, AdamParams, AdamTensor};
use candle_core::backprop::GradStore;

use super::driver::{self, select_mut};
use super::params::ParamGroups;
use super::state::{self, Buffers};
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
        }
    }
}

impl AdamConfig {
    /// PyTorch's `Adam` defaults: L2 penalty instead of decoupled decay, no weight decay.
    pub fn adam() -> Self {
        AdamConfig { weight_decay: 0.0, decoupled_weight_decay: false, ..Self::default() }
    }
}

/// Fused multi-tensor Adam / AdamW over fp32 masters with fp32 state.
#[derive(Debug)]
pub struct FusedAdam {
    groups: ParamGroups,
    config: AdamConfig,
    step: u64,
    exp_avg: Buffers,
    exp_avg_sq: Buffers,
    max_exp_avg_sq: Buffers,
    /// The moments on a CUDA device once a step ran there: then the truth, the host copies stale.
    #[cfg(feature = "cuda")]
    on_device: Option<crate::cuda::DeviceOptimizer>,
}

/// AdamW is [`FusedAdam`] with its default config.
pub type FusedAdamW = FusedAdam;

impl FusedAdam {
    /// An optimizer over `groups` with zeroed moments.
    pub fn new(groups: ParamGroups, config: AdamConfig) -> Result<Self> {
        let params = &groups.params;
        Ok(FusedAdam {
            exp_avg: Buffers::zeros("exp_avg", params, true),
            exp_avg_sq: Buffers::zeros("exp_avg_sq", params, true),
            max_exp_avg_sq: Buffers::zeros("max_exp_avg_sq", params, config.amsgrad),
            groups,
            config,
            step: 0,
            #[cfg(feature = "cuda")]
            on_device: None,
        })
    }

    /// The settings.
    pub fn config(&self) -> &AdamConfig {
        &self.config
    }

    /// Applied steps so far (bias correction uses it). On a CUDA device this reads the device's count,
    /// waiting for the queued steps.
    pub fn steps(&self) -> Result<u64> {
        #[cfg(feature = "cuda")]
        if let Some(on_device) = &self.on_device {
            return on_device.applied_steps();
        }
        Ok(self.step)
    }

    /// One step on a CUDA device (the state moves there on the first).
    #[cfg(feature = "cuda")]
    fn device_step(
        &mut self,
        device: &candle_core::Device,
        grads: &GradStore,
        gate: crate::cuda::Gate<'_>,
    ) -> Result<()> {
        let params: Vec<AdamParams> = (0..self.groups.groups.len()).map(|g| self.kernel_params(g)).collect();
        let state =
            [(&self.exp_avg, true), (&self.exp_avg_sq, true), (&self.max_exp_avg_sq, self.config.amsgrad)];
        super::device::step(
            &mut self.on_device,
            device,
            &self.groups,
            &state,
            grads,
            gate,
            self.step,
            |group, (kernels, stream, table, inputs)| {
                // SAFETY: the table holds live device buffers of the recorded types (gradients in
                // `grads`, masters and copies in the parameters, state in `on_device`), all of which
                // outlive the kernel, queued on candle's stream.
                unsafe { kernels.adam(stream, table, inputs, &params[group]) }
                    .map_err(crate::cuda::cuda_error)
            },
        )
    }

    fn kernel_params(&self, group: usize) -> AdamParams {
        let options = self.groups.groups[group];
        AdamParams {
            lr: options.lr.unwrap_or(self.config.lr),
            beta1: self.config.beta1,
            beta2: self.config.beta2,
            eps: self.config.eps,
            weight_decay: options.weight_decay.unwrap_or(self.config.weight_decay),
            decoupled_weight_decay: self.config.decoupled_weight_decay,
            amsgrad: self.config.amsgrad,
            bias_correction: self.config.bias_correction,
            step: self.step,
        }
    }
}

impl FusedOptimizer for FusedAdam {
    fn step_scaled(&mut self, grads: &GradStore, inv_grad_scale: f32) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(device) = super::device::cuda_device(&self.groups, grads) {
            self.device_step(&device, grads, crate::cuda::Gate::Host(inv_grad_scale))?;
            self.step += 1;
            return Ok(());
        }
        self.step += 1;
        for group in 0..self.groups.groups.len() {
            let params = self.kernel_params(group);
            let present = driver::with_grads(&self.groups.params, Some(group), grads);
            let (m, v, vmax) =
                (&mut self.exp_avg.values, &mut self.exp_avg_sq.values, &mut self.max_exp_avg_sq.values);
            driver::for_each_batch(&self.groups.params, &present, |indices, views| {
                let (m, v, vmax) =
                    (select_mut(m, indices), select_mut(v, indices), select_mut(vmax, indices));
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
                adam_step(&mut tensors, &params, inv_grad_scale);
            })?;
        }
        crate::CastCache::clear();
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn step_gated(&mut self, grads: &GradStore, gate: &crate::cuda::DeviceGate<'_>) -> Result<()> {
        let device = super::device::gated_device(&self.groups, grads)?;
        self.device_step(&device, grads, crate::cuda::Gate::Device(*gate))
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    fn param_groups(&self) -> &ParamGroups {
        &self.groups
    }

    fn state_bytes(&self) -> usize {
        self.exp_avg.bytes() + self.exp_avg_sq.bytes() + self.max_exp_avg_sq.bytes()
    }
}

impl state::Checkpointed for FusedAdam {
    type Config = AdamConfig;

    fn core(&self) -> (AdamConfig, u64, &ParamGroups) {
        (self.config, self.step, &self.groups)
    }

    fn buffers(&self) -> Vec<&Buffers> {
        vec![&self.exp_avg, &self.exp_avg_sq, &self.max_exp_avg_sq]
    }

    #[cfg(feature = "cuda")]
    fn device_state(&self) -> Option<&crate::cuda::DeviceOptimizer> {
        self.on_device.as_ref()
    }

    #[cfg(feature = "cuda")]
    fn forget_device_state(&mut self) {
        self.on_device = None;
    }

    fn restore_core(
        &mut self,
        config: AdamConfig,
        step: u64,
        groups: Vec<super::GroupOptions>,
    ) -> Vec<&mut Buffers> {
        (self.config, self.step) = (config, step);
        for (mine, saved) in self.groups.groups.iter_mut().zip(groups) {
            *mine = saved;
        }
        vec![&mut self.exp_avg, &mut self.exp_avg_sq, &mut self.max_exp_avg_sq]
    }
}
