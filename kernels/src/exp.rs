//! `e^x` for `x <= 0` in f32 multiply-adds: no library call, so loops over elements vectorise (libm's
//! `expf` is a call per element). Softmax and GELU's `tanh` only ever need non-positive arguments
//! (softmax subtracts the row maximum; `tanh` uses `e^-2|u|`).

use crate::mul_add::{MulAdd, Separate};

/// Below this the result would be smaller than f32's smallest normal number: it is 0.
const UNDERFLOW: f32 = -87.3;

/// `e^x` for `x <= 0`, within 2 ulps of the exact value; 0 below -87.3 (where `e^x` is below
/// `f32::MIN_POSITIVE`, so the absolute error stays under 1.2e-38) and for `-inf`; NaN for NaN.
///
/// Range reduction `x = n ln2 + r`, `|r| <= ln2 / 2`, with ln 2 split in two parts so that `n ln2` is
/// exact; a degree-7 Taylor polynomial for `e^r` (remainder below 2^-27); `2^n` written into the
/// exponent bits. Positive arguments are outside the contract (the result is not `e^x`).
///
/// ```
/// use amp_kernels::exp::exp_nonpositive;
///
/// assert_eq!(exp_nonpositive(0.0), 1.0);
/// assert!((exp_nonpositive(-1.0) - (-1.0f32).exp()).abs() <= 2.0 * f32::EPSILON);
/// assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
/// assert!(exp_nonpositive(f32::NAN).is_nan());
/// ```
#[inline(always)]
#[must_use]
pub fn exp_nonpositive(x: f32) -> f32 {
    exp_nonpositive_with::<Separate>(x)
}

/// [`exp_nonpositive`] with its multiply-adds fused or not ([`crate::mul_add`]); within the same 2 ulps
/// either way.
#[inline(always)]
pub(crate) fn exp_nonpositive_with<A: MulAdd>(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75; // ln 2 to 15 significant bits: n * LN2_HI is exact for |n| < 512
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding and subtracting 1.5 * 2^23 rounds to an integer in the default rounding mode, in
    // instructions that vectorise (no `round`, which is a library call on baseline x86-64).
    const ROUND: f32 = 12_582_912.0;
    // Clamped so that the exponent bits below stay a normal number's; the result is replaced after.
    let clamped = x.clamp(UNDERFLOW, 0.0);
    let shifted = A::mul_add(clamped, LOG2_E, ROUND);
    let n = shifted - ROUND;
    // n as an integer: `shifted` lies in [2^23, 2^24), where the float's step is 1, so its bits minus
    // ROUND's are n itself (an `as i32` cast saturates, which the compiler does one lane at a time).
    let n_int = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    // `clamped - n ln2_hi - n ln2_lo` and the polynomial in Horner's form: separate, the same
    // operations in the same order as `(x - n hi) - n lo` and `1 + r (1 + r (1/2 + ...))` written out.
    let r = A::mul_add(-n, LN2_LO, A::mul_add(-n, LN2_HI, clamped));
    let mut p = 1.0 / 5040.0;
    for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = A::mul_add(p, r, c);
    }
    let e = p * f32::from_bits(((n_int + 127) as u32) << 23);
    if x.is_nan() {
        f32::NAN
    } else if x < UNDERFLOW {
        0.0
    } else {
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mul_add::Fused;

    #[test]
    fn within_two_ulps_down_to_the_underflow_and_zero_below() {
        fn check<A: MulAdd>(name: &str) {
            let exp = exp_nonpositive_with::<A>;
            for i in 0..=400_000 {
                let x = UNDERFLOW * i as f32 / 400_000.0;
                let (got, want) = (f64::from(exp(x)), f64::from(x).exp());
                let bound = 2.0 * f64::from(f32::EPSILON) * want;
                assert!((got - want).abs() <= bound, "{name}: exp({x}) = {got}, {want}");
            }
            for x in [-87.31, -88.0, -100.0, -1e30, f32::MIN, f32::NEG_INFINITY] {
                assert_eq!(exp(x), 0.0, "{name}: exp({x})");
            }
            assert_eq!(exp(-0.0), 1.0, "{name}");
            assert!(exp(f32::NAN).is_nan(), "{name}");
        }
        check::<Separate>("separate");
        check::<Fused>("fused");
    }

    /// The separate variant is the formula as it was written out before the multiply-adds were named:
    /// `exp_nonpositive`'s values did not change.
    #[test]
    fn the_separate_variant_is_the_written_out_formula() {
        for i in 0..=100_000 {
            let x = UNDERFLOW * i as f32 / 100_000.0;
            let clamped = x.clamp(UNDERFLOW, 0.0);
            let shifted = clamped * std::f32::consts::LOG2_E + 12_582_912.0;
            let n = shifted - 12_582_912.0;
            let r = (clamped - n * 0.693_145_75) - n * 1.428_606_8e-6;
            let p = 1.0
                + r * (1.0
                    + r * (0.5
                        + r * (1.0 / 6.0
                            + r * (1.0 / 24.0
                                + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
            let n_int = shifted.to_bits().wrapping_sub(12_582_912f32.to_bits()) as i32;
            let want = p * f32::from_bits(((n_int + 127) as u32) << 23);
            assert_eq!(exp_nonpositive(x).to_bits(), want.to_bits(), "exp({x})");
        }
    }
}
