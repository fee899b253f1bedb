//! Zero-copy access to the memory of many candle tensors at once, for the multi-tensor kernels.
//!
//! candle exposes a tensor's memory mutably only inside an in-place op. To hand a kernel mutable slices
//! of many tensors in one call, the ops are nested: the op of tensor `i` runs the op of tensor `i + 1`
//! while it holds tensor `i`'s storage, and the innermost calls the kernel with every slice. Each storage
//! is locked exactly once (aliased tensors are refused beforehand: they would lock twice), and every
//! slice lives as long as its lock. Tensors are taken in batches so the nesting stays shallow.

use std::cell::RefCell;

use amp_kernels::{GradSlice, GradSliceMut};
use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, Tensor};

use crate::error::{Error, Result};

/// Tensors per nested batch: bounds the recursion depth.
pub(crate) const BATCH: usize = 128;

/// Runs `f` on mutable slices of every tensor's elements (in order), in batches of at most [`BATCH`]
/// tensors; returns each batch's result. The tensors must be contiguous f32/f16/bf16 CPU tensors with
/// distinct storage.
pub(crate) fn for_each_batch_mut<R>(
    tensors: &[&Tensor],
    mut f: impl FnMut(&mut [GradSliceMut<'_>]) -> R,
) -> Result<Vec<R>> {
    check_distinct(tensors)?;
    tensors
        .chunks(BATCH)
        .map(|batch| {
            let mut slot = None;
            nest(batch, Vec::with_capacity(batch.len()), &mut |slices: &mut [GradSliceMut<'_>]| {
                slot = Some(f(slices));
            })?;
            slot.ok_or_else(|| Error::Internal { what: "nested in-place op did not run".into() })
        })
        .collect()
}

/// Runs `f` on mutable slices of all `tensors` at once (no batching: keep the list short, a few hundred
/// tensors at most). The caller has checked that storages are distinct ([`check_distinct`]).
pub(crate) fn with_all_mut<R>(
    tensors: &[&Tensor],
    f: impl FnOnce(&mut [GradSliceMut<'_>]) -> R,
) -> Result<R> {
    let mut f = Some(f);
    let mut slot = None;
    nest(tensors, Vec::with_capacity(tensors.len()), &mut |slices: &mut [GradSliceMut<'_>]| {
        slot = f.take().map(|f| f(slices));
    })?;
    slot.ok_or_else(|| Error::Internal { what: "nested in-place op did not run".into() })
}

/// Runs `f` on read-only slices of every tensor's elements (contiguous f32/f16/bf16 CPU tensors).
pub(crate) fn with_slices<R>(tensors: &[&Tensor], f: impl FnOnce(&[GradSlice<'_>]) -> R) -> Result<R> {
    let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let slices = guards
        .iter()
        .zip(tensors)
        .map(|((storage, layout), tensor)| match &**storage {
            Storage::Cpu(cpu) => read_slice(cpu, layout),
            _ => Err(not_cpu(tensor)),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(f(&slices))
}

fn nest(
    rest: &[&Tensor],
    mut acc: Vec<GradSliceMut<'_>>,
    f: &mut dyn FnMut(&mut [GradSliceMut<'_>]),
) -> Result<()> {
    let Some((first, rest)) = rest.split_first() else {
        f(&mut acc);
        return Ok(());
    };
    let op =
        Nest { rest, acc: RefCell::new(Some(acc)), f: RefCell::new(Some(f)), result: RefCell::new(None) };
    first.inplace_op1(&op).map_err(|e| match e {
        candle_core::Error::Cuda(_) => not_cpu(first),
        other => other.into(),
    })?;
    op.result.into_inner().unwrap_or_else(|| Err(not_cpu(first)))
}

/// The kernel call made once every slice of a batch is held.
type BatchFn<'f> = &'f mut dyn FnMut(&mut [GradSliceMut<'_>]);

struct Nest<'r, 'a, 'f> {
    rest: &'r [&'r Tensor],
    acc: RefCell<Option<Vec<GradSliceMut<'a>>>>,
    f: RefCell<Option<BatchFn<'f>>>,
    result: RefCell<Option<Result<()>>>,
}

impl InplaceOp1 for Nest<'_, '_, '_> {
    fn name(&self) -> &'static str {
        "amp-multi-tensor"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (Some(acc), Some(f)) = (self.acc.take(), self.f.take()) else {
            return Err(candle_core::Error::Msg("amp multi-tensor op entered twice".into()));
        };
        let mut acc: Vec<GradSliceMut<'_>> = acc;
        let result = write_slice(storage, layout).and_then(|slice| {
            acc.push(slice);
            nest(self.rest, acc, f)
        });
        *self.result.borrow_mut() = Some(result);
        Ok(())
    }
}

/// The elements of a contiguous f32, f16 or bf16 CPU storage, as the kernels write them.
pub(crate) fn write_slice<'s>(storage: &'s mut CpuStorage, layout: &Layout) -> Result<GradSliceMut<'s>> {
    let (start, end) = layout.contiguous_offsets().ok_or(Error::NotContiguous)?;
    Ok(match storage {
        CpuStorage::F32(v) => GradSliceMut::F32(&mut v[start..end]),
        CpuStorage::F16(v) => GradSliceMut::F16(&mut v[start..end]),
        CpuStorage::BF16(v) => GradSliceMut::Bf16(&mut v[start..end]),
        other => {
            return Err(Error::UnsupportedDType {
                dtype: candle_core::backend::BackendStorage::dtype(&*other),
            })
        }
    })
}

/// The elements of a contiguous f32, f16 or bf16 CPU storage, as the kernels read them.
pub(crate) fn read_slice<'s>(storage: &'s CpuStorage, layout: &Layout) -> Result<GradSlice<'s>> {
    let (start, end) = layout.contiguous_offsets().ok_or(Error::NotContiguous)?;
    Ok(match storage {
        CpuStorage::F32(v) => GradSlice::F32(&v[start..end]),
        CpuStorage::F16(v) => GradSlice::F16(&v[start..end]),
        CpuStorage::BF16(v) => GradSlice::Bf16(&v[start..end]),
        other => {
            return Err(Error::UnsupportedDType { dtype: candle_core::backend::BackendStorage::dtype(other) })
        }
    })
}

/// Refuses tensors that share storage: the nested ops would lock it twice.
pub(crate) fn check_distinct(tensors: &[&Tensor]) -> Result<()> {
    let mut keys: Vec<usize> = tensors
        .iter()
        .map(|t| {
            let (storage, _) = t.storage_and_layout();
            &*storage as *const Storage as usize
        })
        .collect();
    keys.sort_unstable();
    if keys.windows(2).any(|w| w[0] == w[1]) {
        return Err(Error::Internal { what: "two tensors of one multi-tensor call share storage".into() });
    }
    Ok(())
}

fn not_cpu(tensor: &Tensor) -> Error {
    Error::DeviceNotSupported {
        what: "this multi-tensor operation".into(),
        device: format!("{:?}", tensor.device().location()),
    }
}
