//! AVX2 elementwise and reduction kernels over one piece (one leaf of [`crate::par`]).
//!
//! Each function's contract: the CPU has AVX2, FMA and F16C. The main loop handles 8 (or 16) elements per
//! step; the tail goes through the same vector code on a zero-padded stack copy, so tails cannot differ
//! from the body. Padding lanes never reach results: their stores land in the stack copy, and for
//! reductions a zero adds nothing.

use std::arch::x86_64::{
    __m256d, __m256i, _mm256_and_si256, _mm256_blendv_ps, _mm256_cmp_ps, _mm256_cmpeq_epi16,
    _mm256_cmpeq_epi32, _mm256_loadu_si256, _mm256_movemask_ps, _mm256_mul_ps, _mm256_or_ps, _mm256_or_si256,
    _mm256_set1_epi16, _mm256_set1_epi32, _mm256_set1_ps, _mm256_setzero_pd, _mm256_setzero_ps,
    _mm256_setzero_si256, _mm256_storeu_pd, _mm256_testz_si256, _CMP_GT_OQ, _CMP_LT_OQ,
};

use super::{add_squares, stores_nonfinite, Elem, W};
use crate::portable::{reduce_lanes, LANES};

/// Runs `body` on every 8-element group of `x`, the tail through a zero-padded copy.
#[inline(always)]
unsafe fn for_each8<T: Elem>(x: &mut [T], mut body: impl FnMut(*mut T)) {
    let mut chunks = x.chunks_exact_mut(W);
    for c in &mut chunks {
        body(c.as_mut_ptr());
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        let mut buf = [T::default(); W];
        buf[..tail.len()].copy_from_slice(tail);
        body(buf.as_mut_ptr());
        tail.copy_from_slice(&buf[..tail.len()]);
    }
}

/// `x *= s` in f32, stored in `T`; returns whether a stored value is infinite or NaN.
///
/// # Safety
/// AVX2, FMA and F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn unscale<T: Elem>(x: &mut [T], s: f32) -> bool {
    let sv = _mm256_set1_ps(s);
    let mut bad = _mm256_setzero_ps();
    // SAFETY: every pointer `for_each8` passes is valid for 8 elements; features checked by caller.
    unsafe {
        for_each8(x, |p| {
            let y = _mm256_mul_ps(T::load8(p), sv);
            T::store8(p, y);
            bad = _mm256_or_ps(bad, stores_nonfinite::<T>(y));
        });
    }
    _mm256_movemask_ps(bad) != 0
}

/// Clamps `x` to `[lo, hi]` in f32, stored in `T`. NaN stays NaN.
///
/// # Safety
/// AVX2, FMA and F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn clamp<T: Elem>(x: &mut [T], lo: f32, hi: f32) {
    let (lov, hiv) = (_mm256_set1_ps(lo), _mm256_set1_ps(hi));
    // SAFETY: as in `unscale`.
    unsafe {
        for_each8(x, |p| {
            let v = T::load8(p);
            let v = _mm256_blendv_ps(v, lov, _mm256_cmp_ps::<_CMP_LT_OQ>(v, lov));
            let v = _mm256_blendv_ps(v, hiv, _mm256_cmp_ps::<_CMP_GT_OQ>(v, hiv));
            T::store8(p, v);
        });
    }
}

/// `dst = src` widened to f32 (exact). Lengths must be equal.
///
/// # Safety
/// AVX2, FMA and F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn widen<T: Elem>(src: &[T], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    let n = src.len() / W * W;
    for i in (0..n).step_by(W) {
        // SAFETY: i + 8 <= n <= len of both.
        unsafe { f32::store8(dst.as_mut_ptr().add(i), T::load8(src.as_ptr().add(i))) };
    }
    let mut buf = [T::default(); W];
    let mut out = [0f32; W];
    let r = src.len() - n;
    buf[..r].copy_from_slice(&src[n..]);
    // SAFETY: stack buffers of 8.
    unsafe { f32::store8(out.as_mut_ptr(), T::load8(buf.as_ptr())) };
    dst[n..].copy_from_slice(&out[..r]);
}

/// `dst = src` narrowed to `T` (`half`'s `from_f32` semantics). Lengths must be equal.
///
/// # Safety
/// AVX2, FMA and F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn narrow<T: Elem>(src: &[f32], dst: &mut [T]) {
    assert_eq!(src.len(), dst.len());
    let n = src.len() / W * W;
    for i in (0..n).step_by(W) {
        // SAFETY: i + 8 <= n <= the length of both.
        unsafe { T::store8(dst.as_mut_ptr().add(i), f32::load8(src.as_ptr().add(i))) };
    }
    let mut buf = [0f32; W];
    let mut out = [T::default(); W];
    let r = src.len() - n;
    buf[..r].copy_from_slice(&src[n..]);
    // SAFETY: stack buffers of 8.
    unsafe { T::store8(out.as_mut_ptr(), f32::load8(buf.as_ptr())) };
    dst[n..].copy_from_slice(&out[..r]);
}

/// Whether any element is infinite or NaN, from the raw bits: 32-bit lanes with exponent mask
/// `0x7F80_0000` (f32) or 16-bit lanes with `exp16` (0x7C00 for f16, 0x7F80 for bf16).
///
/// # Safety
/// AVX2 available. `bytes` is the memory of a slice of f32 (`exp16 == 0`) or of 16-bit halves.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn any_nonfinite_bits(bytes: &[u8], exp16: i16) -> bool {
    let (m, wide) =
        if exp16 == 0 { (_mm256_set1_epi32(0x7F80_0000), true) } else { (_mm256_set1_epi16(exp16), false) };
    let test = |v: __m256i| {
        let e = _mm256_and_si256(v, m);
        if wide {
            _mm256_cmpeq_epi32(e, m)
        } else {
            _mm256_cmpeq_epi16(e, m)
        }
    };
    let mut bad = _mm256_setzero_si256();
    let mut chunks = bytes.chunks_exact(32);
    for c in &mut chunks {
        // SAFETY: 32 readable bytes.
        bad = _mm256_or_si256(bad, test(unsafe { _mm256_loadu_si256(c.as_ptr().cast()) }));
    }
    let mut buf = [0u8; 32];
    let tail = chunks.remainder();
    buf[..tail.len()].copy_from_slice(tail);
    // SAFETY: 32-byte stack buffer; zero bits are a finite value.
    bad = _mm256_or_si256(bad, test(unsafe { _mm256_loadu_si256(buf.as_ptr().cast()) }));
    _mm256_testz_si256(bad, bad) == 0
}

/// Sum of squares in f64, element `j` into lane `j % 16`, lanes reduced by [`reduce_lanes`].
///
/// # Safety
/// AVX2, FMA and F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn sum_squares<T: Elem>(x: &[T]) -> f64 {
    let mut acc: [[__m256d; 2]; 2] = [[_mm256_setzero_pd(); 2]; 2];
    let mut chunks = x.chunks_exact(2 * W);
    for c in &mut chunks {
        let p = c.as_ptr();
        // SAFETY: 16 readable elements.
        unsafe {
            add_squares(&mut acc[0], T::load8(p));
            add_squares(&mut acc[1], T::load8(p.add(W)));
        }
    }
    let tail = chunks.remainder();
    let mut buf = [T::default(); 2 * W];
    buf[..tail.len()].copy_from_slice(tail);
    // SAFETY: 16-element stack buffer; zero padding adds +0.0.
    unsafe {
        add_squares(&mut acc[0], T::load8(buf.as_ptr()));
        add_squares(&mut acc[1], T::load8(buf.as_ptr().add(W)));
    }
    // SAFETY: features checked by the caller.
    unsafe { lanes_sum(&acc) }
}

/// Stores 16 f64 accumulator lanes in element order and reduces them.
#[inline(always)]
pub(crate) unsafe fn lanes_sum(acc: &[[__m256d; 2]; 2]) -> f64 {
    let mut lanes = [0f64; LANES];
    for (i, a) in acc.iter().flatten().enumerate() {
        // SAFETY: 4 writable f64 at 4 * i < 16.
        unsafe { _mm256_storeu_pd(lanes.as_mut_ptr().add(4 * i), *a) };
    }
    reduce_lanes(&lanes)
}
