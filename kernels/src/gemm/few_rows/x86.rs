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

/// The tile's pointers as arrays, and its last `k % 16` values copied, zero-padded, to whole chunks.
struct Operands<E, const R: usize, const C: usize> {
    a: [*const f32; R],
    b: [*const E; C],
    a_tail: [[f32; LANES]; R],
    b_tail: [[E; LANES]; C],
}

impl<E: Element, const R: usize, const C: usize> Operands<E, R, C> {
    /// # Safety
    /// `a` holds `R` pointers and `b` `C`, each valid for reading `k` values.
    #[inline(always)]
    unsafe fn new(k: usize, a: &[*const f32], b: &[*const E]) -> Self {
        let (full, tail) = (k / LANES * LANES, k % LANES);
        let a: [*const f32; R] = std::array::from_fn(|r| a[r]);
        let b: [*const E; C] = std::array::from_fn(|c| b[c]);
        let mut a_tail = [[0.0; LANES]; R];
        let mut b_tail = [[E::default(); LANES]; C];
        // SAFETY: the values from `full` to `k` lie in each row and column.
        unsafe {
            for (dst, &p) in a_tail.iter_mut().zip(&a) {
                dst[..tail].copy_from_slice(std::slice::from_raw_parts(p.add(full), tail));
            }
            for (dst, &p) in b_tail.iter_mut().zip(&b) {
                dst[..tail].copy_from_slice(std::slice::from_raw_parts(p.add(full), tail));
            }
        }
        Operands { a, b, a_tail, b_tail }
    }
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
    // SAFETY (whole body): AVX-512 runs here; each chunk reads 16 values at `at < k - 15` of every row
    // and column, or of the zero-padded tails.
    unsafe {
        let ops = Operands::<E, R, C>::new(k, a, b);
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let chunk = |acc: &mut [[__m512; C]; R], a: [*const f32; R], b: [*const E; C]| {
            let bv: [__m512; C] = std::array::from_fn(|c| load_zmm(b[c]));
            for (row, &pa) in acc.iter_mut().zip(&a) {
                let av = _mm512_loadu_ps(pa);
                for (x, &bc) in row.iter_mut().zip(&bv) {
                    *x = _mm512_fmadd_ps(av, bc, *x);
                }
            }
        };
        for at in (0..k / LANES * LANES).step_by(LANES) {
            chunk(&mut acc, ops.a.map(|p| p.add(at)), ops.b.map(|p| p.add(at)));
        }
        if !k.is_multiple_of(LANES) {
            let a_tail: [*const f32; R] = std::array::from_fn(|r| ops.a_tail[r].as_ptr());
            let b_tail: [*const E; C] = std::array::from_fn(|c| ops.b_tail[c].as_ptr());
            chunk(&mut acc, a_tail, b_tail);
        }
        let mut sums = [0.0; 24];
        for (r, row) in acc.iter().enumerate() {
            for (c, &v) in row.iter().enumerate() {
                sums[r * C + c] = reduce_zmm(v);
            }
        }
        sums
    }
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
    // SAFETY (whole body): AVX2, FMA and F16C run here; each half chunk reads 8 values at
    // `at + 8 * h < k - 7` of every row and column, or of the zero-padded tails.
    unsafe {
        let ops = Operands::<E, R, C>::new(k, a, b);
        let mut acc = [[[_mm256_setzero_ps(); 2]; C]; R];
        let chunk = |acc: &mut [[[__m256; 2]; C]; R], a: [*const f32; R], b: [*const E; C]| {
            for h in 0..2 {
                let bv: [__m256; C] = std::array::from_fn(|c| load_ymm(b[c].add(8 * h)));
                for (row, &pa) in acc.iter_mut().zip(&a) {
                    let av = _mm256_loadu_ps(pa.add(8 * h));
                    for (x, &bc) in row.iter_mut().zip(&bv) {
                        x[h] = _mm256_fmadd_ps(av, bc, x[h]);
                    }
                }
            }
        };
        for at in (0..k / LANES * LANES).step_by(LANES) {
            chunk(&mut acc, ops.a.map(|p| p.add(at)), ops.b.map(|p| p.add(at)));
        }
        if !k.is_multiple_of(LANES) {
            let a_tail: [*const f32; R] = std::array::from_fn(|r| ops.a_tail[r].as_ptr());
            let b_tail: [*const E; C] = std::array::from_fn(|c| ops.b_tail[c].as_ptr());
            chunk(&mut acc, a_tail, b_tail);
        }
        let mut sums = [0.0; 24];
        for (r, row) in acc.iter().enumerate() {
            for (c, &[lo, hi]) in row.iter().enumerate() {
                sums[r * C + c] = reduce_ymm_pair(lo, hi);
            }
        }
        sums
    }
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
