//! The x86-64 kernels of [`super`]: 16 lanes in one zmm register (AVX-512) or in two ymm (AVX2), each
//! tile's accumulators in registers.

use std::arch::x86_64::{
    __m256, __m512, _mm256_add_ps, _mm256_castps256_ps128, _mm256_castsi256_ps, _mm256_cvtepu16_epi32,
    _mm256_cvtph_ps, _mm256_extractf128_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_loadu_si256,
    _mm256_setzero_ps, _mm256_slli_epi32, _mm512_castsi512_ps, _mm512_cvtepu16_epi32, _mm512_cvtph_ps,
    _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_setzero_ps, _mm512_slli_epi32, _mm_add_ps, _mm_add_ss,
    _mm_cvtss_f32, _mm_loadu_si128, _mm_movehl_ps, _mm_shuffle_ps,
};

use super::{Element, Kind, RowFma, Shape, Sums, LANES};
use crate::gemm::skinny::reduce_zmm;
use crate::Isa;

/// f32 FMA on zmm registers. Constructible only where AVX-512 runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowFmaAvx512(());

/// f32 FMA on ymm registers. Constructible only where AVX2, FMA and F16C run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowFmaAvx2(());

impl RowFmaAvx512 {
    pub(crate) fn new() -> Option<Self> {
        Isa::Avx512.is_supported().then_some(RowFmaAvx512(()))
    }
}

impl RowFmaAvx2 {
    pub(crate) fn new() -> Option<Self> {
        Isa::Avx2.is_supported().then_some(RowFmaAvx2(()))
    }
}

/// `$shape => $kernel::<E, rows, cols>(...)` for each tile shape, from the rows left.
macro_rules! tiles {
    ($kernel:ident, $shape:expr, $k:expr, $a:expr, $b:expr, [$(($rows:literal, $cols:literal)),*]) => {
        match ($shape.rows, $shape.cols) {
            // SAFETY: the CPU runs the kernel's instructions (its constructor checked); pointers as
            // `tile`'s caller guarantees.
            $(($rows, $cols) => unsafe { $kernel::<E, $rows, $cols>($k, $a, $b) },)*
            shape => unreachable!("{shape:?} is no tile of this kernel"),
        }
    };
}

impl RowFma for RowFmaAvx512 {
    /// 24 accumulators, the B vectors of a chunk and an A vector: 25-31 of the 32 registers. More than
    /// 8 rows go in tiles of 6: a 12 x 2 tile (more row pointers than the CPU has general registers)
    /// ran at 0.4-0.7x the packed path's speed.
    fn shape(self, left: usize) -> Shape {
        let (rows, cols) = match left {
            1 => (1, 8),
            2 => (2, 8),
            3 => (3, 6),
            4 => (4, 6),
            5 | 6 => (6, 4),
            7 | 8 => (8, 3),
            _ => (6, 4),
        };
        Shape { rows, cols }
    }

    unsafe fn tile<E: Element>(self, shape: Shape, k: usize, a: &[*const f32], b: &[*const E]) -> Sums {
        tiles!(tile_zmm, shape, k, a, b, [(1, 8), (2, 8), (3, 6), (4, 6), (6, 4), (8, 3)])
    }
}

impl RowFma for RowFmaAvx2 {
    /// Two ymm per accumulator, the B vectors of a half chunk and an A vector: 13-16 of the 16 registers.
    /// Two rows by three columns wherever more than three rows are left: tiles of one column (4 x 1,
    /// 6 x 1) read A again from the caches for every column of B, and ran at 0.6-0.9x the packed
    /// path's speed at 6-12 rows.
    fn shape(self, left: usize) -> Shape {
        let (rows, cols) = match left {
            1 => (1, 4),
            3 => (3, 2),
            _ => (2, 3),
        };
        Shape { rows, cols }
    }

    unsafe fn tile<E: Element>(self, shape: Shape, k: usize, a: &[*const f32], b: &[*const E]) -> Sums {
        tiles!(tile_ymm, shape, k, a, b, [(1, 4), (2, 3), (3, 2)])
    }
}

/// A tile's sums: `chunk` on each whole chunk of 16 `k` (the rows' and columns' pointers at it), then on
/// the last `k % 16` values copied to zero-padded chunks; then `sums[r * C + c] = reduce(acc[r][c])`.
/// `Acc` holds 16 lanes (a zmm register, or two ymm).
///
/// # Safety
/// `a` holds `R` pointers and `b` `C`, each valid for reading `k` values; `chunk` reads 16 values from
/// each pointer it is given; the CPU runs the instructions of `chunk` and `reduce` (inlined into the
/// caller, whose features they take).
#[inline(always)]
unsafe fn sum_tile<E: Element, Acc: Copy, const R: usize, const C: usize>(
    (k, a, b): (usize, &[*const f32], &[*const E]),
    zero: Acc,
    mut chunk: impl FnMut(&mut [[Acc; C]; R], [*const f32; R], [*const E; C]),
    reduce: impl Fn(Acc) -> f32,
) -> Sums {
    let (full, tail) = (k / LANES * LANES, k % LANES);
    let a: [*const f32; R] = std::array::from_fn(|r| a[r]);
    let b: [*const E; C] = std::array::from_fn(|c| b[c]);
    let mut acc = [[zero; C]; R];
    // SAFETY (whole body): each whole chunk lies below `k` in every row and column, as do the values
    // from `full` to `k` copied into the tails.
    unsafe {
        for at in (0..full).step_by(LANES) {
            chunk(&mut acc, a.map(|p| p.add(at)), b.map(|p| p.add(at)));
        }
        if tail > 0 {
            let mut a_tail = [[0.0; LANES]; R];
            let mut b_tail = [[E::default(); LANES]; C];
            for (dst, &p) in a_tail.iter_mut().zip(&a) {
                dst[..tail].copy_from_slice(std::slice::from_raw_parts(p.add(full), tail));
            }
            for (dst, &p) in b_tail.iter_mut().zip(&b) {
                dst[..tail].copy_from_slice(std::slice::from_raw_parts(p.add(full), tail));
            }
            chunk(&mut acc, a_tail.each_ref().map(|t| t.as_ptr()), b_tail.each_ref().map(|t| t.as_ptr()));
        }
    }
    let mut sums = [0.0; 24];
    for (r, row) in acc.iter().enumerate() {
        for (c, &v) in row.iter().enumerate() {
            sums[r * C + c] = reduce(v);
        }
    }
    sums
}

/// `R x C` accumulators of 16 lanes in zmm registers.
///
/// # Safety
/// AVX-512; pointers as [`RowFma::tile`]'s caller guarantees.
#[target_feature(enable = "avx512f")]
unsafe fn tile_zmm<E: Element, const R: usize, const C: usize>(
    k: usize,
    a: &[*const f32],
    b: &[*const E],
) -> Sums {
    let chunk = |acc: &mut [[__m512; C]; R], a: [*const f32; R], b: [*const E; C]| {
        // SAFETY: AVX-512 runs here; 16 values at each pointer (`sum_tile`).
        unsafe {
            let bv: [__m512; C] = std::array::from_fn(|c| load_zmm(b[c]));
            for (row, &pa) in acc.iter_mut().zip(&a) {
                let av = _mm512_loadu_ps(pa);
                for (x, &bc) in row.iter_mut().zip(&bv) {
                    *x = _mm512_fmadd_ps(av, bc, *x);
                }
            }
        }
    };
    // SAFETY: AVX-512 runs here (the zero, the chunk, the reduction); pointers as the caller guarantees.
    unsafe { sum_tile((k, a, b), _mm512_setzero_ps(), chunk, |v| reduce_zmm(v)) }
}

/// 16 values at `p` widened to f32.
///
/// # Safety
/// AVX-512 (inlined into [`tile_zmm`]); `p` readable for 16 values.
#[inline(always)]
unsafe fn load_zmm<E: Element>(p: *const E) -> __m512 {
    // SAFETY: as the caller guarantees.
    unsafe {
        match E::KIND {
            Kind::F32 => _mm512_loadu_ps(p.cast()),
            Kind::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p.cast()),
            ))),
            Kind::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
        }
    }
}

/// `R x C` accumulators of 16 lanes, each two ymm registers (lanes 0-7, 8-15).
///
/// # Safety
/// AVX2, FMA and F16C; pointers as [`RowFma::tile`]'s caller guarantees.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_ymm<E: Element, const R: usize, const C: usize>(
    k: usize,
    a: &[*const f32],
    b: &[*const E],
) -> Sums {
    let chunk = |acc: &mut [[[__m256; 2]; C]; R], a: [*const f32; R], b: [*const E; C]| {
        // SAFETY: AVX2, FMA and F16C run here; each half reads 8 of the 16 values at each pointer.
        unsafe {
            for h in 0..2 {
                let bv: [__m256; C] = std::array::from_fn(|c| load_ymm(b[c].add(8 * h)));
                for (row, &pa) in acc.iter_mut().zip(&a) {
                    let av = _mm256_loadu_ps(pa.add(8 * h));
                    for (x, &bc) in row.iter_mut().zip(&bv) {
                        x[h] = _mm256_fmadd_ps(av, bc, x[h]);
                    }
                }
            }
        }
    };
    let zero = [_mm256_setzero_ps(); 2];
    // SAFETY: AVX2 runs here (the chunk, the reduction); pointers as the caller guarantees.
    unsafe { sum_tile((k, a, b), zero, chunk, |[lo, hi]| reduce_ymm_pair(lo, hi)) }
}

/// 8 values at `p` widened to f32.
///
/// # Safety
/// AVX2 and F16C (inlined into [`tile_ymm`]); `p` readable for 8 values.
#[inline(always)]
unsafe fn load_ymm<E: Element>(p: *const E) -> __m256 {
    // SAFETY: as the caller guarantees.
    unsafe {
        match E::KIND {
            Kind::F32 => _mm256_loadu_ps(p.cast()),
            Kind::Bf16 => {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()))))
            }
            Kind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
        }
    }
}

/// Lanes `lo` (0-7) and `hi` (8-15) added pairwise as [`super::pairwise`] adds them: `l` and `l + 8`,
/// then `+ 4`, `+ 2`, `+ 1`.
///
/// # Safety
/// AVX (inlined into [`tile_ymm`]).
#[inline(always)]
unsafe fn reduce_ymm_pair(lo: __m256, hi: __m256) -> f32 {
    // SAFETY: as the caller guarantees.
    unsafe {
        let v = _mm256_add_ps(lo, hi);
        let v = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        let v = _mm_add_ss(v, _mm_shuffle_ps::<0b01>(v, v));
        _mm_cvtss_f32(v)
    }
}
