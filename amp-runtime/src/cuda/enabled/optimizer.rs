//! A fused optimizer's fp32 state on a CUDA device, and what each of its launches needs: one table per
//! parameter group over every parameter with a gradient, whatever its mix of f32 / f16 / bf16 gradients
//! and working copies (lists: gradient, master, the state buffers in order, working copy).

use std::sync::Arc;

use amp_kernels::cuda::{
    CudaKernels, DeviceScaler, DeviceTable, GradFactor, LaunchTable, OptimizerStep, ScaleState, TensorKind,
    CHUNK_ELEMENTS,
};
use amp_kernels::Dtype;
use candle_core::backprop::GradStore;
use candle_core::Device;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::tensors::device_ref;
use super::{cuda_error, Gpu};
use crate::error::{Error, Result};
use crate::optim::{OptimParam, ParamGroups};

/// What a launch closure gets: the kernels, the stream, the group's table, the step inputs.
pub(crate) type Launch<'a> = (&'a CudaKernels, &'a Arc<CudaStream>, &'a DeviceTable, OptimizerStep<'a>);

/// A loss scaler's verdict on the device, handed to [`FusedOptimizer::step_gated`](crate::optim::FusedOptimizer::step_gated)
/// by [`GradScaler::step_fused_deferred`](crate::GradScaler::step_fused_deferred): the kernels skip
/// the step when its flag is set and read the gradient factor from device memory, so nobody waits for
/// the device. Only amp makes one.
#[derive(Clone, Copy, Debug)]
pub struct DeviceGate<'a> {
    pub(crate) scaler: &'a DeviceScaler,
    pub(crate) factor: GradFactor<'a>,
}

/// Who decided that a step runs and what gradients are multiplied by.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Gate<'a> {
    /// The host: the step runs, gradients are multiplied by this factor.
    Host(f32),
    /// A loss scaler on the device (a deferred step).
    Device(DeviceGate<'a>),
}

/// The state buffers of every parameter, on the device; `None` for a kind not in use (AMSGrad off, no
/// momentum), which the kernels see as null pointers.
#[derive(Debug)]
pub(crate) struct DeviceOptimizer {
    gpu: Gpu,
    state: Vec<Option<Vec<CudaSlice<f32>>>>,
    /// Elements per parameter (an empty parameter still gets a one-element buffer).
    lens: Vec<usize>,
    /// Carries a host-decided step's gradient factor in its inverse-scale word; its skip flag stays
    /// clear (the scaler decided to step before calling the optimizer).
    factor: DeviceScaler,
    /// Applied steps (bias correction, SGD's first step): counted on the device, since a deferred
    /// step's outcome is known only there; the truth while the state lives on the device.
    steps: CudaSlice<i64>,
    /// The last table of each group: reused while the addresses stay the same.
    tables: Vec<Option<DeviceTable>>,
}

impl DeviceOptimizer {
    /// Uploads the host state (zeros, or what a checkpoint restored; `None` for kinds not in use) and
    /// the count of steps applied so far.
    pub fn new(
        device: &Device,
        groups: &ParamGroups,
        state: &[Option<&[Vec<f32>]>],
        applied: u64,
    ) -> Result<Self> {
        let gpu = Gpu::of(device)?;
        let upload = |values: &[Vec<f32>]| -> Result<Vec<CudaSlice<f32>>> {
            values
                .iter()
                .map(|v| if v.is_empty() { gpu.stream.alloc_zeros(1) } else { gpu.stream.clone_htod(v) })
                .collect::<std::result::Result<_, _>>()
                .map_err(cuda_error)
        };
        let state = state.iter().map(|kind| kind.map(upload).transpose()).collect::<Result<Vec<_>>>()?;
        Ok(DeviceOptimizer {
            lens: groups.params.iter().map(OptimParam::elem_count).collect(),
            factor: DeviceScaler::new(&gpu.stream, &ScaleState::new(1.0, 1)).map_err(cuda_error)?,
            steps: gpu
                .stream
                .clone_htod(&[i64::try_from(applied).unwrap_or(i64::MAX)])
                .map_err(cuda_error)?,
            tables: (0..groups.groups.len()).map(|_| None).collect(),
            state,
            gpu,
        })
    }

    /// Uploads a host-decided step's gradient factor, asynchronously (a deferred step reads its
    /// factor from the scaler's gate instead).
    pub fn begin_step(&mut self, gate: Gate<'_>) -> Result<()> {
        if let Gate::Host(inv_grad_scale) = gate {
            let state = ScaleState { inv_scale: inv_grad_scale, ..ScaleState::new(1.0, 1) };
            self.factor.write(&self.gpu.stream, &state).map_err(cuda_error)?;
        }
        Ok(())
    }

    /// Counts the step on the device unless the gate's flag says it was skipped.
    pub fn end_step(&mut self, gate: Gate<'_>) -> Result<()> {
        let flag = match gate {
            Gate::Host(_) => &self.factor,
            Gate::Device(gate) => gate.scaler,
        };
        self.gpu.kernels.count_step(&self.gpu.stream, &mut self.steps, flag).map_err(cuda_error)
    }

    /// Steps applied so far: reads the device's counter, waiting for the queued steps.
    pub fn applied_steps(&self) -> Result<u64> {
        let steps = self.gpu.stream.clone_dtoh(&self.steps).map_err(cuda_error)?;
        Ok(steps.first().map_or(0, |&n| u64::try_from(n).unwrap_or(0)))
    }

    /// Calls `launch` with `group`'s table (built from the current addresses, uploaded only when they
    /// changed); does nothing when no parameter of the group has a gradient.
    pub fn launch_group(
        &mut self,
        groups: &ParamGroups,
        grads: &GradStore,
        group: usize,
        gate: Gate<'_>,
        launch: impl FnOnce(Launch<'_>) -> Result<()>,
    ) -> Result<()> {
        let Some(table) = self.table(groups, grads, group)? else { return Ok(()) };
        let device_table = match self.tables[group].take() {
            Some(cached) if cached.describes(&table) => cached,
            _ => DeviceTable::upload(&self.gpu.stream, table).map_err(cuda_error)?,
        };
        let inputs = match gate {
            Gate::Host(_) => {
                OptimizerStep { steps: &self.steps, scaler: &self.factor, factor: GradFactor::InvScale }
            }
            Gate::Device(gate) => {
                OptimizerStep { steps: &self.steps, scaler: gate.scaler, factor: gate.factor }
            }
        };
        launch((&self.gpu.kernels, &self.gpu.stream, &device_table, inputs))?;
        self.tables[group] = Some(device_table);
        Ok(())
    }

    /// The launch table of `group`'s parameters that have a gradient, or `None` when none has.
    fn table(&self, groups: &ParamGroups, grads: &GradStore, group: usize) -> Result<Option<LaunchTable>> {
        let stream = &self.gpu.stream;
        // grad, master, the state kinds, working copy, random stream (f32 state here: it draws none).
        let mut lists: Vec<Vec<u64>> = vec![Vec::new(); self.state.len() + 4];
        let (mut lens, mut kinds) = (Vec::new(), Vec::new());
        for (i, param) in groups.params.iter().enumerate().filter(|(_, p)| p.group == group) {
            let Some(grad) = param.grad(grads)? else { continue };
            let grad = device_ref(grad, stream)?;
            let master = device_ref(param.master.as_tensor(), stream)?;
            if master.dtype != Dtype::F32 {
                return Err(no_master(param));
            }
            let working = param.working.as_ref().map(|w| device_ref(w.as_tensor(), stream)).transpose()?;
            if grad.len != master.len || working.is_some_and(|w| w.len != master.len) {
                return Err(Error::Internal {
                    what: format!("`{}`: gradient / copy sizes differ", param.path),
                });
            }
            lists[0].push(grad.address);
            lists[1].push(master.address);
            for (kind, list) in self.state.iter().zip(&mut lists[2..]) {
                list.push(kind.as_ref().map_or(0, |buffers| buffers[i].device_ptr(stream).0));
            }
            lists[self.state.len() + 2].push(working.map_or(0, |w| w.address));
            lists[self.state.len() + 3].push(0);
            lens.push(master.len);
            kinds.push(TensorKind { grad: grad.dtype, working: working.map(|w| w.dtype), state: Dtype::F32 });
        }
        if lens.is_empty() {
            return Ok(None);
        }
        let borrowed: Vec<&[u64]> = lists.iter().map(Vec::as_slice).collect();
        Ok(Some(LaunchTable::new(&borrowed, &lens, &kinds, CHUNK_ELEMENTS).map_err(cuda_error)?))
    }

    /// The state on the host (for checkpoints), one entry per kind, `None` for kinds not in use; waits
    /// for the stream.
    pub fn download(&self) -> Result<Vec<Option<Vec<Vec<f32>>>>> {
        let stream = &self.gpu.stream;
        let read = |slices: &Vec<CudaSlice<f32>>| -> Result<Vec<Vec<f32>>> {
            slices
                .iter()
                .zip(&self.lens)
                .map(|(s, &len)| {
                    let mut values = stream.clone_dtoh(s).map_err(cuda_error)?;
                    values.truncate(len);
                    Ok(values)
                })
                .collect()
        };
        self.state.iter().map(|kind| kind.as_ref().map(read).transpose()).collect()
    }
}

fn no_master(param: &OptimParam) -> Error {
    Error::NoFp32Master { path: param.path.clone(), precision: crate::Precision::Bf16 }
}
