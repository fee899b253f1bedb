//! Storage helpers of amp's CPU ops: their inputs' elements, and new outputs written in parallel blocks.

use amp_kernels::{Dtype, GradSlice, GradSliceMut};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

/// The elements of a contiguous f32, f16 or bf16 storage.
pub(super) fn elements<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<GradSlice<'a>> {
    crate::storage::read_slice(storage, layout).map_err(candle_core::Error::wrap)
}

/// The elements of a contiguous f32 storage that `op` reads (its name in the errors).
pub(super) fn f32_elements<'a>(
    storage: &'a CpuStorage,
    layout: &Layout,
    op: &'static str,
) -> Result<&'a [f32]> {
    match (storage, layout.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((start, end))) => Ok(&v[start..end]),
        (CpuStorage::F32(_), None) => Err(candle_core::Error::RequiresContiguous { op }),
        (other, _) => Err(candle_core::Error::UnsupportedDTypeForOp(other.dtype(), op)),
    }
}

/// The first `len` elements of an f32, f16 or bf16 storage, to write.
pub(super) fn elements_mut(storage: &mut CpuStorage, len: usize) -> Result<GradSliceMut<'_>> {
    crate::storage::write_slice(storage, &Layout::contiguous(len)).map_err(candle_core::Error::wrap)
}

/// The kernels' name for an f32, f16 or bf16 dtype.
pub(super) fn kernel_dtype(dtype: DType) -> Result<Dtype> {
    match dtype {
        DType::F32 => Ok(Dtype::F32),
        DType::F16 => Ok(Dtype::F16),
        DType::BF16 => Ok(Dtype::Bf16),
        other => Err(candle_core::Error::UnsupportedDTypeForOp(other, "amp: f32, f16 or bf16")),
    }
}

/// Elements `start..start + len` of `x`.
pub(super) fn part(x: GradSlice<'_>, start: usize, len: usize) -> GradSlice<'_> {
    x.split_at(start).1.split_at(len).0
}

/// Elements per block of [`new_storage`]: 32 KiB of f32, a core's L1 data cache on the CPUs we measure.
const BLOCK: usize = 8192;

/// A new storage of `len` elements of `dtype`, written in parallel blocks by `write(start, block)`
/// (`amp_kernels::fresh`: never zero-filled on one thread first).
pub(super) fn new_storage(
    dtype: Dtype,
    len: usize,
    write: impl Fn(usize, GradSliceMut<'_>) + Sync,
) -> CpuStorage {
    new_storage_in_blocks(dtype, len, BLOCK, write)
}

/// [`new_storage`] in blocks of `block` elements (the last one may be shorter): whole rows, for a
/// kernel that works a row at a time.
pub(super) fn new_storage_in_blocks(
    dtype: Dtype,
    len: usize,
    block: usize,
    write: impl Fn(usize, GradSliceMut<'_>) + Sync,
) -> CpuStorage {
    use amp_kernels::fresh::written_in_blocks;
    match dtype {
        Dtype::F32 => CpuStorage::F32(written_in_blocks(len, block, |at, y: &mut [f32]| write(at, y.into()))),
        Dtype::F16 => CpuStorage::F16(written_in_blocks(len, block, |at, y: &mut [f16]| write(at, y.into()))),
        Dtype::Bf16 => {
            CpuStorage::BF16(written_in_blocks(len, block, |at, y: &mut [bf16]| write(at, y.into())))
        }
    }
}

/// [`new_storage_in_blocks`] of `planes` planes of `plane` elements each, in blocks of whole planes
/// (about [`BLOCK`] elements, at least one plane): `write(first plane, the block's planes)`, for a kernel
/// that works a plane at a time.
pub(super) fn new_storage_in_planes(
    dtype: Dtype,
    planes: usize,
    plane: usize,
    write: impl Fn(usize, GradSliceMut<'_>) + Sync,
) -> CpuStorage {
    let plane = plane.max(1);
    let block = (BLOCK / plane).max(1) * plane;
    new_storage_in_blocks(dtype, planes * plane, block, |at, part| write(at / plane, part))
}

/// A CPU tensor of `shape` holding `storage` (f32, f16 or bf16, of `shape`'s size).
pub(super) fn tensor_of(storage: CpuStorage, shape: impl Into<Shape>) -> Result<Tensor> {
    let cpu = &Device::Cpu;
    match storage {
        CpuStorage::F32(v) => Tensor::from_vec(v, shape, cpu),
        CpuStorage::F16(v) => Tensor::from_vec(v, shape, cpu),
        CpuStorage::BF16(v) => Tensor::from_vec(v, shape, cpu),
        other => Err(candle_core::Error::UnsupportedDTypeForOp(other.dtype(), "amp: f32, f16 or bf16")),
    }
}

/// Floats per parallel chunk of [`add_into`].
const ADD_CHUNK: usize = 1 << 14;

/// `y[i] += x[i]` in parallel chunks: each sum what candle's `y + x` (or `x + y`: f32 addition
/// commutes) computes, bit for bit.
pub(super) fn add_into(y: &mut [f32], x: &[f32]) {
    use rayon::prelude::*;
    debug_assert_eq!(y.len(), x.len());
    y.par_chunks_mut(ADD_CHUNK).zip(x.par_chunks(ADD_CHUNK)).for_each(|(y, x)| {
        for (y, &x) in y.iter_mut().zip(x) {
            *y += x;
        }
    });
}

/// `target + addend` written into `target`'s own memory, for an f32 `target` the caller alone holds (a
/// gradient it computed): the sum candle's add would return, without a new tensor. Where the two are
/// not contiguous f32 CPU tensors of one size in separate storages, candle's add (a new tensor).
pub(super) fn sum_into(target: Tensor, addend: &Tensor) -> Result<Tensor> {
    let fits = [&target, addend].iter().all(|t| t.dtype() == DType::F32 && t.device().is_cpu())
        && target.is_contiguous()
        && target.shape() == addend.shape()
        && crate::storage::check_distinct(&[&target, addend]).is_ok();
    if !fits {
        return target + addend;
    }
    let addend = addend.contiguous()?;
    let added = crate::storage::with_slices(&[&addend], |x| {
        crate::storage::with_all_mut(&[&target], |y| match (&mut y[0], x[0]) {
            (GradSliceMut::F32(y), GradSlice::F32(x)) => add_into(y, x),
            _ => unreachable!("checked: two f32 tensors"),
        })
    });
    added.and_then(|inner| inner).map_err(candle_core::Error::wrap)?;
    Ok(target)
}
