//! Without the `cuda` feature: the same entry points, each saying how to get CUDA.

use candle_core::Device;

use super::GpuInfo;
use crate::error::{Error, Result};

/// True when amp was built with the `cuda` feature and a CUDA device can be used. Always false here.
#[must_use]
pub fn is_available() -> bool {
    false
}

/// Compiles amp's kernels for `device` now rather than on the first step, and describes it. Without
/// the `cuda` feature: [`Error::CudaNotBuilt`].
///
/// # Errors
/// Always, in this build.
pub fn prepare(_device: &Device) -> Result<GpuInfo> {
    Err(Error::CudaNotBuilt)
}

/// A loss scaler's verdict on a CUDA device (see the `cuda` build). Without CUDA there is none: this
/// type has no values.
#[derive(Clone, Copy, Debug)]
pub struct DeviceGate<'a> {
    _never: Never,
    _lifetime: std::marker::PhantomData<&'a ()>,
}

#[derive(Clone, Copy, Debug)]
enum Never {}

/// Without CUDA no tensor is on a CUDA device.
pub(crate) fn on_cuda(_tensors: &[&candle_core::Tensor]) -> bool {
    false
}

/// Unreachable without CUDA tensors ([`on_cuda`] is false); an error rather than a panic all the same.
pub(crate) fn unscale_and_check(_tensors: &[&candle_core::Tensor], _inv_scale: f32) -> Result<Option<usize>> {
    Err(Error::CudaNotBuilt)
}

/// As [`unscale_and_check`].
pub(crate) fn find_non_finite(_tensors: &[&candle_core::Tensor]) -> Result<Option<usize>> {
    Err(Error::CudaNotBuilt)
}

/// As [`unscale_and_check`].
pub(crate) fn global_l2_norm(_tensors: &[&candle_core::Tensor], _inv_scale: f32) -> Result<f32> {
    Err(Error::CudaNotBuilt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_the_feature_every_entry_point_says_how_to_get_cuda() {
        assert!(!is_available());
        let message = prepare(&Device::Cpu).map(|_| ()).unwrap_err().to_string();
        assert!(message.contains("`cuda` feature"), "{message}");
        assert!(message.contains("scripts/cuda-toolchain.sh"), "{message}");
        assert!(!on_cuda(&[]));
    }
}
