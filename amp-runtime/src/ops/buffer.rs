//! Zeroed f32, f16 or bf16 buffers that amp's CPU ops write and hand to candle.

use amp_kernels::{GradSlice, GradSliceMut};
use candle_core::{CpuStorage, DType, Result};
use half::{bf16, f16};

/// A zeroed buffer of f32, f16 or bf16 that becomes a tensor's storage.
pub(crate) enum Buffer {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

impl Buffer {
    pub(crate) fn zeros(dtype: DType, len: usize) -> Result<Buffer> {
        Ok(match dtype {
            DType::F32 => Buffer::F32(vec![0.0; len]),
            DType::F16 => Buffer::F16(vec![f16::ZERO; len]),
            DType::BF16 => Buffer::Bf16(vec![bf16::ZERO; len]),
            other => return Err(candle_core::Error::UnsupportedDTypeForOp(other, "amp (f32, f16, bf16)")),
        })
    }

    pub(crate) fn as_ref(&self) -> GradSlice<'_> {
        match self {
            Buffer::F32(v) => v[..].into(),
            Buffer::F16(v) => v[..].into(),
            Buffer::Bf16(v) => v[..].into(),
        }
    }

    pub(crate) fn as_mut(&mut self) -> GradSliceMut<'_> {
        match self {
            Buffer::F32(v) => (&mut v[..]).into(),
            Buffer::F16(v) => (&mut v[..]).into(),
            Buffer::Bf16(v) => (&mut v[..]).into(),
        }
    }

    /// Elements `start..start + len`.
    pub(crate) fn range(&mut self, start: usize, len: usize) -> GradSliceMut<'_> {
        self.as_mut().split_at(start).1.split_at(len).0
    }

    pub(crate) fn into_storage(self) -> CpuStorage {
        match self {
            Buffer::F32(v) => CpuStorage::F32(v),
            Buffer::F16(v) => CpuStorage::F16(v),
            Buffer::Bf16(v) => CpuStorage::BF16(v),
        }
    }
}
