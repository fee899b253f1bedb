//! NVIDIA GPUs: amp's kernels (unscale, norms, fused AdamW / SGD / LAMB, the scale's state machine)
//! compiled at run time with NVRTC for the device at hand, once per process and device.
//!
//! With the `cuda` feature, the scaler and the fused optimizers ([`FusedAdam`](crate::optim::FusedAdam),
//! SGD, LAMB) run on the device when the model's tensors are there: the same training code as on the CPU
//! (type-checked, not yet run on a GPU: see the README's GPU section). Without it, the entry points
//! below exist and return [`Error::CudaNotBuilt`](crate::Error::CudaNotBuilt), so code written for both
//! compiles everywhere (candle's own CUDA device is then unavailable too).
//!
//! ```
//! let device = candle_core::Device::Cpu;
//! if amp_runtime::cuda::is_available() {
//!     let gpu = amp_runtime::cuda::prepare(&candle_core::Device::new_cuda(0)?)?;
//!     println!("{} (sm_{}{}), kernels for {}", gpu.name, gpu.compute_capability.0, gpu.compute_capability.1, gpu.kernel_arch);
//! } else {
//!     // Not built with `cuda`, no driver, or no device: train on the CPU.
//!     assert!(amp_runtime::cuda::prepare(&device).is_err());
//! }
//! # Ok::<(), amp_runtime::Error>(())
//! ```

#[cfg(feature = "cuda")]
mod enabled;
#[cfg(feature = "cuda")]
pub(crate) use enabled::{
    cuda_error, device_ref, find_non_finite, global_l2_norm, loss_f32, on_cuda, unscale_and_check,
    DeviceOptimizer, DeviceRef, Gate, GradCheck, Launch, QueuedScaler,
};
#[cfg(feature = "cuda")]
pub use enabled::{is_available, prepare, DeviceGate};

#[cfg(not(feature = "cuda"))]
mod disabled;
#[cfg(not(feature = "cuda"))]
pub(crate) use disabled::{find_non_finite, global_l2_norm, on_cuda, unscale_and_check};
#[cfg(not(feature = "cuda"))]
pub use disabled::{is_available, prepare, DeviceGate};

/// A CUDA device as amp sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// The device ordinal.
    pub ordinal: usize,
    /// The driver's name for it.
    pub name: String,
    /// `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// The architecture amp's kernels were compiled for (`sm_80`, `sm_90`).
    pub kernel_arch: &'static str,
}
