//! Collectives on device memory: what an engine that moves GPU buffers (NCCL) adds to
//! [`Communicator`](super::Communicator), so that CUDA gradients and masters never visit the host.

use candle_core::Tensor;

use super::wire::Wire;
use crate::error::Result;

/// Collectives on tensors where they live (contiguous f32 / f16 / bf16 CUDA tensors), ordered on the
/// tensors' stream with the work candle queued there. Every rank must pass tensors of the same lengths
/// and dtypes in the same order.
///
/// Reached through [`Communicator::device_collectives`](super::Communicator::device_collectives):
/// [`Nccl`](super::Nccl) has them; MPI and [`SingleProcess`](super::SingleProcess) move host memory only.
pub trait DeviceCollectives {
    /// Replaces each tensor by `scale` times its element-wise sum over the ranks, in place. The values
    /// travel as `wire` says: a tensor of the wire's dtype is summed where it is, then scaled; another
    /// is converted to the wire's dtype (one rounding), summed, scaled in f32 and converted back into
    /// place (one more for a half tensor on an fp32 wire). Scaling before the conversion back keeps an
    /// average that fits a half tensor from overflowing as its sum would (two fp16 gradients of 40,000
    /// average to 40,000; they sum to 80,000, past fp16's range).
    fn all_reduce_sum_tensors(&self, tensors: &[&Tensor], wire: Wire, scale: f32) -> Result<()>;

    /// Copies `root`'s tensors into every rank's, bit for bit.
    fn broadcast_tensors(&self, tensors: &[&Tensor], root: usize) -> Result<()>;
}
