//! General matrix products for training: `C = A·B` or `C += A·B` with A and B in f32, f16 or bf16,
//! products accumulated in f32, C in f32, f16 or bf16.
//!
//! - **Layouts by strides.** Each operand is a [`MatRef`]: a slice plus row, column and batch strides, so
//!   a transposed operand (a Linear weight `(out, in)` used as `W^T`) is read in place, and a batch of
//!   products (attention's `Q·K^T` per head) is one call.
//! - **Compute precision.** [`Compute`] says what the products are computed from: operands are rounded to
//!   it while they are packed (a bf16 product of f32 activations needs no separate cast pass), then
//!   multiplied exactly and summed in f32.
//! - **Paths.** [`GemmPath`]: `vdpbf16ps` on AVX512-BF16 where it outruns the FMA (measured once per
//!   process, [`dot_product_speedup`]; bf16 products, k-pairs interleaved while packing), f32 FMA on zmm (AVX-512) or ymm (AVX2) registers with half operands widened while packing,
//!   a portable f32 path, and [`GemmPath::Avx512Bf16Model`], a bit-exact software model of the
//!   `vdpbf16ps` path that runs on any CPU, so its packing, interleaving, blocking, edges and threading
//!   are tested everywhere ([`GemmPath::Avx512Model`] does the same for the zmm FMA path). f16 always
//!   computes through f32: no CPU here multiplies f16 quickly.
//! - **Structure.** Both operands are packed once per call into panels (reusable per-thread buffers: a
//!   call allocates only when a product is larger than any before it on that thread), then blocks of C
//!   run in parallel on the current rayon pool, each through a register-blocked micro-kernel. A product
//!   of few rows whose B lies contiguous along `k` (a Linear's forward on a small batch or a single
//!   token, the weight `(out, in)` read as `W^T`) skips packing B: on the FMA paths when B is in a type
//!   the product computes in exactly (at most 16 rows, 8 for an f32 B, `k` of 32 a row), each element
//!   a dot product in 16 lanes, the same order on zmm, ymm and portable code; on the `vdpbf16ps` path
//!   (bf16, at most 64 rows, A along `k` too) each element a dot product of a row and a column where
//!   they lie. On AMX, a single product (or a batch) of at most 64 rows whose B is bf16 contiguous
//!   along `k`, `k` and `n` at least 32 and nothing skipped, reads B once where it lies (the last
//!   `k % 32` through a zero-padded tile), its tiles computing `C^T = B^T·A^T` with the packed path's
//!   sums.
//!   Every element of C is summed in the same order whatever the thread count, so results are
//!   deterministic.
//!
//! ```
//! use amp_kernels::gemm::{gemm, Compute, Dims, MatMut, MatRef, Start};
//! use half::bf16;
//!
//! // (2 x 3) · (3 x 2), both bf16, C in f32.
//! let a: Vec<bf16> = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0].map(bf16::from_f32).to_vec();
//! let b: Vec<bf16> = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0].map(bf16::from_f32).to_vec();
//! let mut c = vec![0.0f32; 4];
//! gemm(
//!     Dims::new(2, 2, 3),
//!     MatRef::row_major(&a[..], 3),
//!     MatRef::row_major(&b[..], 2),
//!     MatMut::row_major(&mut c[..], 2),
//!     Compute::Bf16,
//!     Start::Zero,
//! )?;
//! assert_eq!(c, [4.0, 5.0, 10.0, 11.0]);
//! # Ok::<(), amp_kernels::gemm::GemmError>(())
//! ```

mod calibrate;
mod dpbf16;
mod driver;
mod few_rows;
mod layout;
mod micro;
mod pack;
mod path;
mod prefetch;
mod row_load;
mod skinny;
mod transpose;

pub use calibrate::{dot_product_speedup, PeakLoop, DOT_PAYS};
pub use dpbf16::{dpbf16_lane, dpbf16_pair, tdpbf16_pair};
pub use layout::{Dims, GemmError, Groups, MatMut, MatRef, Placement, Triangle};
#[cfg(target_arch = "x86_64")]
pub(crate) use micro::{tile_peak_loop, tile_step_loop};
pub use path::{Compute, GemmPath};

use crate::GradSliceMut;

/// `C = start + A·B` on the fastest path this CPU has for `compute` ([`GemmPath::choose`]): `start` is
/// zero, C itself (`C += A·B`) or a bias row added to every row (a Linear's epilogue, in f32 before C
/// is rounded).
///
/// # Errors
/// [`GemmError`] if an operand's strides reach past its slice, or C's elements overlap.
pub fn gemm(
    dims: Dims,
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: MatMut<'_>,
    compute: Compute,
    start: Start<'_>,
) -> Result<(), GemmError> {
    gemm_with(GemmPath::choose(compute), dims, a, b, c, compute, start)
}

/// [`gemm`] on an explicit path.
///
/// # Errors
/// As [`gemm`], and [`GemmError::Unsupported`] if this CPU cannot run `path` or `path` cannot compute
/// in `compute` (only bf16 products run on the `vdpbf16ps` paths).
pub fn gemm_with(
    path: GemmPath,
    dims: Dims,
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: MatMut<'_>,
    compute: Compute,
    start: Start<'_>,
) -> Result<(), GemmError> {
    path.check(compute)?;
    layout::check(dims, &a, &b, &c)?;
    if let Start::Bias(bias) = start {
        if bias.len() != dims.n {
            return Err(GemmError::BiasLength { len: bias.len(), n: dims.n });
        }
    }
    driver::run(path, dims, a, b, c, compute, start);
    Ok(())
}

/// The element type of a C that [`gemm_new`] allocates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputType {
    /// f32.
    F32,
    /// f16, rounded once from the f32 sums.
    F16,
    /// bf16, rounded once from the f32 sums.
    Bf16,
}

/// A C that [`gemm_new`] allocated: dense, row-major, `batch * m * n` elements.
#[derive(Clone, Debug, PartialEq)]
pub enum NewOutput {
    /// f32 elements.
    F32(Vec<f32>),
    /// f16 elements.
    F16(Vec<half::f16>),
    /// bf16 elements.
    Bf16(Vec<half::bf16>),
}

/// `C = A·B` (or `bias + A·B` in every row) into a new dense C of `out`'s type, on `path`. C is
/// allocated and written once, never zeroed first: the products of the first k-block store where a
/// zeroed buffer would have been read.
///
/// # Errors
/// As [`gemm_with`].
pub fn gemm_new(
    path: GemmPath,
    dims: Dims,
    a: MatRef<'_>,
    b: MatRef<'_>,
    out: OutputType,
    compute: Compute,
    bias: Option<&[f32]>,
) -> Result<NewOutput, GemmError> {
    let (start, len) = new_c(path, compute, dims, (&a, &b), bias)?;
    Ok(match out {
        OutputType::F32 => NewOutput::F32(driver::run_new(path, dims, a, b, compute, start, len)),
        OutputType::F16 => NewOutput::F16(driver::run_new(path, dims, a, b, compute, start, len)),
        OutputType::Bf16 => NewOutput::Bf16(driver::run_new(path, dims, a, b, compute, start, len)),
    })
}

/// [`gemm_new`] of an f32 C that is read again only after much other work, such as a weight's gradient
/// (read by the optimizer after the whole backward pass), and whether all of C is finite. On x86-64
/// each block of C is summed in a scratch block of the worker's and written out with streaming stores,
/// which do not first read C's cache lines as ordinary stores do (half the memory traffic of a C the
/// caches cannot hold), and checked for infinities and NaNs while it is in cache. The same values as
/// [`gemm_new`]'s, bit for bit; C is not left in the caches.
///
/// # Errors
/// As [`gemm_new`].
pub fn gemm_new_streamed(
    path: GemmPath,
    dims: Dims,
    a: MatRef<'_>,
    b: MatRef<'_>,
    compute: Compute,
    bias: Option<&[f32]>,
) -> Result<(Vec<f32>, bool), GemmError> {
    let (start, len) = new_c(path, compute, dims, (&a, &b), bias)?;
    Ok(driver::run_new_streamed(path, dims, a, b, compute, start, len))
}

/// What a new C's products check first (the path, the operands, the bias's length), and then C's start
/// and its length.
fn new_c<'b>(
    path: GemmPath,
    compute: Compute,
    dims: Dims,
    (a, b): (&MatRef<'_>, &MatRef<'_>),
    bias: Option<&'b [f32]>,
) -> Result<(Start<'b>, usize), GemmError> {
    path.check(compute)?;
    layout::check_operands(dims, a, b)?;
    if let Some(bias) = bias {
        if bias.len() != dims.n {
            return Err(GemmError::BiasLength { len: bias.len(), n: dims.n });
        }
    }
    let len = dims.batch.checked_mul(dims.m).and_then(|x| x.checked_mul(dims.n)).expect("C fits in memory");
    Ok((bias.map_or(Start::Zero, Start::Bias), len))
}

/// `groups.count` products of the same shape into a new C of `out`'s type, product `g` reading `a` and
/// `b` `g * a_step` and `g * b_step` elements on, each `(batch, m, n)` with `k` steps (`dims`), placed
/// side by side (C `(batch, m, count * n)`, product `g` the columns `g * n ..` of every row) or stacked
/// (C `(count, batch, m, n)`). One parallel loop runs them all; `triangle` names zeros of A or a part
/// of C that it may skip ([`Triangle`]). Allocated and written once, as [`gemm_new`]'s C: attention's
/// heads read and written where a `(batch, t, heads * d)` activation holds them, without a permuted
/// copy.
///
/// # Errors
/// As [`gemm_with`], for any product's operands.
pub fn gemm_new_groups(
    path: GemmPath,
    dims: Dims,
    (a, b): (MatRef<'_>, MatRef<'_>),
    groups: Groups,
    out: OutputType,
    compute: Compute,
    triangle: Triangle,
) -> Result<NewOutput, GemmError> {
    path.check(compute)?;
    layout::check_groups(dims, &a, &b, &groups)?;
    groups
        .count
        .checked_mul(dims.n)
        .and_then(|w| w.checked_mul(dims.m))
        .and_then(|x| x.checked_mul(dims.batch))
        .expect("C fits in memory");
    let run = (path, dims, (a, b), &groups, compute, triangle);
    Ok(match out {
        OutputType::F32 => NewOutput::F32(new_groups(run)),
        OutputType::F16 => NewOutput::F16(new_groups(run)),
        OutputType::Bf16 => NewOutput::Bf16(new_groups(run)),
    })
}

/// [`gemm_new_groups`] into a C the caller holds: its first `groups.count * batch * m * n` elements,
/// laid out as `groups.placement` says, every one of them written (what they held is never read).
/// Attention computes a batch's heads this way where it keeps their results, one batch at a time.
///
/// # Errors
/// As [`gemm_new_groups`], and [`GemmError::OutOfBounds`] (operand "C") if `c` is shorter.
pub fn gemm_groups_into(
    path: GemmPath,
    dims: Dims,
    (a, b): (MatRef<'_>, MatRef<'_>),
    groups: Groups,
    c: GradSliceMut<'_>,
    compute: Compute,
    triangle: Triangle,
) -> Result<(), GemmError> {
    path.check(compute)?;
    layout::check_groups(dims, &a, &b, &groups)?;
    let len = groups
        .count
        .checked_mul(dims.n)
        .and_then(|w| w.checked_mul(dims.m))
        .and_then(|x| x.checked_mul(dims.batch))
        .unwrap_or(usize::MAX);
    if c.len() < len {
        let (row_stride, batch_stride) = match groups.placement {
            Placement::SideBySide => (groups.count * dims.n, dims.m * groups.count * dims.n),
            Placement::Stacked => (dims.n, dims.m * dims.n),
        };
        return Err(GemmError::OutOfBounds {
            operand: "C",
            rows: dims.m,
            cols: dims.n,
            batch: dims.batch,
            row_stride,
            col_stride: 1,
            batch_stride,
            needed: len,
            len: c.len(),
        });
    }
    let run = (path, dims, (a, b), &groups, compute, triangle);
    match c {
        GradSliceMut::F32(c) => groups_into(run, c),
        GradSliceMut::F16(c) => groups_into(run, c),
        GradSliceMut::Bf16(c) => groups_into(run, c),
    }
    Ok(())
}

fn groups_into<T: driver::NewElement>(
    (path, dims, operands, groups, compute, triangle): GroupsRun<'_, '_>,
    c: &mut [T],
) {
    driver::run_groups_into(path, dims, operands, groups, compute, triangle, c);
}

/// What [`gemm_new_groups`] hands the driver, for a C of any element type.
type GroupsRun<'a, 'g> = (GemmPath, Dims, (MatRef<'a>, MatRef<'a>), &'g Groups, Compute, Triangle);

fn new_groups<T: driver::NewElement>(
    (path, dims, operands, groups, compute, triangle): GroupsRun<'_, '_>,
) -> Vec<T> {
    driver::run_new_groups(path, dims, operands, groups, compute, triangle)
}

/// What each element of C starts from before the products are added.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Start<'a> {
    /// Zero: `C = A·B`.
    Zero,
    /// C's current values: `C += A·B` (a half C is widened, summed in f32 and rounded once).
    Output,
    /// `bias[j]` in every row: `C = bias + A·B`, the bias added in f32 before C is rounded.
    Bias(&'a [f32]),
}
