//! GELU with the tanh approximation (GPT-2's and BERT's, candle's `Tensor::gelu`), forward and
//! backward over f32, f16 or bf16 elements, computed in f32 and rounded once to the output's dtype:
//!
//! `gelu(x) = 0.5 x (1 + tanh(u))`, `u = sqrt(2/pi) (x + 0.044715 x^3)`, and
//! `gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)` with `t = tanh(u)`.
//!
//! The elementwise driver (`activation/`) runs it: fixed chunks on the current rayon pool, blocks
//! widened to f32, computed by loops compiled for the widest vector extension the CPU has (`tanh` from
//! [`crate::exp::exp_nonpositive`], no library call), and narrowed. The multiply-adds are fused where
//! the CPU has FMA (`mul_add.rs`: the forward takes about a quarter less time, the backward a third
//! less). Each element's result is the same on every path and thread count of every CPU with FMA.

use crate::activation::Activation;
use crate::exp::exp_nonpositive_with;
use crate::mul_add::MulAdd;
use crate::{GradSlice, GradSliceMut};

pub use summed::backward_with_column_sums;

mod summed;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const CUBIC: f32 = 0.044_715;
/// Where `tanh` of GELU's argument is exactly +-1 in f32 (the argument is about 158 there).
const SATURATED: f32 = 16.0;

/// `gelu(x)` and `gelu'(x)` in f32 (within a few ulps of `max(1, |x|)` of the exact function), as the
/// kernels compute them on this CPU.
///
/// ```
/// let (value, slope) = amp_kernels::gelu::value_and_slope(2.0);
/// assert!((value - 1.954_598).abs() < 1e-6 && (slope - 1.086_099).abs() < 1e-6);
/// ```
#[must_use]
pub fn value_and_slope(x: f32) -> (f32, f32) {
    crate::activation::value_and_slope::<Gelu>(x)
}

/// [`value_and_slope`] with the multiply-adds as `A` does them: what the kernels' loops compute.
#[inline(always)]
fn value_and_slope_with<A: MulAdd>(x: f32) -> (f32, f32) {
    let x2 = x * x;
    let t = tanh::<A>(SQRT_2_OVER_PI * x * A::mul_add(CUBIC, x2, 1.0));
    let half_x = 0.5 * x;
    let value = A::mul_add(half_x, t, half_x);
    // Past |x| = 16 `tanh` is exactly +-1, so `1 - t^2` is 0 and the slope `(1 + t) / 2`; the inner
    // factor is taken at the clamped x, where `x^2` cannot overflow (inf times that 0 would be NaN).
    let clamped = x.clamp(-SATURATED, SATURATED);
    let inner = 0.5 * clamped * SQRT_2_OVER_PI * A::mul_add(3.0 * CUBIC, clamped * clamped, 1.0);
    let slope = A::mul_add(A::mul_add(-t, t, 1.0), inner, A::mul_add(0.5, t, 0.5));
    (value, slope)
}

/// `tanh(u)` within 2^-22 absolute (what GELU's `1 + tanh` and `1 - tanh^2` can use), from `e^-2|u|`:
/// no library call, so loops over elements vectorise (libm's `tanhf`, through `expm1f`, was 17% of a
/// bf16 main-job step).
#[inline(always)]
fn tanh<A: MulAdd>(u: f32) -> f32 {
    let e = exp_nonpositive_with::<A>(-2.0 * u.abs());
    ((1.0 - e) / (1.0 + e)).copysign(u)
}

/// `y = gelu(x)`, computed in f32 and rounded once to `y`'s dtype, which may differ from `x`'s (an f32
/// product's GELU kept in the half precision the next product reads).
///
/// # Panics
/// If the lengths differ.
pub fn forward(x: GradSlice<'_>, y: GradSliceMut<'_>) {
    crate::activation::forward::<Gelu>(x, y);
}

/// `dx = dy * gelu'(x)`, `dx` in `x`'s dtype, `dy` of any.
///
/// # Panics
/// If the lengths differ, or `dx`'s dtype is not `x`'s.
pub fn backward(x: GradSlice<'_>, dy: GradSlice<'_>, dx: GradSliceMut<'_>) {
    crate::activation::backward::<Gelu>(x, dy, dx);
}

/// GELU as the elementwise driver computes it.
pub(crate) struct Gelu;

impl Activation for Gelu {
    const NAME: &'static str = "gelu";

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

    #[test]
    fn tanh_is_within_its_stated_error() {
        fn check<A: MulAdd>(name: &str) {
            for i in -200_000..=200_000 {
                let u = i as f32 / 10_000.0;
                let (got, want) = (f64::from(tanh::<A>(u)), f64::from(u).tanh());
                assert!((got - want).abs() <= 2f64.powi(-22), "{name}: tanh({u}) = {got}, {want}");
            }
            assert_eq!((tanh::<A>(100.0), tanh::<A>(-100.0), tanh::<A>(0.0)), (1.0, -1.0, 0.0), "{name}");
        }
        check::<Separate>("separate");
        check::<Fused>("fused");
    }

    /// Both arithmetics, the one a CPU without FMA runs too, are within 8 ulps of `max(1, |x|)` of
    /// GELU and its slope computed in f64.
    #[test]
    fn value_and_slope_are_within_a_few_ulps_either_way() {
        let exact = |x: f64| {
            let t = (0.797_884_560_802_865_4 * (x + 0.044_715 * x * x * x)).tanh();
            let slope = 0.5 * (1.0 + t)
                + 0.5 * x * (1.0 - t * t) * 0.797_884_560_802_865_4 * (1.0 + 3.0 * 0.044_715 * x * x);
            (0.5 * x * (1.0 + t), slope)
        };
        let check = |name: &str, gelu: fn(f32) -> (f32, f32)| {
            for i in -100_000..=100_000 {
                let x = i as f32 / 5_000.0;
                let ((value, slope), (want_value, want_slope)) = (gelu(x), exact(f64::from(x)));
                let bound = 8.0 * f64::from(f32::EPSILON) * f64::from(x.abs()).max(1.0);
                assert!((f64::from(value) - want_value).abs() <= bound, "{name}: gelu({x}) = {value}");
                assert!((f64::from(slope) - want_slope).abs() <= bound, "{name}: gelu'({x}) = {slope}");
            }
        };
        check("separate", value_and_slope_with::<Separate>);
        check("fused", value_and_slope_with::<Fused>);
    }

    /// Where `x^2` overflows f32 (|x| from about 1.8e19) the value is `x` or 0 and the slope 1 or 0, as
    /// from 16 on, not NaN; and from 16 on `tanh` is exactly +-1, so the clamped inner factor changes no
    /// bit of a slope there.
    #[test]
    fn large_inputs_saturate_in_value_and_slope() {
        fn check<A: MulAdd>(name: &str) {
            for x in [16.0, 17.5, 1e3, 1e19, 2e19, 1e30, f32::MAX] {
                assert_eq!(value_and_slope_with::<A>(x), (x, 1.0), "{name}: {x}");
                assert_eq!(value_and_slope_with::<A>(-x), (0.0, 0.0), "{name}: -{x}");
                assert_eq!(tanh::<A>(SQRT_2_OVER_PI * x * A::mul_add(CUBIC, x * x, 1.0)), 1.0, "{name}: {x}");
            }
            assert!(value_and_slope_with::<A>(f32::NAN).1.is_nan(), "{name}");
        }
        check::<Separate>("separate");
        check::<Fused>("fused");
    }

    /// The loops a CPU without FMA runs (vectorised here all the same) compute the separate scalar
    /// function's bits, as the fused loops compute the fused function's.
    #[test]
    fn the_loops_of_either_arithmetic_compute_its_scalar_function() {
        fn check<A: MulAdd>(name: &str) {
            let x: Vec<f32> = (0..BLOCK + 13).map(|i| ((i * 7919) % 4001) as f32 / 250.0 - 8.0).collect();
            let dy: Vec<f32> = (0..x.len()).map(|i| ((i * 104_729) % 211) as f32 / 100.0 - 1.0).collect();
            let (mut y, mut dx) = (vec![0f32; x.len()], vec![0f32; x.len()]);
            values::<Gelu, A>(&x, &mut y);
            gradients::<Gelu, A>(&x, &dy, &mut dx);
            for i in 0..x.len() {
                let (value, slope) = value_and_slope_with::<A>(x[i]);
                assert_eq!(y[i].to_bits(), value.to_bits(), "{name}: gelu(x[{i}])");
                assert_eq!(dx[i].to_bits(), (dy[i] * slope).to_bits(), "{name}: dx[{i}]");
            }
        }
        check::<Separate>("separate");
        check::<Fused>("fused");
    }

    /// Every element, whatever its place in the chunks and blocks (lengths around their edges), is the
    /// scalar function rounded once to the dtype: the vectorised loops compute the same bits.
    #[test]
    fn each_element_is_the_scalar_function_rounded_once() {
        for n in [1, BLOCK - 1, BLOCK + 1, CHUNK + 3, 3 * CHUNK + BLOCK + 7] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 4001) as f32 / 250.0 - 8.0).collect();
            let dy: Vec<f32> = (0..n).map(|i| ((i * 104_729) % 211) as f32 / 100.0 - 1.0).collect();
            let (mut y, mut dx) = (vec![0f32; n], vec![0f32; n]);
            forward(GradSlice::F32(&x), GradSliceMut::F32(&mut y));
            backward(GradSlice::F32(&x), GradSlice::F32(&dy), GradSliceMut::F32(&mut dx));
            for i in 0..n {
                let (value, slope) = value_and_slope(x[i]);
                assert_eq!(
                    (y[i].to_bits(), dx[i].to_bits()),
                    (value.to_bits(), (dy[i] * slope).to_bits()),
                    "[{i}]"
                );
            }
            let xh: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let dyh: Vec<f16> = dy.iter().map(|&v| f16::from_f32(v)).collect();
            let (mut yh, mut dxh) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
            forward(GradSlice::Bf16(&xh), GradSliceMut::Bf16(&mut yh));
            backward(GradSlice::Bf16(&xh), GradSlice::F16(&dyh), GradSliceMut::Bf16(&mut dxh));
            for i in 0..n {
                let (value, slope) = value_and_slope(xh[i].to_f32());
                assert_eq!(yh[i], bf16::from_f32(value), "[{i}]");
                assert_eq!(dxh[i], bf16::from_f32(dyh[i].to_f32() * slope), "[{i}]");
            }
        }
    }

    /// An f32 input's GELU written in a half dtype (or a half input's in f32) is the scalar function of
    /// the input rounded once to the output's dtype, on every chunk and block edge.
    #[test]
    fn an_output_of_another_dtype_is_the_function_rounded_once_to_it() {
        for n in [1, BLOCK - 1, BLOCK + 1, CHUNK + 3, 3 * CHUNK + BLOCK + 7] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 4001) as f32 / 250.0 - 8.0).collect();
            let (mut yb, mut yf) = (vec![bf16::ZERO; n], vec![f16::ZERO; n]);
            forward(GradSlice::F32(&x), GradSliceMut::Bf16(&mut yb));
            forward(GradSlice::F32(&x), GradSliceMut::F16(&mut yf));
            let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
            let mut wide = vec![0f32; n];
            forward(GradSlice::F16(&xh), GradSliceMut::F32(&mut wide));
            for i in 0..n {
                let value = value_and_slope(x[i]).0;
                assert_eq!((yb[i], yf[i]), (bf16::from_f32(value), f16::from_f32(value)), "[{i}]");
                assert_eq!(wide[i].to_bits(), value_and_slope(xh[i].to_f32()).0.to_bits(), "[{i}]");
            }
        }
    }
}
