//! SiLU (swish), the activation of Llama's and Mistral's SwiGLU blocks, forward and backward over f32,
//! f16 or bf16 elements, computed in f32 and rounded once to the output's dtype:
//!
//! `silu(x) = x s`, `silu'(x) = s + x s (1 - s)`, with `s = sigmoid(x) = 1 / (1 + e^-x)`.
//!
//! Both `s` and `1 - s` come from `e = e^-|x|` without a subtraction (for `x >= 0`, `s = 1 / (1 + e)`
//! and `1 - s = e / (1 + e)`; the other way round below 0), so the slope keeps its accuracy where `s`
//! is near 1 and `1 - s` would cancel. Past `|x| = 87.3` the exponential is 0: the value is `x` or
//! `-0`, the slope 1 or 0 (an infinite `x` does not meet a zero in the slope; the value at `-inf` is
//! NaN, as `x / (1 + e^-x)` is there in PyTorch and candle). Run by the elementwise driver
//! (`activation.rs`).

use crate::activation::Activation;
use crate::exp::exp_nonpositive_with;
use crate::mul_add::MulAdd;
use crate::{GradSlice, GradSliceMut};

/// Where `e^-|x|` is 0 in f32 ([`crate::exp`]'s underflow), and the slope's `x` term with it.
const SATURATED: f32 = 88.0;

/// `silu(x)` and `silu'(x)` in f32 (within a few ulps of `max(1, |x|)` of the exact function), as the
/// kernels compute them on this CPU.
///
/// ```
/// let (value, slope) = amp_kernels::silu::value_and_slope(2.0);
/// assert!((value - 1.761_594).abs() < 1e-6 && (slope - 1.090_784).abs() < 1e-6);
/// ```
#[must_use]
pub fn value_and_slope(x: f32) -> (f32, f32) {
    crate::activation::value_and_slope::<Silu>(x)
}

#[inline(always)]
fn value_and_slope_with<A: MulAdd>(x: f32) -> (f32, f32) {
    let e = exp_nonpositive_with::<A>(-x.abs());
    let r = 1.0 / (1.0 + e);
    let (s, one_less_s) = if x >= 0.0 { (r, e * r) } else { (e * r, r) };
    let clamped = x.clamp(-SATURATED, SATURATED);
    (x * s, A::mul_add(clamped * s, one_less_s, s))
}

/// `y = silu(x)`, computed in f32 and rounded once to `y`'s dtype, which may differ from `x`'s.
///
/// # Panics
/// If the lengths differ.
pub fn forward(x: GradSlice<'_>, y: GradSliceMut<'_>) {
    crate::activation::forward::<Silu>(x, y);
}

/// `dx = dy * silu'(x)`, `dx` in `x`'s dtype, `dy` of any.
///
/// # Panics
/// If the lengths differ, or `dx`'s dtype is not `x`'s.
pub fn backward(x: GradSlice<'_>, dy: GradSlice<'_>, dx: GradSliceMut<'_>) {
    crate::activation::backward::<Silu>(x, dy, dx);
}

/// SiLU as the elementwise driver computes it.
struct Silu;

impl Activation for Silu {
    const NAME: &'static str = "silu";

    #[inline(always)]
    fn value_and_slope<A: MulAdd>(x: f32) -> (f32, f32) {
        value_and_slope_with::<A>(x)
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;
    use crate::activation::{gradients, values, BLOCK, CHUNK};
    use crate::mul_add::{Fused, Separate};

    fn exact(x: f64) -> (f64, f64) {
        let s = 1.0 / (1.0 + (-x).exp());
        (x * s, s + x * s * (1.0 - s))
    }

    /// Both arithmetics are within 8 ulps of `max(1, |x|)` of SiLU and its slope computed in f64, over
    /// [-100, 100] (past the exponential's underflow).
    #[test]
    fn value_and_slope_are_within_a_few_ulps_either_way() {
        let check = |name: &str, silu: fn(f32) -> (f32, f32)| {
            for i in -200_000..=200_000 {
                let x = i as f32 / 2_000.0;
                let ((value, slope), (want_value, want_slope)) = (silu(x), exact(f64::from(x)));
                let bound = 8.0 * f64::from(f32::EPSILON) * f64::from(x.abs()).max(1.0);
                assert!((f64::from(value) - want_value).abs() <= bound, "{name}: silu({x}) = {value}");
                assert!((f64::from(slope) - want_slope).abs() <= bound, "{name}: silu'({x}) = {slope}");
            }
        };
        check("separate", value_and_slope_with::<Separate>);
        check("fused", value_and_slope_with::<Fused>);
    }

    /// Large and infinite inputs: the value `x` or `-0`, the slope 1 or 0, never NaN but at `-inf`'s
    /// value (`-inf * 0`, as `x / (1 + e^-x)` gives); NaN stays NaN.
    #[test]
    fn large_inputs_saturate_in_value_and_slope() {
        fn check<A: MulAdd>(name: &str) {
            for x in [88.0, 1e3, 1e30, f32::MAX, f32::INFINITY] {
                assert_eq!(value_and_slope_with::<A>(x), (x, 1.0), "{name}: {x}");
            }
            for x in [-88.0, -1e3, -1e30, -f32::MAX] {
                let (value, slope) = value_and_slope_with::<A>(x);
                assert_eq!((value.to_bits(), slope), ((-0.0f32).to_bits(), 0.0), "{name}: {x}");
            }
            let (value, slope) = value_and_slope_with::<A>(f32::NEG_INFINITY);
            assert!(value.is_nan() && slope == 0.0, "{name}: -inf");
            let (value, slope) = value_and_slope_with::<A>(f32::NAN);
            assert!(value.is_nan() && slope.is_nan(), "{name}: NaN");
        }
        check::<Separate>("separate");
        check::<Fused>("fused");
    }

    /// The loops of either arithmetic compute its scalar function's bits, and every element of a
    /// tensor, whatever its place in the chunks and blocks, is that function rounded once to the
    /// output's dtype (half inputs widened exactly).
    #[test]
    fn each_element_is_the_scalar_function_rounded_once() {
        fn loops<A: MulAdd>(name: &str) {
            let x: Vec<f32> = (0..BLOCK + 13).map(|i| ((i * 7919) % 4001) as f32 / 100.0 - 20.0).collect();
            let dy: Vec<f32> = (0..x.len()).map(|i| ((i * 104_729) % 211) as f32 / 100.0 - 1.0).collect();
            let (mut y, mut dx) = (vec![0f32; x.len()], vec![0f32; x.len()]);
            values::<Silu, A>(&x, &mut y);
            gradients::<Silu, A>(&x, &dy, &mut dx);
            for i in 0..x.len() {
                let (value, slope) = value_and_slope_with::<A>(x[i]);
                assert_eq!(
                    (y[i].to_bits(), dx[i].to_bits()),
                    (value.to_bits(), (dy[i] * slope).to_bits()),
                    "{name} [{i}]"
                );
            }
        }
        loops::<Separate>("separate");
        loops::<Fused>("fused");
        for n in [1, BLOCK + 1, CHUNK + 3, 3 * CHUNK + BLOCK + 7] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 4001) as f32 / 100.0 - 20.0).collect();
            let dy: Vec<f32> = (0..n).map(|i| ((i * 104_729) % 211) as f32 / 100.0 - 1.0).collect();
            let xh: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let dyh: Vec<f16> = dy.iter().map(|&v| f16::from_f32(v)).collect();
            let (mut yh, mut dxh, mut yf) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n], vec![f16::ZERO; n]);
            forward(GradSlice::Bf16(&xh), GradSliceMut::Bf16(&mut yh));
            backward(GradSlice::Bf16(&xh), GradSlice::F16(&dyh), GradSliceMut::Bf16(&mut dxh));
            forward(GradSlice::F32(&x), GradSliceMut::F16(&mut yf));
            for i in 0..n {
                let (value, slope) = value_and_slope(xh[i].to_f32());
                assert_eq!(yh[i], bf16::from_f32(value), "[{i}]");
                assert_eq!(dxh[i], bf16::from_f32(dyh[i].to_f32() * slope), "[{i}]");
                assert_eq!(yf[i], f16::from_f32(value_and_slope(x[i]).0), "[{i}]");
            }
        }
    }
}
