//! An embedding lookup as one candle op on the CPU: the table's rows gathered into the output dtype in
//! one pass, and in the backward pass their gradients summed in f32 into the table's gradient.
//!
//! candle's version under O2 is three graph nodes each way: `index_select` on the half working copy,
//! a cast of the rows to the f32 activations, and backward a cast of the rows' gradient to half and an
//! `index_add` in half into a zero table (candle's bf16 ops run at a fraction of its f32 ones' speed,
//! on one thread, and every repeated id rounds its sum again). Here the table is read as a product
//! reads a weight ([`Operand`]): under [`crate::GradientRoute::Master`] the values are the half working
//! copy's and the gradient, summed in f32, lands on the fp32 master, as a Linear's does.

use amp_kernels::convert;
use amp_kernels::fresh::written_in_blocks;
use amp_kernels::{GradSlice, HalfSliceMut};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

use super::elementwise::{elements, part};
use super::gemm::{deposit, is_float, needs_gradient, read_from, Operand};
use crate::storage::with_slices;

/// Table rows per block of the parallel loops (forward and backward).
const ROWS_PER_BLOCK: usize = 64;

/// `table[ids]` rounded to `compute` (f32: not rounded) and converted to `out`, of shape
/// `ids.dims() + (hidden,)` for a `(vocab, hidden)` table; `None` where candle's ops should run
/// instead (off the CPU, a table that is not a contiguous f32 / f16 / bf16 matrix, or an output dtype
/// that is not one of those).
///
/// # Errors
/// An id that is not an unsigned or non-negative integer below `vocab`: the error names it.
pub(crate) fn embedding(table: &Operand, ids: &Tensor, compute: DType, out: DType) -> Result<Option<Tensor>> {
    let differentiated = &table.differentiated;
    let values = table.values.as_ref().filter(|v| v.dims() == differentiated.dims() && v.is_contiguous());
    let applies = differentiated.device().is_cpu()
        && ids.device().is_cpu()
        && differentiated.rank() == 2
        && differentiated.is_contiguous()
        && is_float(differentiated.dtype())
        && is_float(out);
    if !applies {
        return Ok(None);
    }
    let (vocab, hidden) = differentiated.dims2()?;
    let rows = ids_of(ids, vocab)?;
    let mut shape = ids.dims().to_vec();
    shape.push(hidden);
    let op = EmbeddingOp { rows, hidden, shape: shape.into(), compute, out, values: values.cloned() };
    Ok(Some(differentiated.apply_op1(op)?))
}

/// The ids as row indices, each checked against `vocab`.
fn ids_of(ids: &Tensor, vocab: usize) -> Result<Vec<usize>> {
    let flat = ids.flatten_all()?;
    let rows: Vec<i128> = match ids.dtype() {
        DType::U8 => flat.to_vec1::<u8>()?.into_iter().map(i128::from).collect(),
        DType::U32 => flat.to_vec1::<u32>()?.into_iter().map(i128::from).collect(),
        DType::I64 => flat.to_vec1::<i64>()?.into_iter().map(i128::from).collect(),
        other => {
            return Err(candle_core::Error::Msg(format!(
                "amp embedding: ids must be u8, u32 or i64 integers, not {other:?}"
            )))
        }
    };
    rows.into_iter()
        .enumerate()
        .map(|(at, id)| {
            usize::try_from(id).ok().filter(|&row| row < vocab).ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "amp embedding: id {id} (element {at} of the ids) is outside the table's {vocab} rows"
                ))
            })
        })
        .collect()
}

/// The lookup of `rows` (one per output row) in a `(vocab, hidden)` table, output in `out`.
struct EmbeddingOp {
    rows: Vec<usize>,
    hidden: usize,
    /// The ids' shape and `hidden`: the output's shape, made by the op itself (a reshape after it
    /// would be one more graph node, its gradient one more zero-filled sum).
    shape: Shape,
    compute: DType,
    out: DType,
    /// Where the table's values are read, when not from the differentiated table
    /// ([`Operand::values`]: the half working copy of an fp32 master).
    values: Option<Tensor>,
}

impl CustomOp1 for EmbeddingOp {
    fn name(&self) -> &'static str {
        "amp-embedding"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let storage = read_from(self.values.as_ref(), storage, layout, |storage, layout| {
            let table = elements(storage, layout)?;
            Ok(gathered(table, &self.rows, self.hidden, self.compute, self.out))
        })?;
        Ok((storage, self.shape.clone()))
    }

    fn bwd(&self, table: &Tensor, _rows: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if !needs_gradient(table) {
            return Ok(None);
        }
        let grad = grad.contiguous()?;
        let sums =
            with_slices(&[&grad], |slices| scattered(slices[0], &self.rows, table.dim(0)?, self.hidden))
                .map_err(candle_core::Error::wrap)??;
        let sums = Tensor::from_vec(sums, table.dims(), table.device())?;
        // One rounding of each f32 sum where the table is half (its working copy differentiated).
        deposit(table, Some(sums.to_dtype(table.dtype())?))
    }
}

/// Each of `rows` of `table` (`hidden` wide), rounded to `compute` where the table is wider (as a
/// product rounds an operand while packing it) and converted to `out`, one after another.
fn gathered(table: GradSlice<'_>, rows: &[usize], hidden: usize, compute: DType, out: DType) -> CpuStorage {
    let width = hidden.max(1);
    let (len, block) = (rows.len() * hidden, width * ROWS_PER_BLOCK);
    // Row `r` of the block that starts at element `at`, widened to f32 into `wide` and rounded.
    let row_into = |at: usize, r: usize, wide: &mut [f32], rounding: &mut Rounding| {
        convert::widen(part(table, rows[at / width + r] * hidden, hidden), wide);
        rounding.apply(wide);
    };
    let half = |at: usize, mut y: HalfSliceMut<'_>| {
        let (mut wide, mut rounding) = (vec![0f32; hidden], Rounding::new(table, compute, hidden));
        for r in 0..y.len() / width {
            row_into(at, r, &mut wide, &mut rounding);
            convert::narrow(&wide, y.reborrow().split_at(r * hidden).1.split_at(hidden).0);
        }
    };
    match out {
        DType::F16 => CpuStorage::F16(written_in_blocks(len, block, |at, y: &mut [f16]| half(at, y.into()))),
        DType::BF16 => {
            CpuStorage::BF16(written_in_blocks(len, block, |at, y: &mut [bf16]| half(at, y.into())))
        }
        _ => CpuStorage::F32(written_in_blocks(len, block, |at, y: &mut [f32]| {
            let mut rounding = Rounding::new(table, compute, hidden);
            for (r, y) in y.chunks_exact_mut(width).enumerate() {
                row_into(at, r, y, &mut rounding);
            }
        })),
    }
}

/// How a block's rows are rounded to the compute precision: not at all (the table is not wider than
/// it), or to f16 / bf16 and back through a buffer of one row, kept across the block's rows.
enum Rounding {
    Exact,
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

impl Rounding {
    fn new(table: GradSlice<'_>, compute: DType, hidden: usize) -> Rounding {
        match (table, compute) {
            (GradSlice::F32(_), DType::F16) => Rounding::F16(vec![f16::ZERO; hidden]),
            (GradSlice::F32(_), DType::BF16) => Rounding::Bf16(vec![bf16::ZERO; hidden]),
            _ => Rounding::Exact,
        }
    }

    /// `values` (one row) rounded and widened back.
    fn apply(&mut self, values: &mut [f32]) {
        match self {
            Rounding::Exact => {}
            Rounding::F16(buffer) => {
                convert::narrow(values, HalfSliceMut::F16(buffer));
                convert::widen(GradSlice::F16(buffer), values);
            }
            Rounding::Bf16(buffer) => {
                convert::narrow(values, HalfSliceMut::Bf16(buffer));
                convert::widen(GradSlice::Bf16(buffer), values);
            }
        }
    }
}

/// The table's gradient in f32: row `v` the sum of the gradient rows whose id is `v`, added in the
/// order they come (as a sequential scatter-add would), table rows in parallel blocks.
fn scattered(grad: GradSlice<'_>, rows: &[usize], vocab: usize, hidden: usize) -> Result<Vec<f32>> {
    if grad.len() != rows.len() * hidden {
        return Err(candle_core::Error::Msg(
            "amp embedding: the gradient's shape is not the output's".into(),
        ));
    }
    // Positions grouped by the row they read, in order within each row (a stable sort).
    let mut order: Vec<(usize, usize)> = rows.iter().enumerate().map(|(at, &row)| (row, at)).collect();
    order.sort_by_key(|&(row, _)| row);
    let block = hidden.max(1) * ROWS_PER_BLOCK;
    Ok(written_in_blocks(vocab * hidden, block, |start, sums: &mut [f32]| {
        let first = start / hidden.max(1);
        let from = order.partition_point(|&(row, _)| row < first);
        let mut wide = vec![0f32; hidden];
        for &(row, at) in order[from..].iter().take_while(|&&(row, _)| row < first + ROWS_PER_BLOCK) {
            convert::widen(part(grad, at * hidden, hidden), &mut wide);
            let sum = &mut sums[(row - first) * hidden..][..hidden];
            for (s, &g) in sum.iter_mut().zip(&wide) {
                *s += g;
            }
        }
    }))
}
