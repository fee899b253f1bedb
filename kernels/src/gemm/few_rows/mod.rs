//! Products of few rows of A on the FMA paths whose B lies contiguous along `k` in a type the product
//! computes in exactly (a Linear's forward on a small batch or a single token: rows of `x`, and the
//! weight `(out, in)` read as `W^T`): each element of C is a dot product of an A row and a B column,
//! B read where it lies.
//!
//! The packed path writes all of B into f32 panels and reads it back: three passes over the product's
//! largest operand (twice its bytes for a half B) to use each of its values a few times. Here each B
//! value is read once, widened in registers, and used by every row of A; A, at most [`MAX_ROWS`] rows,
//! is rounded to the compute precision into a dense f32 buffer first (the calling thread's, reused).
//!
//! Order of the sums, the same on every kernel (zmm, ymm, portable), so that a product's bits do not
//! depend on the CPU: 16 lanes, lane `l` summing the products of `k = 16c + l` in chunk order `c` with
//! fused multiply-adds from zero (`k` past the end reads as zero in both operands); then the lanes added
//! pairwise (`l` and `l + 8`, then `+ 4`, `+ 2`, `+ 1`); then the start (C or a bias), if any, added;
//! then C rounded once. That order differs from the packed path's (one FMA chain in `k` order), within
//! the same f32 accumulation bound; each element's order is independent of the tile it falls in, the
//! row count (up to [`MAX_ROWS`]) and the thread count.

use std::cell::Cell;

use half::{bf16, f16};
use rayon::prelude::*;

use super::driver::Job;
use super::row_load::convert_run;
use super::{Compute, Dims, GemmPath, MatRef};
use crate::gemm::pack::Source;
use crate::{Dtype, GradSlice};

#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{RowFmaAvx2, RowFmaAvx512};

thread_local! {
    /// A's rows rounded to the compute precision, kept for the calling thread's next product.
    static ROUNDED_A: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// At most this many rows of A take this path where B is bf16 or f16, [`MAX_ROWS_F32`] where it is f32
/// (twice the bytes for each row of A to amortise). One limit for every FMA path, so that a product's
/// bits do not depend on the CPU. Measured on an Intel Xeon (AVX-512, no AMX), 2 threads, against the
/// packed path (alternated, medians of 11), `(m, k, n)` for six `(k, n)` from 256 x 1024 to 4096 x
/// 4096, A f32, B a transposed `(n, k)`; ymm forced on the same CPU:
///
/// | rows | zmm, bf16 B | zmm, f32 B | ymm, bf16 B | ymm, f32 B |
/// |---|---|---|---|---|
/// | 1-8 | 1.1-5.5x | 1.2-3.1x | 1.2-6.1x | 0.69-3.4x (one shape below 1) |
/// | 12 | 1.1-2.1x | 0.97-1.7x | 0.99-1.7x | 0.75-1.3x |
/// | 16 | 1.0-1.9x | 0.88-1.6x | 0.97-1.6x | - |
pub(crate) const MAX_ROWS: usize = 16;

/// [`MAX_ROWS`] for an f32 B.
pub(crate) const MAX_ROWS_F32: usize = 8;

/// The `k` this path needs for each row of A: each element ends in a reduction of its 16 lanes, which
/// costs as much as a few chunks of FMAs, so a short `k` pays only for very few rows. Measured as for
/// [`MAX_ROWS`] with `k` of 32 to 256 (n = 512 and 3072): 2 rows ran at 0.77-0.94x the packed path's
/// speed at k = 32 and 1.2-1.6x at 64; 4 rows 0.69-0.96x at 64 and 1.1-1.5x at 128; 8 rows 0.77-1.29x
/// at 128 and 1.3-1.4x at 256; 16 rows (bf16 B) 0.54-0.79x at 128.
const K_PER_ROW: usize = 32;

/// Lanes per dot product.
pub(crate) const LANES: usize = 16;

/// Columns of B per parallel task.
const TASK_COLS: usize = 48;

/// Whether `job` on `path` takes this path: one product (or a batch) on an FMA path whose operands
/// [`reads`] reads. A [`super::Triangle`] is not skipped here: the full product is computed, as its
/// docs allow.
pub(crate) fn applies(path: GemmPath, job: &Job<'_>) -> bool {
    matches!(path, GemmPath::Avx512 | GemmPath::Avx512Model | GemmPath::Avx2 | GemmPath::Portable)
        && job.spacing.count == 1
        && reads(job.compute, job.dims, &job.b)
}

/// Whether a product's operands are what this path reads: at most [`MAX_ROWS`] ([`MAX_ROWS_F32`]) rows
/// of A (any layout and dtype) and [`K_PER_ROW`] `k` for each, B contiguous along `k` in a dtype
/// `compute` holds exactly (f32 for f32 products, bf16 for bf16 or f32, f16 for f16 or f32), so that B
/// needs no rounding.
pub(crate) fn reads(compute: Compute, dims: Dims, b: &MatRef<'_>) -> bool {
    max_rows(compute, b.data.dtype(), dims.k).is_some_and(|rows| dims.m <= rows) && b.row_stride == 1
}

/// The most rows this path takes for a B stored in `b`, products computed in `compute` and this `k`
/// ([`K_PER_ROW`] for each row): `None` where it takes none, B would need rounding (f32 for a half
/// product, one half type for the other) or `k` is below [`K_PER_ROW`].
pub(crate) fn max_rows(compute: Compute, b: Dtype, k: usize) -> Option<usize> {
    let cap = match (b, compute) {
        (Dtype::F32, Compute::F32) => MAX_ROWS_F32,
        (Dtype::Bf16, Compute::F32 | Compute::Bf16) | (Dtype::F16, Compute::F32 | Compute::F16) => MAX_ROWS,
        _ => return None,
    };
    Some(cap.min(k / K_PER_ROW)).filter(|&rows| rows > 0)
}

/// An element type of B: widened to f32 exactly, in registers.
pub(crate) trait Element: Source + Default {
    /// Which widening the x86 kernels apply in registers.
    #[cfg(target_arch = "x86_64")]
    const KIND: Kind;
    /// The value as f32 (exact).
    fn widen(self) -> f32;
}

/// How an element of B becomes f32.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    F32,
    Bf16,
    F16,
}

impl Element for f32 {
    #[cfg(target_arch = "x86_64")]
    const KIND: Kind = Kind::F32;
    fn widen(self) -> f32 {
        self
    }
}

impl Element for bf16 {
    #[cfg(target_arch = "x86_64")]
    const KIND: Kind = Kind::Bf16;
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

impl Element for f16 {
    #[cfg(target_arch = "x86_64")]
    const KIND: Kind = Kind::F16;
    fn widen(self) -> f32 {
        crate::branchless::f16_to_f32(self)
    }
}

/// A register tile: `rows` rows of A by `cols` columns of B.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

/// Sums of a tile, `sums[r * shape.cols + c]`; the largest tile has 24 elements.
pub(crate) type Sums = [f32; 24];

/// Computes a register tile's dot products in the order of the module docs.
pub(crate) trait RowFma: Copy + Send + Sync {
    /// The tile for the next rows, when `left` rows of A remain (rows past them repeat the last one,
    /// their sums dropped).
    fn shape(self, left: usize) -> Shape;

    /// `sums[r * shape.cols + c]` = A row `r` · B column `c`, each `k` values (A rounded already).
    ///
    /// # Safety
    /// `shape` is one [`RowFma::shape`] returns; `a` holds `shape.rows` pointers and `b` `shape.cols`,
    /// each valid for reading `k` values.
    unsafe fn tile<E: Element>(self, shape: Shape, k: usize, a: &[*const f32], b: &[*const E]) -> Sums;
}

/// The order of the module docs with portable fused multiply-adds, an element at a time. The kernel of
/// [`GemmPath::Portable`] and [`GemmPath::Avx512Model`], and the model the x86 kernels are tested
/// against bit for bit.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowFmaPortable;

impl RowFma for RowFmaPortable {
    fn shape(self, left: usize) -> Shape {
        Shape { rows: left.min(MAX_ROWS), cols: 1 }
    }

    unsafe fn tile<E: Element>(self, shape: Shape, k: usize, a: &[*const f32], b: &[*const E]) -> Sums {
        let mut sums = [0.0; 24];
        for (r, &row) in a.iter().enumerate().take(shape.rows) {
            for (c, &col) in b.iter().enumerate().take(shape.cols) {
                // SAFETY: both hold `k` values, as the caller guarantees.
                let (row, col) =
                    unsafe { (std::slice::from_raw_parts(row, k), std::slice::from_raw_parts(col, k)) };
                sums[r * shape.cols + c] = dot(row, col);
            }
        }
        sums
    }
}

/// One element's sum in the order of the module docs.
fn dot<E: Element>(a: &[f32], b: &[E]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let (a_chunks, b_chunks) = (a.chunks(LANES), b.chunks(LANES));
    for (a, b) in a_chunks.zip(b_chunks) {
        for (l, lane) in lanes.iter_mut().enumerate() {
            let (x, y) = a.get(l).zip(b.get(l)).map_or((0.0, 0.0), |(&x, &y)| (x, y.widen()));
            *lane = x.mul_add(y, *lane);
        }
    }
    pairwise(lanes)
}

/// The 16 lanes added pairwise: `l` and `l + 8`, then `+ 4`, `+ 2`, `+ 1`.
pub(crate) fn pairwise(mut lanes: [f32; LANES]) -> f32 {
    for h in [8, 4, 2, 1] {
        for l in 0..h {
            lanes[l] += lanes[l + h];
        }
    }
    lanes[0]
}

impl Job<'_> {
    /// The product on `kernel` ([`applies`] holds).
    pub(crate) fn run_few_rows<K: RowFma>(&self, kernel: K, parallel: bool) {
        match self.b.data {
            GradSlice::F32(b) => self.run_few_rows_of(kernel, b, parallel),
            GradSlice::Bf16(b) => self.run_few_rows_of(kernel, b, parallel),
            GradSlice::F16(b) => self.run_few_rows_of(kernel, b, parallel),
        }
    }

    fn run_few_rows_of<K: RowFma, E: Element>(&self, kernel: K, b: &[E], parallel: bool) {
        let dims = self.dims;
        let mut rounded = ROUNDED_A.take();
        let a = match self.a.data {
            GradSlice::F32(a) => self.round_rows(a, &mut rounded),
            GradSlice::Bf16(a) => self.round_rows(a, &mut rounded),
            GradSlice::F16(a) => self.round_rows(a, &mut rounded),
        };
        let blocks = dims.n.div_ceil(TASK_COLS);
        let task = |t: usize| {
            let (batch, first) = (t / blocks, t % blocks * TASK_COLS);
            let end = dims.n.min(first + TASK_COLS);
            let mut i0 = 0;
            while i0 < dims.m {
                let shape = kernel.shape(dims.m - i0);
                let rows = shape.rows.min(dims.m - i0);
                // Rows past the last repeat it (and columns past the block's last, below); their sums are
                // dropped.
                let a_ptr: [*const f32; MAX_ROWS] =
                    std::array::from_fn(|s| a[(batch * dims.m + i0 + s.min(rows - 1)) * dims.k..].as_ptr());
                for j0 in (first..end).step_by(shape.cols) {
                    let cols = shape.cols.min(end - j0);
                    let b_ptr: [*const E; 8] = std::array::from_fn(|c| {
                        b[batch * self.b.batch_stride + (j0 + c.min(cols - 1)) * self.b.col_stride..].as_ptr()
                    });
                    // SAFETY: `shape` is the kernel's; every row of `a` holds `k` values (dense), and
                    // every column of B `k` from its start (`layout::check_operands`, `k` contiguous as
                    // `reads` requires).
                    let sums =
                        unsafe { kernel.tile(shape, dims.k, &a_ptr[..shape.rows], &b_ptr[..shape.cols]) };
                    for r in 0..rows {
                        for c in 0..cols {
                            self.write(batch, i0 + r, j0 + c, sums[r * shape.cols + c]);
                        }
                    }
                }
                i0 += rows;
            }
        };
        let tasks = dims.batch * blocks;
        if parallel {
            (0..tasks).into_par_iter().for_each(task);
        } else {
            (0..tasks).for_each(task);
        }
        ROUNDED_A.set(rounded);
    }

    /// A's rows rounded to the compute precision into `out` (grown as needed, never shrunk), dense
    /// (`[batch][m][k]`).
    fn round_rows<'o, S: Source>(&self, a: &[S], out: &'o mut Vec<f32>) -> &'o [f32] {
        let (dims, op) = (self.dims, &self.a);
        let len = dims.batch * dims.m * dims.k;
        if out.len() < len {
            out.resize(len, 0.0);
        }
        for (r, dst) in out[..len].chunks_exact_mut(dims.k).enumerate() {
            let (batch, i) = (r / dims.m, r % dims.m);
            let row = &a[batch * op.batch_stride + i * op.row_stride..];
            if op.col_stride == 1 {
                convert_run(&row[..dims.k], self.compute, dst);
            } else {
                for (kk, d) in dst.iter_mut().enumerate() {
                    *d = row[kk * op.col_stride].rounded(self.compute);
                }
            }
        }
        &out[..len]
    }
}

#[cfg(test)]
mod tests;
