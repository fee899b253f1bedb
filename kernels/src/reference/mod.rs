//! Scalar reference implementations: the oracles the tests compare the kernels against.
//!
//! One element at a time, in list order, with `half`'s scalar conversions (`f16::from_f32`,
//! `bf16::from_f32`, `to_f32`). The f32 arithmetic follows the formulas documented on each kernel, one
//! rounding per operation in the stated order, so elementwise kernels must match these **bit for bit**
//! (NaN payloads aside: IEEE leaves the payload of an operation on two NaNs unspecified).
//!
//! Sums are plain sequential f64 sums, so a kernel's norm (summed in lanes and a tree) may differ from
//! these by rounding of the f64 sum: at most ~n·2⁻⁵³ relative, i.e. at most 1 ulp after rounding to f32.
//!
//! These are slow by design. They are public so that downstream tests can use them too.

mod gemm;
mod optim;

pub use gemm::{gemm, GemmReference};
pub use optim::{
    adam_step, adam_step_bf16_state, adam_step_f64, lamb_step, lamb_step_bf16_state, sgd_step,
    sgd_step_bf16_state,
};

use half::{bf16, f16};

use crate::{GradSlice, GradSliceMut, HalfSliceMut};

/// Element `i` as f32 (exact).
#[must_use]
pub fn get(x: GradSlice<'_>, i: usize) -> f32 {
    match x {
        GradSlice::F32(s) => s[i],
        GradSlice::F16(s) => s[i].to_f32(),
        GradSlice::Bf16(s) => s[i].to_f32(),
    }
}

/// Stores `value` at `i`, rounded to the slice's dtype; returns the stored value as f32.
pub fn set(x: &mut GradSliceMut<'_>, i: usize, value: f32) -> f32 {
    match x {
        GradSliceMut::F32(s) => {
            s[i] = value;
            value
        }
        GradSliceMut::F16(s) => {
            s[i] = f16::from_f32(value);
            s[i].to_f32()
        }
        GradSliceMut::Bf16(s) => {
            s[i] = bf16::from_f32(value);
            s[i].to_f32()
        }
    }
}

/// Stores `value` at `i` of a half working copy, rounded.
pub fn set_half(x: &mut HalfSliceMut<'_>, i: usize, value: f32) {
    match x {
        HalfSliceMut::F16(s) => s[i] = f16::from_f32(value),
        HalfSliceMut::Bf16(s) => s[i] = bf16::from_f32(value),
    }
}

/// Reference [`crate::unscale::unscale_and_check`]: `x = x * inv_scale` per element; the first tensor
/// with a stored value that is not finite.
pub fn unscale_and_check(grads: &mut [GradSliceMut<'_>], inv_scale: f32) -> Option<usize> {
    let mut first = None;
    for (t, g) in grads.iter_mut().enumerate() {
        for i in 0..g.len() {
            let y = get(g.as_slice(), i) * inv_scale;
            if !set(g, i, y).is_finite() && first.is_none() {
                first = Some(t);
            }
        }
    }
    first
}

/// Reference [`crate::unscale::find_non_finite`].
#[must_use]
pub fn find_non_finite(grads: &[GradSlice<'_>]) -> Option<usize> {
    grads.iter().position(|&g| (0..g.len()).any(|i| !get(g, i).is_finite()))
}

/// Sequential f64 sum of squares of one tensor.
#[must_use]
pub fn sum_squares(x: GradSlice<'_>) -> f64 {
    // A fold from +0.0: `Iterator::sum` of floats starts at -0.0.
    (0..x.len()).fold(0.0, |acc, i| acc + f64::from(get(x, i)).powi(2))
}

/// Reference [`crate::norm::l2_norms`]: per-tensor norms and the global norm, times `|inv_scale|`.
pub fn l2_norms(grads: &[GradSlice<'_>], inv_scale: f32, per_tensor: &mut [f32]) -> f32 {
    let s = f64::from(inv_scale.abs());
    let mut total = 0.0;
    for (g, out) in grads.iter().zip(per_tensor) {
        let sum = sum_squares(*g);
        *out = (sum.sqrt() * s) as f32;
        total += sum;
    }
    (total.sqrt() * s) as f32
}

/// Reference [`crate::clip::clip_by_value`]: `max(x, -c)` then `min(_, c)`, NaN kept.
pub fn clip_by_value(grads: &mut [GradSliceMut<'_>], clip_value: f32) {
    for g in grads {
        for i in 0..g.len() {
            let x = get(g.as_slice(), i);
            let y = if x < -clip_value {
                -clip_value
            } else if x > clip_value {
                clip_value
            } else {
                x
            };
            set(g, i, y);
        }
    }
}

/// Reference [`crate::convert::widen`].
pub fn widen(src: GradSlice<'_>, dst: &mut [f32]) {
    for (i, d) in dst.iter_mut().enumerate() {
        *d = get(src, i);
    }
}

/// Reference [`crate::convert::narrow`].
pub fn narrow(src: &[f32], mut dst: HalfSliceMut<'_>) {
    for (i, &s) in src.iter().enumerate() {
        set_half(&mut dst, i, s);
    }
}
