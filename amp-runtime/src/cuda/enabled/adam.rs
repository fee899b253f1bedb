//! [`FusedAdam`](crate::optim::FusedAdam)'s state on a CUDA device, and its step: one launch per
//! parameter group over every parameter, whatever mix of f32 / f16 / bf16 gradients and working copies.

use amp_kernels::cuda::{
    DeviceScaler, DeviceTable, GradFactor, LaunchTable, OptimizerStep, ScaleState, TensorKind, CHUNK_ELEMENTS,
};
use amp_kernels::optim::AdamParams;
use amp_kernels::Dtype;
use candle_core::backprop::GradStore;
use candle_core::Device;
use cudarc::driver::{CudaSlice, DevicePtr};

use super::tensors::device_ref;
use super::{cuda_error, Gpu};
use crate::error::{Error, Result};
use crate::optim::{OptimParam, ParamGroups};

/// Moments (and the AMSGrad maximum) of every parameter, on the device.
#[derive(Debug)]
pub(crate) struct AdamOnDevice {
    gpu: Gpu,
    exp_avg: Vec<CudaSlice<f32>>,
    exp_avg_sq: Vec<CudaSlice<f32>>,
    max_exp_avg_sq: Option<Vec<CudaSlice<f32>>>,
    /// Carries the step's gradient factor in its inverse-scale word; its skip flag stays clear (the
    /// scaler decided to step before calling the optimizer).
    factor: DeviceScaler,
    /// Applied steps before this one, for bias correction.
    steps: CudaSlice<i64>,
    /// The last table of each group: reused while the addresses stay the same.
    tables: Vec<Option<DeviceTable>>,
    /// Elements per parameter (an empty parameter still gets a one-element buffer).
    lens: Vec<usize>,
}

impl AdamOnDevice {
    /// Uploads the host state (zeros, or what a checkpoint restored).
    pub fn new(
        device: &Device,
        groups: usize,
        exp_avg: &[Vec<f32>],
        exp_avg_sq: &[Vec<f32>],
        max_exp_avg_sq: Option<&[Vec<f32>]>,
    ) -> Result<Self> {
        let gpu = Gpu::of(device)?;
        let upload = |values: &[Vec<f32>]| -> Result<Vec<CudaSlice<f32>>> {
            values
                .iter()
                .map(|v| if v.is_empty() { gpu.stream.alloc_zeros(1) } else { gpu.stream.clone_htod(v) })
                .collect::<std::result::Result<_, _>>()
                .map_err(cuda_error)
        };
        Ok(AdamOnDevice {
            exp_avg: upload(exp_avg)?,
            exp_avg_sq: upload(exp_avg_sq)?,
            max_exp_avg_sq: max_exp_avg_sq.map(upload).transpose()?,
            factor: DeviceScaler::new(&gpu.stream, &ScaleState::new(1.0, 1)).map_err(cuda_error)?,
            steps: gpu.stream.alloc_zeros(1).map_err(cuda_error)?,
            tables: (0..groups).map(|_| None).collect(),
            lens: exp_avg.iter().map(Vec::len).collect(),
            gpu,
        })
    }

    /// One step of every group. `params_of(group)` gives a group's hyper-parameters with `step` set
    /// (the host's count is the truth; it is uploaded with the factor, asynchronously).
    pub fn step(
        &mut self,
        groups: &ParamGroups,
        grads: &GradStore,
        inv_grad_scale: f32,
        params_of: impl Fn(usize) -> AdamParams,
    ) -> Result<()> {
        let stream = self.gpu.stream.clone();
        let step = params_of(0).step;
        let state = ScaleState { inv_scale: inv_grad_scale, ..ScaleState::new(1.0, 1) };
        self.factor.write(&stream, &state).map_err(cuda_error)?;
        let before = i64::try_from(step.saturating_sub(1)).unwrap_or(i64::MAX);
        stream.memcpy_htod(&[before], &mut self.steps).map_err(cuda_error)?;
        for group in 0..groups.groups.len() {
            let table = self.table(groups, grads, group)?;
            let Some(table) = table else { continue };
            let device_table = match self.tables[group].take() {
                Some(cached) if cached.describes(&table) => cached,
                _ => DeviceTable::upload(&stream, table).map_err(cuda_error)?,
            };
            let inputs =
                OptimizerStep { steps: &self.steps, scaler: &self.factor, factor: GradFactor::InvScale };
            // SAFETY: every address in the table is a live, contiguous device buffer of the recorded type
            // and length: gradients held by `grads`, masters and working copies held by the parameters,
            // moments held by `self`; all outlive the kernel, which runs on candle's stream in order.
            unsafe { self.gpu.kernels.adam(&stream, &device_table, inputs, &params_of(group)) }
                .map_err(cuda_error)?;
            self.tables[group] = Some(device_table);
        }
        Ok(())
    }

    /// The launch table of `group`'s parameters that have a gradient, or `None` when none has.
    fn table(&self, groups: &ParamGroups, grads: &GradStore, group: usize) -> Result<Option<LaunchTable>> {
        let stream = &self.gpu.stream;
        let mut lists: [Vec<u64>; 6] = Default::default();
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
            lists[2].push(self.exp_avg[i].device_ptr(stream).0);
            lists[3].push(self.exp_avg_sq[i].device_ptr(stream).0);
            lists[4].push(self.max_exp_avg_sq.as_ref().map_or(0, |v| v[i].device_ptr(stream).0));
            lists[5].push(working.map_or(0, |w| w.address));
            lens.push(master.len);
            kinds.push(TensorKind { grad: grad.dtype, working: working.map(|w| w.dtype) });
        }
        if lens.is_empty() {
            return Ok(None);
        }
        let borrowed: Vec<&[u64]> = lists.iter().map(Vec::as_slice).collect();
        Ok(Some(LaunchTable::new(&borrowed, &lens, &kinds, CHUNK_ELEMENTS).map_err(cuda_error)?))
    }

    /// The moments on the host (for checkpoints): waits for the stream.
    pub fn download(&self) -> Result<[Vec<Vec<f32>>; 3]> {
        let stream = &self.gpu.stream;
        let read = |slices: &[CudaSlice<f32>]| -> Result<Vec<Vec<f32>>> {
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
        let vmax = match &self.max_exp_avg_sq {
            Some(v) => read(v)?,
            None => vec![Vec::new(); self.exp_avg.len()],
        };
        Ok([read(&self.exp_avg)?, read(&self.exp_avg_sq)?, vmax])
    }
}

fn no_master(param: &OptimParam) -> Error {
    Error::NoFp32Master { path: param.path.clone(), precision: crate::Precision::Bf16 }
}
