//! bf16 products with few rows of A whose operands both lie contiguous along `k`, as a Linear's forward
//! on a small batch reads them (rows of `x`, and the weight `(out, in)` read as `W^T`): each element of
//! C is a dot product of an A row and a B column computed where they lie, with no packing.
//!
//! The packed path reads a skinny product's B three times (packing it, writing it, reading it back) to
//! use each B value a few times; here each B value is read once from memory and used by every row of
//! A (from L1/L2). On the `vdpbf16ps` path (and its model, bit for bit) for `m <= MAX_ROWS`.
//!
//! Order of the sums: 16 lanes, lane `l` summing the pairs `k = 32c + 2l, 2l + 1` of chunk `c` in chunk
//! order with `vdpbf16ps`'s semantics ([`super::dpbf16_pair`]); then the lanes added pairwise (`l` and
//! `l + 8`, then `+ 4`, `+ 2`, `+ 1`); then the start (C or a bias), if any, added; then C rounded once.

use std::cell::Cell;

use half::{bf16, f16};
use rayon::prelude::*;

use super::dpbf16::dpbf16_pair;
use super::driver::{Job, Ptr};
use super::{Compute, Dims, GemmPath, MatRef, Start};
use crate::gemm::pack::Source;
use crate::GradSlice;

thread_local! {
    /// A's rows rounded to bf16 (when A is not bf16 already), kept for the calling thread's next product.
    static ROUNDED_A: Cell<Vec<u16>> = const { Cell::new(Vec::new()) };
}

/// At most this many rows of A take this path: where it stops winning clearly over the packed path
/// (Zen 4, 2 threads, `m x 4096 x 4096`: 1.2-3.4x faster for m = 8..48; at m = 64, 344 against 223
/// GFLOP/s in one run and 212 against 229 in another, the B columns no longer staying in L1 across the
/// row tiles).
pub(crate) const MAX_ROWS: usize = 64;

/// Rows of A per register tile.
const ROWS: usize = 6;
/// Columns of B per register tile.
const COLS: usize = 4;
/// Columns of B per parallel task.
const TASK_COLS: usize = 32;
/// `k` per `vdpbf16ps` (16 lanes of pairs).
const CHUNK: usize = 32;

/// Whether `job` on `path` takes this path: bf16 products on `vdpbf16ps` or its model whose operands
/// this path reads ([`reads`]).
pub(crate) fn applies(path: GemmPath, job: &Job<'_>) -> bool {
    matches!(path, GemmPath::Avx512Bf16 | GemmPath::Avx512Bf16Model)
        && reads(job.compute, job.dims, &job.a, &job.b)
}

/// Whether a product's operands are what this path reads in place: bf16 products, B stored as bf16 with
/// `k` contiguous, A (any dtype) with `k` contiguous, at most [`MAX_ROWS`] rows, `k` at least one
/// chunk.
pub(crate) fn reads(compute: Compute, dims: Dims, a: &MatRef<'_>, b: &MatRef<'_>) -> bool {
    compute == Compute::Bf16
        && matches!(b.data, GradSlice::Bf16(_))
        && b.row_stride == 1
        && a.col_stride == 1
        && dims.m <= MAX_ROWS
        && dims.k >= CHUNK
}

/// Sums of a register tile: `sums[s][r]` = A row `s` · B column `r` in the order of the module docs.
type Sums = [[f32; COLS]; ROWS];

/// Computes one register tile's dot products.
pub(crate) trait RowDots: Copy + Send + Sync {
    /// `k` bf16 values from each of `ROWS` A rows and `COLS` B columns (bits).
    ///
    /// # Safety
    /// Every pointer is valid for reading `k` values.
    unsafe fn sums(self, k: usize, a: &[*const u16; ROWS], b: &[*const u16; COLS]) -> Sums;
}

/// The model: [`dpbf16_pair`] lane by lane.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowDotsModel;

impl RowDots for RowDotsModel {
    unsafe fn sums(self, k: usize, a: &[*const u16; ROWS], b: &[*const u16; COLS]) -> Sums {
        // Pair `l` of chunk `c`: the even `k` low, the odd one high; zero past `k`.
        let pair = |p: *const u16, c: usize, l: usize| -> u32 {
            // SAFETY: below `k`, as the caller guarantees.
            let at = |i: usize| if i < k { u32::from(unsafe { *p.add(i) }) } else { 0 };
            at(c * CHUNK + 2 * l) | at(c * CHUNK + 2 * l + 1) << 16
        };
        let mut sums = [[0.0; COLS]; ROWS];
        for (s, row) in sums.iter_mut().enumerate() {
            for (r, sum) in row.iter_mut().enumerate() {
                let mut lanes = [0.0f32; 16];
                for c in 0..k.div_ceil(CHUNK) {
                    for (l, lane) in lanes.iter_mut().enumerate() {
                        *lane = dpbf16_pair(*lane, pair(a[s], c, l), pair(b[r], c, l));
                    }
                }
                for h in [8, 4, 2, 1] {
                    for l in 0..h {
                        lanes[l] += lanes[l + h];
                    }
                }
                *sum = lanes[0];
            }
        }
        sums
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{reduce as reduce_zmm, RowDotsAvx512Bf16};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m512, __m512bh, __m512i, _mm512_add_ps, _mm512_cvtss_f32, _mm512_dpbf16_ps, _mm512_loadu_si512,
        _mm512_maskz_loadu_epi16, _mm512_permute_ps, _mm512_setzero_ps, _mm512_shuffle_f32x4,
    };

    use super::{RowDots, Sums, CHUNK, COLS, ROWS};
    use crate::Isa;

    /// `vdpbf16ps` on zmm registers: 24 accumulators. Constructible only where AVX512-BF16 runs.
    #[derive(Clone, Copy, Debug)]
    pub(crate) struct RowDotsAvx512Bf16(());

    impl RowDotsAvx512Bf16 {
        pub(crate) fn new() -> Option<Self> {
            Isa::Avx512Bf16.is_supported().then_some(RowDotsAvx512Bf16(()))
        }
    }

    impl RowDots for RowDotsAvx512Bf16 {
        unsafe fn sums(self, k: usize, a: &[*const u16; ROWS], b: &[*const u16; COLS]) -> Sums {
            // SAFETY: the CPU runs AVX512-BF16 (and BW, part of it here: `Isa::Avx512`); pointers as the
            // caller guarantees.
            unsafe { sums(k, a, b) }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn sums(k: usize, a: &[*const u16; ROWS], b: &[*const u16; COLS]) -> Sums {
        let mut acc = [[_mm512_setzero_ps(); COLS]; ROWS];
        let full = k / CHUNK;
        // SAFETY (whole body): AVX512-BF16 and BW run here; each chunk reads 32 values from `c * CHUNK`,
        // all below `k` but in the last, partial one, which loads only those (masked, the rest zero).
        unsafe {
            for c in 0..full {
                chunk::<false>(&mut acc, a, b, c * CHUNK, 0);
            }
            let rest = k - full * CHUNK;
            if rest > 0 {
                chunk::<true>(&mut acc, a, b, full * CHUNK, (1u32 << rest) - 1);
            }
            let mut sums = [[0.0; COLS]; ROWS];
            for (row, sums) in acc.iter().zip(&mut sums) {
                for (&v, sum) in row.iter().zip(sums) {
                    *sum = reduce(v);
                }
            }
            sums
        }
    }

    /// One chunk of 32 `k` at `at` into the accumulators; `MASKED` loads only the values `mask` names.
    ///
    /// # Safety
    /// AVX512-BF16 and BW (inlined into [`sums`], whose features it takes, so that the accumulators stay
    /// in registers); the values loaded lie in the rows.
    #[inline(always)]
    unsafe fn chunk<const MASKED: bool>(
        acc: &mut [[__m512; COLS]; ROWS],
        a: &[*const u16; ROWS],
        b: &[*const u16; COLS],
        at: usize,
        mask: u32,
    ) {
        // SAFETY (whole body): as the caller guarantees. A zmm of 32 bf16 is a zmm of 16 pairs: the
        // transmutes only retype registers.
        unsafe {
            let load = |p: *const u16| -> __m512bh {
                if MASKED {
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi16(mask, p.add(at).cast()))
                } else {
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p.add(at).cast()))
                }
            };
            let bv: [__m512bh; COLS] = [load(b[0]), load(b[1]), load(b[2]), load(b[3])];
            for (row, &pa) in acc.iter_mut().zip(a) {
                let av = load(pa);
                for (x, &bj) in row.iter_mut().zip(&bv) {
                    *x = _mm512_dpbf16_ps(*x, av, bj);
                }
            }
        }
    }

    /// The 16 lanes added pairwise: `l` and `l + 8`, then `+ 4`, `+ 2`, `+ 1`.
    ///
    /// # Safety
    /// AVX-512 (inlined, as [`chunk`]; also into `few_rows`'s zmm kernel).
    #[inline(always)]
    pub(crate) unsafe fn reduce(v: __m512) -> f32 {
        // SAFETY: as the caller guarantees.
        unsafe {
            let v = _mm512_add_ps(v, _mm512_shuffle_f32x4::<0b00_00_11_10>(v, v));
            let v = _mm512_add_ps(v, _mm512_shuffle_f32x4::<0b00_00_00_01>(v, v));
            let v = _mm512_add_ps(v, _mm512_permute_ps::<0b00_00_11_10>(v));
            let v = _mm512_add_ps(v, _mm512_permute_ps::<0b00_00_00_01>(v));
            _mm512_cvtss_f32(v)
        }
    }
}

impl Job<'_> {
    /// The product on `kernel` ([`applies`] holds).
    pub(crate) fn run_skinny<K: RowDots>(&self, kernel: K, parallel: bool) {
        let dims = self.dims;
        let GradSlice::Bf16(b) = self.b.data else { unreachable!("applies: B is bf16") };
        // A's rows as bf16 bits, k contiguous: in place when A is bf16 with unit row steps, else rounded
        // into a buffer (A is small: m <= MAX_ROWS rows).
        let mut rounded = ROUNDED_A.take();
        let (a_bits, a_row, a_batch): (&[u16], usize, usize) = match self.a.data {
            GradSlice::Bf16(a) => (bf16_bits(a), self.a.row_stride, self.a.batch_stride),
            GradSlice::F32(a) => (round_rows(a, self, &mut rounded), dims.k, dims.m * dims.k),
            GradSlice::F16(a) => (round_rows(a, self, &mut rounded), dims.k, dims.m * dims.k),
        };
        let b_bits = bf16_bits(b);
        let tasks = dims.batch * dims.n.div_ceil(TASK_COLS);
        let task = |t: usize| {
            let (batch, col0) = (t / dims.n.div_ceil(TASK_COLS), t % dims.n.div_ceil(TASK_COLS) * TASK_COLS);
            for j0 in (col0..dims.n.min(col0 + TASK_COLS)).step_by(COLS) {
                let cols = COLS.min(dims.n - j0);
                // Missing columns (and rows, below) repeat the last present one; their sums are dropped.
                let b_ptr: [*const u16; COLS] = std::array::from_fn(|r| {
                    let j = j0 + r.min(cols - 1);
                    b_bits[batch * self.b.batch_stride + j * self.b.col_stride..].as_ptr()
                });
                for i0 in (0..dims.m).step_by(ROWS) {
                    let rows = ROWS.min(dims.m - i0);
                    let a_ptr: [*const u16; ROWS] = std::array::from_fn(|s| {
                        let i = i0 + s.min(rows - 1);
                        a_bits[batch * a_batch + i * a_row..].as_ptr()
                    });
                    // SAFETY: every row of A and column of B holds `k` values from its start (checked by
                    // `layout::check_operands`, k contiguous as `applies` requires).
                    let sums = unsafe { kernel.sums(dims.k, &a_ptr, &b_ptr) };
                    for (s, row) in sums.iter().enumerate().take(rows) {
                        for (r, &sum) in row.iter().enumerate().take(cols) {
                            self.write(batch, i0 + s, j0 + r, sum);
                        }
                    }
                }
            }
        };
        if parallel {
            (0..tasks).into_par_iter().for_each(task);
        } else {
            (0..tasks).for_each(task);
        }
        ROUNDED_A.set(rounded);
    }

    /// C[batch, i, j] = start + `sum`, rounded once to C's type.
    pub(super) fn write(&self, batch: usize, i: usize, j: usize, sum: f32) {
        let at = batch * self.out.batch_stride + i * self.out.row_stride + j;
        // SAFETY: (batch, i, j) lies in C (layout::check), and only this task writes it.
        unsafe {
            let start = match self.start {
                Start::Zero => None,
                Start::Bias(bias) => Some(bias[j]),
                Start::Output => Some(match self.out.ptr {
                    Ptr::F32(c) => *c.add(at),
                    Ptr::F16(c) => (*c.add(at)).to_f32(),
                    Ptr::Bf16(c) => (*c.add(at)).to_f32(),
                }),
            };
            let value = start.map_or(sum, |s| s + sum);
            match self.out.ptr {
                Ptr::F32(c) => c.add(at).write(value),
                Ptr::F16(c) => c.add(at).write(f16::from_f32(value)),
                Ptr::Bf16(c) => c.add(at).write(bf16::from_f32(value)),
            }
        }
    }
}

/// A's rows rounded to bf16 bits into `out` (grown as needed, never shrunk), dense (`[batch][m][k]`).
fn round_rows<'o, S: Source>(a: &[S], job: &Job<'_>, out: &'o mut Vec<u16>) -> &'o [u16] {
    let (dims, op) = (job.dims, &job.a);
    let len = dims.batch * dims.m * dims.k;
    if out.len() < len {
        out.resize(len, 0);
    }
    for (r, dst) in out[..len].chunks_exact_mut(dims.k).enumerate() {
        let (batch, i) = (r / dims.m, r % dims.m);
        let row = &a[batch * op.batch_stride + i * op.row_stride..][..dims.k];
        for (d, x) in dst.iter_mut().zip(row) {
            *d = x.bf16_bits();
        }
    }
    &out[..len]
}

fn bf16_bits(s: &[bf16]) -> &[u16] {
    // SAFETY: bf16 is a transparent u16.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), s.len()) }
}
