//! Seeded test data on the host and its device copies.

use std::sync::Arc;

use amp_kernels::cuda::{CudaError, LaunchTable, TensorKind, CHUNK_ELEMENTS};
use amp_kernels::{Dtype, GradSlice, GradSliceMut, HalfSliceMut};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use half::{bf16, f16};

/// xorshift64*: deterministic and dependency-free.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
        (bits as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

/// A host tensor in one of the three dtypes.
#[derive(Clone, Debug, PartialEq)]
pub enum HostTensor {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

impl HostTensor {
    pub fn from_f32(values: &[f32], dtype: Dtype) -> Self {
        match dtype {
            Dtype::F32 => HostTensor::F32(values.to_vec()),
            Dtype::F16 => HostTensor::F16(values.iter().map(|&x| f16::from_f32(x)).collect()),
            Dtype::Bf16 => HostTensor::Bf16(values.iter().map(|&x| bf16::from_f32(x)).collect()),
        }
    }

    pub fn dtype(&self) -> Dtype {
        match self {
            HostTensor::F32(_) => Dtype::F32,
            HostTensor::F16(_) => Dtype::F16,
            HostTensor::Bf16(_) => Dtype::Bf16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            HostTensor::F32(v) => v.len(),
            HostTensor::F16(v) => v.len(),
            HostTensor::Bf16(v) => v.len(),
        }
    }

    pub fn as_slice(&self) -> GradSlice<'_> {
        match self {
            HostTensor::F32(v) => GradSlice::F32(v),
            HostTensor::F16(v) => GradSlice::F16(v),
            HostTensor::Bf16(v) => GradSlice::Bf16(v),
        }
    }

    pub fn as_mut(&mut self) -> GradSliceMut<'_> {
        match self {
            HostTensor::F32(v) => GradSliceMut::F32(v),
            HostTensor::F16(v) => GradSliceMut::F16(v),
            HostTensor::Bf16(v) => GradSliceMut::Bf16(v),
        }
    }

    /// As a half working copy (f16 / bf16 only).
    pub fn as_half_mut(&mut self) -> Option<HalfSliceMut<'_>> {
        match self {
            HostTensor::F16(v) => Some(HalfSliceMut::F16(v)),
            HostTensor::Bf16(v) => Some(HalfSliceMut::Bf16(v)),
            HostTensor::F32(_) => None,
        }
    }
}

/// The device copy of a [`HostTensor`].
pub enum DeviceTensor {
    F32(CudaSlice<f32>),
    F16(CudaSlice<f16>),
    Bf16(CudaSlice<bf16>),
}

impl DeviceTensor {
    pub fn upload(stream: &Arc<CudaStream>, host: &HostTensor) -> Result<Self, CudaError> {
        Ok(match host {
            HostTensor::F32(v) => DeviceTensor::F32(stream.clone_htod(v)?),
            HostTensor::F16(v) => DeviceTensor::F16(stream.clone_htod(v)?),
            HostTensor::Bf16(v) => DeviceTensor::Bf16(stream.clone_htod(v)?),
        })
    }

    pub fn download(&self, stream: &Arc<CudaStream>) -> Result<HostTensor, CudaError> {
        Ok(match self {
            DeviceTensor::F32(s) => HostTensor::F32(stream.clone_dtoh(s)?),
            DeviceTensor::F16(s) => HostTensor::F16(stream.clone_dtoh(s)?),
            DeviceTensor::Bf16(s) => HostTensor::Bf16(stream.clone_dtoh(s)?),
        })
    }

    /// The device address (the launch table's entry).
    pub fn address(&self, stream: &Arc<CudaStream>) -> u64 {
        match self {
            DeviceTensor::F32(s) => s.device_ptr(stream).0,
            DeviceTensor::F16(s) => s.device_ptr(stream).0,
            DeviceTensor::Bf16(s) => s.device_ptr(stream).0,
        }
    }
}

/// Address of an f32 buffer.
pub fn address_f32(stream: &Arc<CudaStream>, slice: &CudaSlice<f32>) -> u64 {
    slice.device_ptr(stream).0
}

/// A launch table over `lists` of addresses for tensors of `lens` elements and `kinds`.
pub fn table(lists: &[Vec<u64>], lens: &[usize], kinds: &[TensorKind]) -> Result<LaunchTable, CudaError> {
    let borrowed: Vec<&[u64]> = lists.iter().map(Vec::as_slice).collect();
    Ok(LaunchTable::new(&borrowed, lens, kinds, CHUNK_ELEMENTS)?)
}

/// Tensor sizes that exercise several chunks, a partial last chunk, and tiny tensors.
pub const SIZES: [usize; 6] = [3 * CHUNK_ELEMENTS + 17, 1000, 1, CHUNK_ELEMENTS, 70_001, 5];

/// The dtype of gradient `t` (all three appear in one launch).
pub fn grad_dtype(t: usize) -> Dtype {
    [Dtype::F32, Dtype::F16, Dtype::Bf16][t % 3]
}

/// The working copy of tensor `t`: bf16, f16 or none.
pub fn working_dtype(t: usize) -> Option<Dtype> {
    [Some(Dtype::Bf16), Some(Dtype::F16), None][(t / 3 + t) % 3]
}
