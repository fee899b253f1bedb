//! x86-64 AVX2 + FMA + F16C building blocks shared by the vectorised kernels.
//!
//! Every `unsafe fn` here requires the caller to run on a CPU with AVX2, FMA and F16C (checked once per
//! call by [`crate::Isa`]) and pointers valid for 8 elements. Helpers are `#[inline(always)]` without
//! target features so they inline into the `#[target_feature]` kernels, which is where the intrinsics end
//! up compiled.
//!
//! Intrinsics are imported by name: a glob import of `std::arch::x86_64` would shadow `half::bf16`.

pub(crate) mod kernels;
pub(crate) mod lamb;
pub(crate) mod optim;
pub(crate) mod stochastic;

use std::arch::x86_64::{
    __m128i, __m256, __m256d, _mm256_add_epi32, _mm256_add_pd, _mm256_and_ps, _mm256_and_si256,
    _mm256_blendv_epi8, _mm256_castps256_ps128, _mm256_castps_si256, _mm256_castsi256_ps,
    _mm256_castsi256_si128, _mm256_cmp_ps, _mm256_cmpgt_epi32, _mm256_cvtepu16_epi32, _mm256_cvtph_ps,
    _mm256_cvtps_pd, _mm256_cvtps_ph, _mm256_extractf128_ps, _mm256_extracti128_si256, _mm256_loadu_ps,
    _mm256_mul_pd, _mm256_or_si256, _mm256_set1_epi32, _mm256_set1_ps, _mm256_slli_epi32, _mm256_srli_epi32,
    _mm256_storeu_ps, _mm_loadu_si128, _mm_packus_epi32, _mm_storeu_si128, _CMP_NLT_UQ,
    _MM_FROUND_TO_NEAREST_INT,
};

use std::ptr::null_mut;

use half::{bf16, f16};

/// Elements per 256-bit f32 vector.
pub(crate) const W: usize = 8;

/// An element type the vectorised kernels read and write, 8 at a time through f32 lanes.
pub(crate) trait Elem: Copy + Default + Send + Sync {
    /// Loads 8 elements widened to f32 (exact; as `half`'s `to_f32`, a signalling NaN becomes quiet).
    ///
    /// # Safety
    /// AVX2/FMA/F16C available; `p` valid for reading 8 elements.
    unsafe fn load8(p: *const Self) -> __m256;

    /// Narrows 8 f32 lanes to this type (round to nearest even, NaN stays NaN, as `half`'s `from_f32`)
    /// and stores them.
    ///
    /// # Safety
    /// AVX2/FMA/F16C available; `p` valid for writing 8 elements.
    unsafe fn store8(p: *mut Self, v: __m256);

    /// The smallest f32 magnitude that [`Elem::store8`] turns into an infinity: `|v| >= OVERFLOW` or a
    /// NaN `v` is exactly the set of lanes stored as non-finite. f32: infinity itself; f16: 65520, the
    /// tie between 65504 (odd last bit) and infinity; bf16: `0x7F7F_8000`, likewise.
    const OVERFLOW: f32;
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: caller guarantees AVX and 8 readable floats.
        unsafe { _mm256_loadu_ps(p) }
    }

    #[inline(always)]
    unsafe fn store8(p: *mut f32, v: __m256) {
        // SAFETY: caller guarantees AVX and 8 writable floats.
        unsafe { _mm256_storeu_ps(p, v) }
    }

    const OVERFLOW: f32 = f32::INFINITY;
}

impl Elem for f16 {
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> __m256 {
        // SAFETY: caller guarantees F16C and 16 readable bytes.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>())) }
    }

    #[inline(always)]
    unsafe fn store8(p: *mut f16, v: __m256) {
        // SAFETY: caller guarantees F16C and 16 writable bytes.
        unsafe { _mm_storeu_si128(p.cast::<__m128i>(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)) }
    }

    const OVERFLOW: f32 = 65520.0;
}

impl Elem for bf16 {
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> __m256 {
        // SAFETY: caller guarantees AVX2 and 16 readable bytes.
        unsafe {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast::<__m128i>()));
            let bits = _mm256_slli_epi32::<16>(wide);
            // As `half`: a NaN gets the quiet bit (a signalling bf16 NaN widens to a quiet f32 NaN).
            let abs = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFF_FFFF));
            let is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7F80_0000));
            let quiet = _mm256_and_si256(is_nan, _mm256_set1_epi32(0x0040_0000));
            _mm256_castsi256_ps(_mm256_or_si256(bits, quiet))
        }
    }

    #[inline(always)]
    unsafe fn store8(p: *mut bf16, v: __m256) {
        // SAFETY: caller guarantees AVX2 and 16 writable bytes.
        unsafe { _mm_storeu_si128(p.cast::<__m128i>(), bf16_from_f32x8(v)) }
    }

    const OVERFLOW: f32 = f32::from_bits(0x7F7F_8000);
}

/// Lanes (all ones) whose value `T::store8` stores as infinite or NaN: `|v| >= T::OVERFLOW` or NaN.
#[inline(always)]
pub(crate) unsafe fn stores_nonfinite<T: Elem>(v: __m256) -> __m256 {
    // SAFETY: caller guarantees AVX.
    unsafe {
        let abs = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF)));
        _mm256_cmp_ps::<_CMP_NLT_UQ>(abs, _mm256_set1_ps(T::OVERFLOW))
    }
}

/// f32 -> bf16 for 8 lanes with `half::bf16::from_f32` semantics: round to nearest, ties to even; a NaN
/// keeps its sign and top mantissa bits and gets the quiet bit (0x0040) set.
#[inline(always)]
unsafe fn bf16_from_f32x8(v: __m256) -> __m128i {
    // SAFETY: caller guarantees AVX2.
    unsafe {
        let bits = _mm256_castps_si256(v);
        let top = _mm256_srli_epi32::<16>(bits);
        // Ties to even: add 0x7FFF plus the lowest kept bit; the carry rounds up.
        let lsb = _mm256_and_si256(top, _mm256_set1_epi32(1));
        let bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb);
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(bits, bias));
        let quiet = _mm256_or_si256(top, _mm256_set1_epi32(0x0040));
        let abs = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFF_FFFF));
        let is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7F80_0000));
        let out = _mm256_blendv_epi8(rounded, quiet, is_nan);
        // Lanes hold 0..=0xFFFF, so the unsigned-saturating pack is exact.
        _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256::<1>(out))
    }
}

/// Adds the squares of 8 f32 lanes, exactly widened to f64, to accumulator lanes 0..4 and 4..8.
///
/// The product of two widened f32 is exact in f64, so this equals the portable `acc += x as f64 * x as
/// f64` bit for bit.
#[inline(always)]
pub(crate) unsafe fn add_squares(acc: &mut [__m256d; 2], x: __m256) {
    // SAFETY: caller guarantees AVX.
    unsafe {
        let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
        let hi = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x));
        acc[0] = _mm256_add_pd(acc[0], _mm256_mul_pd(lo, lo));
        acc[1] = _mm256_add_pd(acc[1], _mm256_mul_pd(hi, hi));
    }
}

// Tails and optional arrays of the optimizer kernels.

/// A zero-padded copy of a tail shorter than 8.
#[inline(always)]
pub(crate) fn pad<T: Copy + Default>(src: &[T]) -> [T; W] {
    let mut b = [T::default(); W];
    b[..src.len()].copy_from_slice(src);
    b
}

/// Pointer to an optional padded buffer, null when absent.
#[inline(always)]
pub(crate) fn opt_ptr<T>(b: &mut Option<[T; W]>) -> *mut T {
    b.as_mut().map_or(null_mut(), |b| b.as_mut_ptr())
}

/// `p + i` for an optional array: null stays null.
#[inline(always)]
pub(crate) fn offset<T>(p: *mut T, i: usize) -> *mut T {
    if p.is_null() {
        p
    } else {
        p.wrapping_add(i)
    }
}

/// Copies an optional padded buffer back to an optional tail.
#[inline(always)]
pub(crate) fn unpad<T: Copy>(dst: Option<&mut [T]>, b: Option<[T; W]>) {
    if let (Some(d), Some(b)) = (dst, b) {
        d.copy_from_slice(&b[..d.len()]);
    }
}
