//! The scaler's passes on the device: unscale + check, check, global norm. Each reads back one small
//! result (the first non-finite tensor, or the norm), the one synchronisation of a step.

use amp_kernels::cuda::{
    DeviceScaler, DeviceTable, LaunchTable, NormBuffers, ScaleState, TensorKind, CHUNK_ELEMENTS,
};
use candle_core::Tensor;

use super::tensors::device_refs;
use super::{cuda_error, Gpu};
use crate::error::Result;

/// A one-list table over `tensors`, a scaler state carrying `inv_scale`, on the tensors' device.
fn prepare(tensors: &[&Tensor], inv_scale: f32) -> Result<(Gpu, DeviceTable, DeviceScaler)> {
    let gpu = Gpu::of(tensors[0].device())?;
    let refs = device_refs(tensors, &gpu.stream)?;
    let addresses: Vec<u64> = refs.iter().map(|r| r.address).collect();
    let lens: Vec<usize> = refs.iter().map(|r| r.len).collect();
    let kinds: Vec<TensorKind> = refs.iter().map(|r| TensorKind::grad(r.dtype)).collect();
    let table = LaunchTable::new(&[&addresses], &lens, &kinds, CHUNK_ELEMENTS).map_err(cuda_error)?;
    let table = DeviceTable::upload(&gpu.stream, table).map_err(cuda_error)?;
    let state = ScaleState { inv_scale, ..ScaleState::new(1.0, 1) };
    let scaler = DeviceScaler::new(&gpu.stream, &state).map_err(cuda_error)?;
    Ok((gpu, table, scaler))
}

/// [`amp_kernels::unscale::unscale_and_check`] on CUDA tensors.
pub(crate) fn unscale_and_check(tensors: &[&Tensor], inv_scale: f32) -> Result<Option<usize>> {
    if tensors.is_empty() {
        return Ok(None);
    }
    let (gpu, table, mut scaler) = prepare(tensors, inv_scale)?;
    // SAFETY: the table holds the addresses of `tensors`, which outlive this call, contiguous, of the
    // recorded dtypes; the read-back below waits for the kernel.
    unsafe { gpu.kernels.unscale(&gpu.stream, &table, &mut scaler) }.map_err(cuda_error)?;
    let state = scaler.read(&gpu.stream).map_err(cuda_error)?;
    Ok(state.bad_tensor.map(|t| t as usize))
}

/// [`amp_kernels::unscale::find_non_finite`] on CUDA tensors.
pub(crate) fn find_non_finite(tensors: &[&Tensor]) -> Result<Option<usize>> {
    if tensors.is_empty() {
        return Ok(None);
    }
    let (gpu, table, mut scaler) = prepare(tensors, 1.0)?;
    // SAFETY: as in `unscale_and_check`; this kernel only reads.
    unsafe { gpu.kernels.find_non_finite(&gpu.stream, &table, &mut scaler) }.map_err(cuda_error)?;
    let state = scaler.read(&gpu.stream).map_err(cuda_error)?;
    Ok(state.bad_tensor.map(|t| t as usize))
}

/// [`amp_kernels::norm::global_l2_norm`] on CUDA tensors (deterministic two-stage reduction).
pub(crate) fn global_l2_norm(tensors: &[&Tensor], inv_scale: f32) -> Result<f32> {
    if tensors.is_empty() {
        return Ok(0.0);
    }
    let (gpu, table, mut scaler) = prepare(tensors, inv_scale)?;
    let mut norms = NormBuffers::new(&gpu.stream, &table).map_err(cuda_error)?;
    // SAFETY: as in `unscale_and_check`; these kernels only read the tensors.
    unsafe { gpu.kernels.global_norm(&gpu.stream, &table, &mut scaler, None, &mut norms) }
        .map_err(cuda_error)?;
    let (norm, _) = norms.read(&gpu.stream).map_err(cuda_error)?;
    Ok(norm)
}
