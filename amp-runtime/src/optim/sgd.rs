//! Fused SGD with momentum, dampening, Nesterov and weight decay (PyTorch's semantics), one pass per
//! parameter including the half working copy.

use amp_kernels::optim::{sgd_step, SgdParams, SgdTensor};
use candle_core::backprop::GradStore;

use super::driver::{self, select_mut};
use super::params::ParamGroups;
use super::state::{self, Buffers};
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
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig { lr: 0.01, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false }
    }
}

/// Fused multi-tensor SGD over fp32 masters with fp32 momentum buffers.
#[derive(Debug)]
pub struct FusedSgd {
    groups: ParamGroups,
    config: SgdConfig,
    step: u64,
    momentum: Buffers,
    /// The momentum buffers on a CUDA device once a step ran there.
    #[cfg(feature = "cuda")]
    on_device: Option<crate::cuda::DeviceOptimizer>,
}

impl FusedSgd {
    /// An optimizer over `groups`; refuses Nesterov without momentum or with dampening, as PyTorch does.
    pub fn new(groups: ParamGroups, config: SgdConfig) -> Result<Self> {
        if config.nesterov && (config.momentum <= 0.0 || config.dampening != 0.0) {
            return Err(Error::OptimizerState {
                reason: "Nesterov momentum needs momentum > 0 and dampening 0".into(),
            });
        }
        Ok(FusedSgd {
            momentum: Buffers::zeros("momentum_buffer", &groups.params, config.momentum != 0.0),
            groups,
            config,
            step: 0,
            #[cfg(feature = "cuda")]
            on_device: None,
        })
    }

    /// One step on a CUDA device (the state moves there on the first).
    #[cfg(feature = "cuda")]
    fn device_step(
        &mut self,
        device: &candle_core::Device,
        grads: &GradStore,
        gate: crate::cuda::Gate<'_>,
    ) -> Result<()> {
        let params: Vec<SgdParams> = (0..self.groups.groups.len()).map(|g| self.kernel_params(g)).collect();
        let state = [(&self.momentum, self.config.momentum != 0.0)];
        super::device::step(
            &mut self.on_device,
            device,
            &self.groups,
            &state,
            grads,
            gate,
            self.step,
            |group, (kernels, stream, table, inputs)| {
                // SAFETY: as for FusedAdam: every address in the table is a live buffer that outlives
                // the kernel, queued on candle's stream.
                unsafe { kernels.sgd(stream, table, inputs, &params[group]) }.map_err(crate::cuda::cuda_error)
            },
        )
    }

    fn kernel_params(&self, group: usize) -> SgdParams {
        let options = self.groups.groups[group];
        SgdParams {
            lr: options.lr.unwrap_or(self.config.lr),
            momentum: self.config.momentum,
            dampening: self.config.dampening,
            weight_decay: options.weight_decay.unwrap_or(self.config.weight_decay),
            nesterov: self.config.nesterov,
            first_step: self.step == 1,
        }
    }
}

impl FusedOptimizer for FusedSgd {
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
            let buffers = &mut self.momentum.values;
            driver::for_each_batch(&self.groups.params, &present, |indices, views| {
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
                sgd_step(&mut tensors, &params, inv_grad_scale);
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
        self.momentum.bytes()
    }
}

impl state::Checkpointed for FusedSgd {
    type Config = SgdConfig;

    fn core(&self) -> (SgdConfig, u64, &ParamGroups) {
        (self.config, self.step, &self.groups)
    }

    fn buffers(&self) -> Vec<&Buffers> {
        vec![&self.momentum]
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
        config: SgdConfig,
        step: u64,
        groups: Vec<super::GroupOptions>,
    ) -> Vec<&mut Buffers> {
        (self.config, self.step) = (config, step);
        for (mine, saved) in self.groups.groups.iter_mut().zip(groups) {
            *mine = saved;
        }
        vec![&mut self.momentum]
    }
}
