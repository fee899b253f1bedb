//! Storage helpers of the one-pass elementwise ops (GELU, ReLU).

use amp_kernels::{Dtype, GradSlice, GradSliceMut};
use candle_core::{CpuStorage, Layout, Result};
use half::{bf16, f16};

/// The elements of a contiguous f32, f16 or bf16 storage.
pub(super) fn elements<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<GradSlice<'a>> {
    crate::storage::read_slice(storage, layout).map_err(candle_core::Error::wrap)
}

/// A new storage of `len` elements of `dtype`, filled by `fill`.
pub(super) fn new_storage(dtype: Dtype, len: usize, fill: impl FnOnce(GradSliceMut<'_>)) -> CpuStorage {
    match dtype {
        Dtype::F32 => {
            let mut v = vec![0f32; len];
            fill(GradSliceMut::F32(&mut v));
            CpuStorage::F32(v)
        }
        Dtype::F16 => {
            let mut v = vec![f16::ZERO; len];
            fill(GradSliceMut::F16(&mut v));
            CpuStorage::F16(v)
        }
        Dtype::Bf16 => {
            let mut v = vec![bf16::ZERO; len];
            fill(GradSliceMut::Bf16(&mut v));
            CpuStorage::BF16(v)
        }
    }
}
