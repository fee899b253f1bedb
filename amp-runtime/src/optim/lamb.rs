//! Fused LAMB: Adam's moments with a per-tensor trust ratio `||w|| / ||update||` (Apex `FusedLAMB`).
//! Two passes per parameter (the ratio needs the update's norm before the update is applied).

use amp_kernels::optim::{lamb_step, LambParams, LambTensor, TensorNorms};
use candle_core::backprop::GradStore;

use super::driver::{self, select_mut};
use super::params::ParamGroups;
use super::state::{self, Buffers};
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
        }
    }
}

/// Fused multi-tensor LAMB over fp32 masters with fp32 state.
#[derive(Debug)]
pub struct FusedLamb {
    groups: ParamGroups,
    config: LambConfig,
    step: u64,
    exp_avg: Buffers,
    exp_avg_sq: Buffers,
    norms: Vec<TensorNorms>,
    /// The moments on a CUDA device once a step ran there.
    #[cfg(feature = "cuda")]
    on_device: Option<crate::cuda::DeviceOptimizer>,
}

impl FusedLamb {
    /// An optimizer over `groups` with zeroed moments.
    pub fn new(groups: ParamGroups, config: LambConfig) -> Result<Self> {
        let params = &groups.params;
        Ok(FusedLamb {
            exp_avg: Buffers::zeros("exp_avg", params, true),
            exp_avg_sq: Buffers::zeros("exp_avg_sq", params, true),
            norms: Vec::new(),
            groups,
            config,
            step: 0,
            #[cfg(feature = "cuda")]
            on_device: None,
        })
    }

    /// The trust-ratio norms of the last step's last batch (`||w||`, `||update||` per tensor), for steps
    /// on the CPU (on a CUDA device they stay there: reading them back would wait for the device).
    pub fn last_norms(&self) -> &[TensorNorms] {
        &self.norms
    }

    /// One step on a CUDA device (the state moves there on the first).
    #[cfg(feature = "cuda")]
    fn device_step(
        &mut self,
        device: &candle_core::Device,
        grads: &GradStore,
        gate: crate::cuda::Gate<'_>,
    ) -> Result<()> {
        let params: Vec<LambParams> = (0..self.groups.groups.len()).map(|g| self.kernel_params(g)).collect();
        let state = [(&self.exp_avg, true), (&self.exp_avg_sq, true)];
        super::device::step(
            &mut self.on_device,
            device,
            &self.groups,
            &state,
            grads,
            gate,
            self.step,
            |group, (kernels, stream, table, inputs)| {
                let cuda_error = crate::cuda::cuda_error;
                let mut scratch = amp_kernels::cuda::LambBuffers::new(stream, table).map_err(cuda_error)?;
                // SAFETY: as for FusedAdam: every address in the table is a live buffer that outlives
                // the kernels, queued on candle's stream; the scratch is sized for the table.
                unsafe { kernels.lamb(stream, table, inputs, &params[group], &mut scratch) }
                    .map_err(cuda_error)
            },
        )
    }

    fn kernel_params(&self, group: usize) -> LambParams {
        let options = self.groups.groups[group];
        LambParams {
            lr: options.lr.unwrap_or(self.config.lr),
            beta1: self.config.beta1,
            beta2: self.config.beta2,
            eps: self.config.eps,
            weight_decay: options.weight_decay.unwrap_or(self.config.weight_decay),
            decoupled_weight_decay: self.config.decoupled_weight_decay,
            bias_correction: self.config.bias_correction,
            grad_averaging: self.config.grad_averaging,
            always_adapt: self.config.always_adapt,
            step: self.step,
        }
    }
}

impl FusedOptimizer for FusedLamb {
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
            let (m, v, norms) = (&mut self.exp_avg.values, &mut self.exp_avg_sq.values, &mut self.norms);
            driver::for_each_batch(&self.groups.params, &present, |indices, views| {
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
                lamb_step(&mut tensors, &params, inv_grad_scale, norms);
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
        self.exp_avg.bytes() + self.exp_avg_sq.bytes()
    }
}

impl state::Checkpointed for FusedLamb {
    type Config = LambConfig;

    fn core(&self) -> (LambConfig, u64, &ParamGroups) {
        (self.config, self.step, &self.groups)
    }

    fn buffers(&self) -> Vec<&Buffers> {
        vec![&self.exp_avg, &self.exp_avg_sq]
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
        config: LambConfig,
        step: u64,
        groups: Vec<super::GroupOptions>,
    ) -> Vec<&mut Buffers> {
        (self.config, self.step) = (config, step);
        for (mine, saved) in self.groups.groups.iter_mut().zip(groups) {
            *mine = saved;
        }
        vec![&mut self.exp_avg, &mut self.exp_avg_sq]
    }
}
