//! Device addresses of candle tensors, for the launch tables.

use amp_kernels::Dtype;
use candle_core::{DType, Storage, Tensor};
use cudarc::driver::{CudaStream, DevicePtr};
use half::{bf16, f16};

use super::cuda_error;
use crate::error::{Error, Result};

/// Where a tensor's elements start on the device, how many, of which type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeviceRef {
    pub address: u64,
    pub len: usize,
    pub dtype: Dtype,
}

/// The device view of a contiguous f32 / f16 / bf16 CUDA tensor. The address stays valid while the
/// tensor lives; kernels that use it run on `stream`, after everything queued before.
pub(crate) fn device_ref(tensor: &Tensor, stream: &CudaStream) -> Result<DeviceRef> {
    let (storage, layout) = tensor.storage_and_layout();
    let (start, end) = layout.contiguous_offsets().ok_or(Error::NotContiguous)?;
    let Storage::Cuda(cuda) = &*storage else {
        return Err(Error::Cuda {
            reason: format!("a tensor on {:?} among CUDA tensors", tensor.device().location()),
        });
    };
    let (base, size, dtype) = match tensor.dtype() {
        DType::F32 => (cuda.as_cuda_slice::<f32>().map_err(cuda_error)?.device_ptr(stream).0, 4, Dtype::F32),
        DType::F16 => (cuda.as_cuda_slice::<f16>().map_err(cuda_error)?.device_ptr(stream).0, 2, Dtype::F16),
        DType::BF16 => {
            (cuda.as_cuda_slice::<bf16>().map_err(cuda_error)?.device_ptr(stream).0, 2, Dtype::Bf16)
        }
        dtype => return Err(Error::UnsupportedDType { dtype }),
    };
    Ok(DeviceRef { address: base + (start * size) as u64, len: end - start, dtype })
}

/// [`device_ref`] of each tensor.
pub(crate) fn device_refs(tensors: &[&Tensor], stream: &CudaStream) -> Result<Vec<DeviceRef>> {
    tensors.iter().map(|t| device_ref(t, stream)).collect()
}
