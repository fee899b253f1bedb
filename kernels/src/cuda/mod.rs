//! CUDA kernels, compiled at run time with NVRTC: the GPU side of [`unscale`](crate::unscale),
//! [`norm`](crate::norm) and [`optim`](crate::optim), plus the loss scale's state machine, so a
//! mixed-precision step runs on the device with no host synchronisation.
//!
//! - [`FAMILIES`]: the CUDA C++ sources, one family per file, embedded in the binary. They need no CUDA
//!   headers (half conversions are inline PTX) and mirror [`reference`](crate::reference) operation by
//!   operation; compiled without FMA contraction and with IEEE division and square root, elementwise
//!   results match the CPU bit for bit.
//! - [`LaunchTable`]: the multi-tensor launch table (pointers, lengths and 64 Ki-element chunks), built on
//!   the host and reused while the addresses it holds stay the same.
//! - With the `cuda` feature: `compile` (NVRTC, per architecture, with NVRTC's log on error) and, on a
//!   device, `CudaKernels` (every family compiled once per device and cached) with typed launches.
//!
//! Skipping without synchronisation: the unscale / norm kernels record the first tensor holding a
//! non-finite value in the device-resident scale state ([`ScaleState`]); every optimizer kernel reads it
//! and returns at once when set, and `amp_scale_update` moves the scale on the device. The host reads the
//! state only when it asks for a report.

mod source;
mod state;
mod table;

pub use source::{Family, BLOCK_THREADS, FAMILIES, NO_BAD_TENSOR};
pub use state::{ScaleChange, ScaleState, STATE_WORDS};
pub use table::{BlockEntry, LaunchTable, TableError, TensorKind, CHUNK_ELEMENTS};

#[cfg(feature = "cuda")]
mod compile;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use compile::{compile, nvrtc_available, Arch, CompileError};
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use device::{
    device_available, CudaError, CudaKernels, DeviceScaler, DeviceTable, GradFactor, LambBuffers,
    NormBuffers, OptimizerStep,
};
