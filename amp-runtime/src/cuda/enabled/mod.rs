//! The `cuda` build: amp's kernels on candle's CUDA devices, on candle's stream (so they are ordered
//! with the forward and backward passes without any synchronisation of their own).

mod checks;
mod optimizer;
mod queued;
mod tensors;

use std::sync::Arc;

use amp_kernels::cuda::CudaKernels;
use candle_core::{Device, Tensor};
use cudarc::driver::CudaStream;

pub(crate) use checks::{find_non_finite, global_l2_norm, unscale_and_check};
pub use optimizer::DeviceGate;
pub(crate) use optimizer::{DeviceOptimizer, Gate, Launch};
pub(crate) use queued::{loss_f32, GradCheck, QueuedScaler};
pub(crate) use tensors::{device_ref, DeviceRef};

use super::GpuInfo;
use crate::error::{Error, Result};

/// True when amp was built with the `cuda` feature and a CUDA device can be used.
#[must_use]
pub fn is_available() -> bool {
    amp_kernels::cuda::device_available()
}

/// Compiles amp's kernels for `device` now rather than on the first step, and describes it.
///
/// # Errors
/// `device` is not a CUDA device, or the kernels do not compile / load on it (with NVRTC's log).
pub fn prepare(device: &Device) -> Result<GpuInfo> {
    let gpu = Gpu::of(device)?;
    // Half products accumulate in f32 (amp's contract); TF32 for f32 stays as the policy set it.
    let tf32 = candle_core::cuda::gemm_reduced_precision_f32();
    crate::dispatch::cuda_gemm_settings(crate::dispatch::CudaGemmSettings::for_policy(tf32));
    let context = gpu.stream.context();
    Ok(GpuInfo {
        ordinal: context.ordinal(),
        name: context.name().map_err(cuda_error)?,
        compute_capability: context.compute_capability().map_err(cuda_error)?,
        kernel_arch: gpu.kernels.arch().name(),
    })
}

/// A device's kernels and the stream candle runs on.
#[derive(Clone, Debug)]
pub(crate) struct Gpu {
    pub kernels: Arc<CudaKernels>,
    pub stream: Arc<CudaStream>,
}

impl Gpu {
    /// The kernels (compiled on first use) and stream of a CUDA `device`.
    pub fn of(device: &Device) -> Result<Self> {
        let cuda = device
            .as_cuda_device()
            .map_err(|_| Error::Cuda { reason: format!("{:?} is not a CUDA device", device.location()) })?;
        let stream = cuda.cuda_stream();
        let kernels = CudaKernels::for_context(stream.context()).map_err(cuda_error)?;
        Ok(Gpu { kernels, stream })
    }
}

/// True when the tensors are on a CUDA device (amp's multi-tensor calls take one device at a time).
pub(crate) fn on_cuda(tensors: &[&Tensor]) -> bool {
    tensors.first().is_some_and(|t| t.device().is_cuda())
}

pub(crate) fn cuda_error(e: impl std::fmt::Display) -> Error {
    Error::Cuda { reason: e.to_string() }
}
