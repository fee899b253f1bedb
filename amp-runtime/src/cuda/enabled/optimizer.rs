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

/// The state buffers of every parameter, on the device; `None` for a kind not in use (AMSGrad off, no
/// momentum), which the kernels see as null pointers.
#[derive(Debug)]
pub(crate) struct DeviceOptimizer {
    gpu: Gpu,
    state: Vec<Option<Vec<CudaSlice<f32>>>>,
    /// Elements per parameter (an empty parameter still gets a one-element buffer).
    lens: Vec<usize>,
    /// Carries the step's gradient factor in its inverse-scale word; its skip flag stays clear (the
    /// scaler decided to step before calling the optimizer).
    factor: DeviceScaler,
    /// Applied steps before this one (bias correction, SGD's first step).
    steps: CudaSlice<i64>,
    /// The last table of each group: reused while the addresses stay the same.
    tables: Vec<Option<DeviceTable>>,
}

impl DeviceOptimizer {
    /// Uploads the host state (zeros, or what a checkpoint restored); `None` for kinds not in use.
    pub fn new(device: &Device, groups: &ParamGroups, state: &[Option<&[Vec<f32>]>]) -> Result<Self> {
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
            steps: gpu.stream.alloc_zeros(1).map_err(cuda_error)?,
            tables: (0..groups.groups.len()).map(|_| None).collect(),
            state,
            gpu,
        })
    }

    /// Uploads the step's gradient factor and the number of applied steps before it (the host's count
    /// is the truth), asynchronously.
    pub fn begin_step(&mut self, inv_grad_scale: f32, step: u64) -> Result<()> {
        let state = ScaleState { inv_scale: inv_grad_scale, ..ScaleState::new(1.0, 1) };
        self.factor.write(&self.gpu.stream, &state).map_err(cuda_error)?;
        let before = i64::try_from(step.saturating_sub(1)).unwrap_or(i64::MAX);
        self.gpu.stream.memcpy_htod(&[before], &mut self.steps).map_err(cuda_error)?;
        Ok(())
    }

    /// Calls `launch` with `group`'s table (built from the current addresses, uploaded only when they
    /// changed); does nothing when no parameter of the group has a gradient.
    pub fn launch_group(
        &mut self,
        groups: &ParamGroups,
        grads: &GradStore,
        group: usize,
        launch: impl FnOnce(Launch<'_>) -> Result<()>,
    ) -> Result<()> {
        let Some(table) = self.table(groups, grads, group)? else { return Ok(()) };
        let device_table = match self.tables[group].take() {
            Some(cached) if cached.describes(&table) => cached,
            _ => DeviceTable::upload(&self.gpu.stream, table).map_err(cuda_error)?,
        };
        let inputs = OptimizerStep { steps: &self.steps, scaler: &self.factor, factor: GradFactor::InvScale };
        launch((&self.gpu.kernels, &self.gpu.stream, &device_table, inputs))?;
        self.tables[group] = Some(device_table);
        Ok(())
    }

    /// The launch table of `group`'s parameters that have a gradient, or `None` when none has.
    fn table(&self, groups: &ParamGroups, grads: &GradStore, group: usize) -> Result<Option<LaunchTable>> {
        let stream = &self.gpu.stream;
        let mut lists: Vec<Vec<u64>> = vec![Vec::new(); self.state.len() + 3];
        let (mut lens, mut kinds) = (Vec::new(), Vec::new());
        for (i, param) in groups.params.iter().enumerate().filter(|(_, p)| p.group == group) {
            let Some(grad) = grads.get(param.trainable.as_tensor()) else { continue };
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
            lens.push(master.len);
            kinds.push(TensorKind { grad: grad.dtype, working: working.map(|w| w.dtype) });
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
