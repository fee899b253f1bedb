//! What every fused optimizer holds and does the same way: its parameters, settings, applied-step count
//! and state buffers (f32, or bf16 moments), and the move of that state to a CUDA device on the first step there.

use candle_core::backprop::GradStore;

use super::params::ParamGroups;
use super::state::Buffers;
use crate::error::Result;

/// An optimizer's parts. `S` is its state buffers in a fixed order (an array, so each optimizer names
/// them by destructuring), the order of its kernels' table lists.
#[derive(Debug)]
pub(crate) struct Core<C, S> {
    pub groups: ParamGroups,
    pub config: C,
    /// Applied steps, as the host counts them (on a CUDA device the device's count is the truth:
    /// [`Core::applied_steps`]).
    pub step: u64,
    pub state: S,
    /// The optimizer's name in checkpoints (`"optimizer"` unless renamed).
    pub key: String,
    /// The state on a CUDA device once a step ran there: then the truth, `state` stale.
    #[cfg(feature = "cuda")]
    pub on_device: Option<crate::cuda::DeviceOptimizer>,
}

impl<C, S: AsRef<[Buffers]>> Core<C, S> {
    pub fn new(groups: ParamGroups, config: C, state: S) -> Self {
        Core {
            groups,
            config,
            step: 0,
            state,
            key: "optimizer".into(),
            #[cfg(feature = "cuda")]
            on_device: None,
        }
    }

    /// Steps applied so far; on a CUDA device this reads the device's count, waiting for queued steps.
    pub fn applied_steps(&self) -> Result<u64> {
        #[cfg(feature = "cuda")]
        if let Some(on_device) = &self.on_device {
            return on_device.applied_steps();
        }
        Ok(self.step)
    }

    /// Counts a step on the CPU, after checking what could make it fail part-way: every group's
    /// gradients found (none split between a working copy and its master) and no two tensors of the
    /// step sharing memory. A refused step changes nothing, its count included; an accepted one then
    /// updates every group.
    pub fn begin_cpu_step(&mut self, grads: &GradStore) -> Result<()> {
        let params = &self.groups.params;
        let present = super::driver::with_grads(params, None, grads)?;
        let mut all: Vec<&candle_core::Tensor> = present.iter().map(|(_, g)| *g).collect();
        for (i, _) in &present {
            all.push(params[*i].master.as_tensor());
            all.extend(params[*i].working.as_ref().map(|w| w.as_tensor()));
        }
        crate::storage::check_distinct(&all)?;
        self.step += 1;
        Ok(())
    }

    /// Bytes of state.
    pub fn state_bytes(&self) -> usize {
        self.state.as_ref().iter().map(Buffers::bytes).sum()
    }

    /// True when the gradients are on a CUDA device, so the step runs there.
    #[cfg(feature = "cuda")]
    pub fn on_cuda(&self, grads: &GradStore) -> bool {
        super::device::cuda_device(&self.groups, grads).is_some()
    }

    /// One step on the CUDA device of the gradients: the state moves there on the first, then
    /// `launch(group, ...)` per group. A step the host decided on is counted here; a gated one is
    /// counted on the device only when it ran.
    #[cfg(feature = "cuda")]
    pub fn device_step(
        &mut self,
        grads: &GradStore,
        gate: crate::cuda::Gate<'_>,
        launch: impl FnMut(usize, crate::cuda::Launch<'_>) -> Result<()>,
    ) -> Result<()> {
        let device =
            super::device::cuda_device(&self.groups, grads).ok_or_else(|| crate::Error::NotDeferrable {
                what: "an optimizer whose gradients are not on the CUDA device of the loss".into(),
            })?;
        let state: &[Buffers] = self.state.as_ref();
        super::device::step(
            &mut self.on_device,
            &device,
            &self.groups,
            state,
            grads,
            gate,
            self.step,
            launch,
        )?;
        if let crate::cuda::Gate::Host(_) = gate {
            self.step += 1;
        }
        Ok(())
    }
}
