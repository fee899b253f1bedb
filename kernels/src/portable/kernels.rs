//! Portable elementwise and reduction kernels over one piece (one leaf of [`crate::par`]).
//!
//! Same results as the AVX2 kernels in `crate::simd::kernels`, bit for bit: the same f32 operations in
//! the same order per element, and the same lane layout for sums.

use super::{reduce_lanes, Elem, BLOCK, LANES};

/// `x *= s` in f32, stored in `T`; returns whether a stored value is infinite or NaN.
pub(crate) fn unscale<T: Elem>(x: &mut [T], s: f32) -> bool {
    let mut buf = [0f32; BLOCK];
    let mut bad = false;
    for block in x.chunks_mut(BLOCK) {
        T::update(block, &mut buf, |v| v.iter_mut().for_each(|e| *e *= s));
        bad |= T::any_nonfinite(block);
    }
    bad
}

/// Clamps `x` to `[lo, hi]` in f32, stored in `T`. NaN stays NaN.
pub(crate) fn clamp<T: Elem>(x: &mut [T], lo: f32, hi: f32) {
    let mut buf = [0f32; BLOCK];
    for block in x.chunks_mut(BLOCK) {
        T::update(block, &mut buf, |v| v.iter_mut().for_each(|e| *e = clamp1(*e, lo, hi)));
    }
}

/// One element of [`clamp`], in the order the vector code uses.
#[inline(always)]
pub(crate) fn clamp1(v: f32, lo: f32, hi: f32) -> f32 {
    let t = if v < lo { lo } else { v };
    if t > hi {
        hi
    } else {
        t
    }
}

/// `dst = src` widened to f32 (exact).
pub(crate) fn widen<T: Elem>(src: &[T], dst: &mut [f32]) {
    T::widen(src, dst);
}

/// `dst = src` narrowed to `T`.
pub(crate) fn narrow<T: Elem>(src: &[f32], dst: &mut [T]) {
    T::narrow(src, dst);
}

/// Whether any element is infinite or NaN.
pub(crate) fn any_nonfinite<T: Elem>(x: &[T]) -> bool {
    T::any_nonfinite(x)
}

/// Adds the squares of `v` (in f64) to `lanes`, element `j` into lane `j % LANES`; `v.len()` must be a
/// multiple of [`LANES`] except for the last call on a piece.
#[inline(always)]
pub(crate) fn add_squares(lanes: &mut [f64; LANES], v: &[f32]) {
    let mut chunks = v.chunks_exact(LANES);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l += f64::from(x) * f64::from(x);
        }
    }
    for (l, &x) in lanes.iter_mut().zip(chunks.remainder()) {
        *l += f64::from(x) * f64::from(x);
    }
}

/// Sum of squares in f64, element `j` into lane `j % 16`, lanes reduced by [`reduce_lanes`].
pub(crate) fn sum_squares<T: Elem>(x: &[T]) -> f64 {
    let mut buf = [0f32; BLOCK];
    let mut lanes = [0f64; LANES];
    for block in x.chunks(BLOCK) {
        T::read(block, &mut buf, |v| add_squares(&mut lanes, v));
    }
    reduce_lanes(&lanes)
}
