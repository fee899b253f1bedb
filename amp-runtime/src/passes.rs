//! The multi-tensor passes of a training step (unscale + check, check, global norm) on whatever device
//! the tensors are: amp-kernels' SIMD kernels on the CPU, its NVRTC kernels on a CUDA device.

use candle_core::Tensor;

use crate::error::Result;
use crate::{cuda, storage};

/// Multiplies every tensor by `inv_scale` in place; the index of the first tensor holding a stored
/// non-finite value.
pub(crate) fn unscale_and_check(tensors: &[&Tensor], inv_scale: f32) -> Result<Option<usize>> {
    if cuda::on_cuda(tensors) {
        return cuda::unscale_and_check(tensors, inv_scale);
    }
    let hits =
        storage::for_each_batch_mut(tensors, |s| amp_kernels::unscale::unscale_and_check(s, inv_scale))?;
    Ok(hits.iter().enumerate().find_map(|(b, hit)| hit.map(|i| b * storage::BATCH + i)))
}

/// The index of the first tensor holding a non-finite value, changing nothing.
pub(crate) fn find_non_finite(tensors: &[&Tensor]) -> Result<Option<usize>> {
    if cuda::on_cuda(tensors) {
        return cuda::find_non_finite(tensors);
    }
    storage::with_slices(tensors, amp_kernels::unscale::find_non_finite)
}

/// The L2 norm of all tensors together, times `|inv_scale|` (inf or NaN when a value is not finite).
pub(crate) fn global_l2_norm(tensors: &[&Tensor], inv_scale: f32) -> Result<f32> {
    if cuda::on_cuda(tensors) {
        return cuda::global_l2_norm(tensors, inv_scale);
    }
    storage::with_slices(tensors, |s| amp_kernels::norm::global_l2_norm(s, inv_scale))
}
