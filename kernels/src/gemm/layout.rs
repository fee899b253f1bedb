//! Shapes, strided operand views and their validation.

use crate::{GradSlice, GradSliceMut};

use super::GemmPath;

/// The sizes of a batched product: `batch` products of `(m x k) · (k x n)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Dims {
    /// Number of independent products.
    pub batch: usize,
    /// Rows of A and C.
    pub m: usize,
    /// Columns of B and C.
    pub n: usize,
    /// Columns of A, rows of B: the summed dimension.
    pub k: usize,
}

impl Dims {
    /// One product of `(m x k) · (k x n)`.
    #[must_use]
    pub fn new(m: usize, n: usize, k: usize) -> Dims {
        Dims { batch: 1, m, n, k }
    }

    /// `batch` products of `(m x k) · (k x n)`.
    #[must_use]
    pub fn batched(batch: usize, m: usize, n: usize, k: usize) -> Dims {
        Dims { batch, m, n, k }
    }

    /// Floating-point operations of the product (a multiply and an add per term).
    #[must_use]
    pub fn flops(&self) -> f64 {
        2.0 * self.batch as f64 * self.m as f64 * self.n as f64 * self.k as f64
    }
}

/// Several products of the same sizes and strides, each reading its operands a fixed distance after
/// the one before: attention's heads, side by side in the rows of a projection. One call runs them all
/// in one parallel loop (no fork and join per product).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Groups {
    /// How many products.
    pub count: usize,
    /// Elements from one product's A to the next's.
    pub a_step: usize,
    /// Elements from one product's B to the next's.
    pub b_step: usize,
    /// Where each product's result goes in the new C.
    pub placement: Placement,
}

/// Where the products of [`Groups`] write their results in a new dense C.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// C is `(batch, m, count * n)`: product `g` the columns `g * n .. (g + 1) * n` of every row (heads
    /// side by side, as a projection holds them).
    SideBySide,
    /// C is `(count, batch, m, n)`: product `g`'s batch after product `g - 1`'s.
    Stacked,
}

/// Zeros of a product that its user knows of, and which the driver may skip: attention under a causal
/// mask, where query `i` sees keys `j <= i`. Indices are those of each matrix of the batch. The caller
/// vouches for the zeros (a non-zero there would be left out too). Skipping leaves out terms whose A
/// factor is an exact zero, so the sums are the full product's unless B holds an infinity or a NaN
/// where it meets those zeros, up to the sign of a zero sum. The driver skips whole tiles and groups
/// of steps, so some of the zeros are still multiplied; paths that do not skip (the skinny one)
/// compute the full product.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Triangle {
    /// Nothing is skipped.
    #[default]
    Full,
    /// `A[i][p] = 0` for `p > i`: row `i` of C sums over `p <= i` (causal probabilities times `V`, or
    /// their gradient times `K`).
    ZeroAboveA,
    /// `A[i][p] = 0` for `p < i`: row `i` of C sums over `p >= i` (the transposed probabilities or their
    /// gradient times the result's gradient or `Q`).
    ZeroBelowA,
    /// Only `C[i][j]` for `j <= i` is wanted (causal scores): tiles of C wholly above the diagonal are
    /// written as zero instead of computed. The rest of C holds the product.
    LowerC,
}

/// A read-only matrix operand: element `(b, i, j)` is `data[b * batch_stride + i * row_stride + j *
/// col_stride]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    /// The elements.
    pub data: GradSlice<'a>,
    /// Distance between consecutive rows.
    pub row_stride: usize,
    /// Distance between consecutive columns.
    pub col_stride: usize,
    /// Distance between consecutive matrices of a batch.
    pub batch_stride: usize,
}

impl<'a> MatRef<'a> {
    /// A row-major matrix with `cols` columns (one matrix: batch stride 0).
    pub fn row_major(data: impl Into<GradSlice<'a>>, cols: usize) -> MatRef<'a> {
        MatRef { data: data.into(), row_stride: cols, col_stride: 1, batch_stride: 0 }
    }

    /// The transpose of a row-major matrix with `cols` columns: a Linear weight `(out, in)` read as the
    /// `(in, out)` operand of `x·W^T`.
    pub fn transposed(data: impl Into<GradSlice<'a>>, cols: usize) -> MatRef<'a> {
        MatRef { data: data.into(), row_stride: 1, col_stride: cols, batch_stride: 0 }
    }

    /// The same view with a batch stride.
    #[must_use]
    pub fn with_batch_stride(self, batch_stride: usize) -> MatRef<'a> {
        MatRef { batch_stride, ..self }
    }

    /// The same strides from `offset` elements on, or `None` past the slice's end.
    pub(crate) fn advanced(self, offset: usize) -> Option<MatRef<'a>> {
        (offset <= self.data.len()).then(|| MatRef { data: self.data.split_at(offset).1, ..self })
    }
}

/// The output matrix: element `(b, i, j)` is `data[b * batch_stride + i * row_stride + j]`.
#[derive(Debug)]
pub struct MatMut<'a> {
    /// The elements (f32, or rounded to f16 / bf16 once, from the f32 sums).
    pub data: GradSliceMut<'a>,
    /// Distance between consecutive rows (at least `n`: elements of C never overlap).
    pub row_stride: usize,
    /// Distance between consecutive matrices of a batch.
    pub batch_stride: usize,
}

impl<'a> MatMut<'a> {
    /// A row-major matrix with `cols` columns (one matrix: batch stride 0).
    pub fn row_major(data: impl Into<GradSliceMut<'a>>, cols: usize) -> MatMut<'a> {
        MatMut { data: data.into(), row_stride: cols, batch_stride: 0 }
    }

    /// The same view with a batch stride.
    #[must_use]
    pub fn with_batch_stride(self, batch_stride: usize) -> MatMut<'a> {
        MatMut { batch_stride, ..self }
    }

    pub(crate) fn len(&self) -> usize {
        match &self.data {
            GradSliceMut::F32(s) => s.len(),
            GradSliceMut::F16(s) => s.len(),
            GradSliceMut::Bf16(s) => s.len(),
        }
    }
}

/// Why a GEMM was refused. Nothing is written when a call is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum GemmError {
    /// An operand's strides reach past the end of its slice.
    #[error(
        "GEMM operand {operand} ({rows} x {cols}, batch {batch}) reaches element {needed} but its slice has \
         {len}: check its strides (row {row_stride}, column {col_stride}, batch {batch_stride})"
    )]
    OutOfBounds {
        /// "A", "B" or "C".
        operand: &'static str,
        /// Rows of the operand.
        rows: usize,
        /// Columns of the operand.
        cols: usize,
        /// Matrices in the batch.
        batch: usize,
        /// The row stride.
        row_stride: usize,
        /// The column stride.
        col_stride: usize,
        /// The batch stride.
        batch_stride: usize,
        /// One past the largest index the view reaches (saturated on overflow).
        needed: usize,
        /// The slice's length.
        len: usize,
    },
    /// C's elements overlap, so parallel blocks would write the same element.
    #[error(
        "GEMM output C ({m} x {n}, batch {batch}) overlaps itself: row stride {row_stride} must be at least \
         {n} and batch stride {batch_stride} at least {min_batch_stride}"
    )]
    OverlappingOutput {
        /// Rows of C.
        m: usize,
        /// Columns of C.
        n: usize,
        /// Matrices in the batch.
        batch: usize,
        /// C's row stride.
        row_stride: usize,
        /// C's batch stride.
        batch_stride: usize,
        /// The smallest batch stride that does not overlap.
        min_batch_stride: usize,
    },
    /// A bias row whose length is not C's column count.
    #[error("GEMM bias has {len} elements but C has {n} columns")]
    BiasLength {
        /// The bias's length.
        len: usize,
        /// C's columns.
        n: usize,
    },
    /// A product whose packed operands (each padded to whole panels and k-groups) would not fit in the
    /// address space: only operands that repeat their elements through zero strides can be that large.
    #[error(
        "GEMM product too large to pack: {products} product(s) of ({m} x {k}) · ({k} x {n}) would pack more \
         than isize::MAX bytes; split it along k or the batch"
    )]
    TooLarge {
        /// Products of the call (the batch, times the groups).
        products: usize,
        /// Rows of A and C.
        m: usize,
        /// Columns of B and C.
        n: usize,
        /// The summed dimension.
        k: usize,
    },
    /// The path cannot run here or cannot compute this product.
    #[error("GEMM path `{path}` cannot run: {reason}")]
    Unsupported {
        /// The path asked for.
        path: GemmPath,
        /// Why not.
        reason: String,
    },
}

/// One past the largest index of a `(batch, rows, cols)` view, or `None` on overflow.
fn extent(batch: usize, rows: usize, cols: usize, strides: [usize; 3]) -> Option<usize> {
    if batch == 0 || rows == 0 || cols == 0 {
        return Some(0);
    }
    let last = (batch - 1)
        .checked_mul(strides[0])?
        .checked_add((rows - 1).checked_mul(strides[1])?)?
        .checked_add((cols - 1).checked_mul(strides[2])?)?;
    last.checked_add(1)
}

fn check_bounds(
    operand: &'static str,
    (batch, rows, cols): (usize, usize, usize),
    strides: [usize; 3],
    len: usize,
) -> Result<(), GemmError> {
    let needed = extent(batch, rows, cols, strides).unwrap_or(usize::MAX);
    if needed <= len {
        return Ok(());
    }
    let [batch_stride, row_stride, col_stride] = strides;
    Err(GemmError::OutOfBounds {
        operand,
        rows,
        cols,
        batch,
        row_stride,
        col_stride,
        batch_stride,
        needed,
        len,
    })
}

/// Every index the product reads of A and B is inside its slice, and the packed operands fit in memory.
pub(crate) fn check_operands(dims: Dims, a: &MatRef<'_>, b: &MatRef<'_>) -> Result<(), GemmError> {
    let Dims { batch, m, n, k } = dims;
    check_bounds("A", (batch, m, k), [a.batch_stride, a.row_stride, a.col_stride], a.data.len())?;
    check_bounds("B", (batch, k, n), [b.batch_stride, b.row_stride, b.col_stride], b.data.len())?;
    check_packable(dims, 1)
}

/// The packing's sizes, `products x rows x steps` words with rows padded to a panel (at most 64) and
/// steps to a group (at most 32 `k`), cannot overflow: bounded here by `products (rows + 64) (k + 64)`
/// 4-byte words within `isize::MAX` bytes, for A's rows and B's columns. An operand with zero strides
/// passes the bounds check at any size; without this, a `k` near `usize::MAX` wrapped the packed
/// lengths to nothing in a release build and the micro-kernel read past the buffers.
fn check_packable(dims: Dims, groups: usize) -> Result<(), GemmError> {
    let Dims { batch, m, n, k } = dims;
    let products = batch.checked_mul(groups);
    let bytes = |rows: usize| {
        products?.checked_mul(rows.checked_add(64)?)?.checked_mul(k.checked_add(64)?)?.checked_mul(4)
    };
    let fits = |rows: usize| bytes(rows).is_some_and(|b| b <= isize::MAX as usize);
    if fits(m) && fits(n) {
        return Ok(());
    }
    Err(GemmError::TooLarge { products: products.unwrap_or(usize::MAX), m, n, k })
}

/// Every index that any product of `groups` reads of A and B is inside its slice: the first's and the
/// last's (the others lie between them).
pub(crate) fn check_groups<'a>(
    dims: Dims,
    a: &MatRef<'a>,
    b: &MatRef<'a>,
    groups: &Groups,
) -> Result<(), GemmError> {
    check_operands(dims, a, b)?;
    let Some(last) = groups.count.checked_sub(1) else { return Ok(()) };
    let shifted = |operand: &'static str, view: MatRef<'a>, step: usize, (rows, cols): (usize, usize)| {
        let offset = last.checked_mul(step);
        offset.and_then(|offset| view.advanced(offset)).ok_or(GemmError::OutOfBounds {
            operand,
            rows,
            cols,
            batch: dims.batch,
            row_stride: view.row_stride,
            col_stride: view.col_stride,
            batch_stride: view.batch_stride,
            needed: offset.unwrap_or(usize::MAX).saturating_add(1),
            len: view.data.len(),
        })
    };
    let a = shifted("A", *a, groups.a_step, (dims.m, dims.k))?;
    let b = shifted("B", *b, groups.b_step, (dims.k, dims.n))?;
    check_operands(dims, &a, &b)?;
    check_packable(dims, groups.count)
}

/// Every index the product reads or writes is inside its slice, and C's elements are distinct.
pub(crate) fn check(dims: Dims, a: &MatRef<'_>, b: &MatRef<'_>, c: &MatMut<'_>) -> Result<(), GemmError> {
    let Dims { batch, m, n, .. } = dims;
    check_operands(dims, a, b)?;
    check_bounds("C", (batch, m, n), [c.batch_stride, c.row_stride, 1], c.len())?;
    if batch == 0 || m == 0 || n == 0 {
        return Ok(());
    }
    let min_batch_stride = (m - 1) * c.row_stride + n;
    let rows_overlap = m > 1 && c.row_stride < n;
    let batches_overlap = batch > 1 && c.batch_stride < min_batch_stride;
    if rows_overlap || batches_overlap {
        let (row_stride, batch_stride) = (c.row_stride, c.batch_stride);
        return Err(GemmError::OverlappingOutput { m, n, batch, row_stride, batch_stride, min_batch_stride });
    }
    Ok(())
}
