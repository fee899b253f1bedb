//! A bit-exact software model of `vdpbf16ps`, the AVX512-BF16 dot-product instruction.
//!
//! Per f32 lane `i` the instruction reads the bf16 pairs `a[2i], a[2i+1]` and `b[2i], b[2i+1]` and
//! performs, in this order (Intel SDM, `VDPBF16PS`):
//!
//! ```text
//! acc += a[2i+1] * b[2i+1]
//! acc += a[2i]   * b[2i]
//! ```
//!
//! each as a fused multiply-add rounded to nearest even, with denormal inputs read as zero (DAZ) and
//! denormal results flushed to zero (FTZ), whatever MXCSR says. In the GEMM's packing, `a[2i]` and
//! `b[2i]` hold an even `k` and `a[2i+1]`, `b[2i+1]` the next one, so the odd `k` is added first.
//!
//! The model is fast where it can be: a product of two bf16 values has at most 16 significant bits, so
//! it is exact in f32 unless it leaves f32's exponent range, and then `acc + product` rounded once *is*
//! the fused multiply-add. Only products that overflow or underflow take `f32::mul_add`.

use half::bf16;

/// One `vdpbf16ps` lane: `acc` after adding `a[1]·b[1]`, then `a[0]·b[0]`, each fused, DAZ and FTZ.
#[must_use]
#[inline]
pub fn dpbf16_lane(acc: f32, a: [bf16; 2], b: [bf16; 2]) -> f32 {
    let acc = fma_daz_ftz(a[1].to_f32(), b[1].to_f32(), acc);
    fma_daz_ftz(a[0].to_f32(), b[0].to_f32(), acc)
}

/// One element of AMX's `tdpbf16ps` as Intel's pseudo-code writes it: `acc` after adding
/// `a[0]·b[0]`, then `a[1]·b[1]` (the even `k` first, the opposite of `vdpbf16ps`), each fused, DAZ and
/// FTZ, on packed pairs as [`dpbf16_pair`] reads them.
///
/// Sapphire Rapids does not compute this: measured on one (2026-12-03), its results agree with this
/// chain on about half of the elements of random 16 x 16 x 32 tile products and differ by an ulp on the
/// rest; it sums the 32 products of one instruction in an order and with intermediate roundings of its
/// own (it keeps `2^24 + 1 - 2^24 = 1` inside a pair of `k`, loses it across pairs). The GEMM's AMX
/// path is therefore held to the f32 accumulation bound, not to bit-identity with this model.
#[must_use]
#[inline]
pub fn tdpbf16_pair(acc: f32, a: u32, b: u32) -> f32 {
    let acc = fma_daz_ftz(low(a), low(b), acc);
    fma_daz_ftz(high(a), high(b), acc)
}

/// [`dpbf16_lane`] on packed pairs: bits 0..16 of `a` and `b` hold the even element, bits 16..32 the
/// odd one (the layout of a zmm register and of the GEMM's packed panels).
#[must_use]
#[inline]
pub fn dpbf16_pair(acc: f32, a: u32, b: u32) -> f32 {
    let acc = fma_daz_ftz(high(a), high(b), acc);
    fma_daz_ftz(low(a), low(b), acc)
}

#[inline]
fn low(pair: u32) -> f32 {
    f32::from_bits(pair << 16)
}

#[inline]
fn high(pair: u32) -> f32 {
    f32::from_bits(pair & 0xFFFF_0000)
}

/// `a·b + c` rounded once, with denormal inputs and results replaced by zero of the same sign.
#[inline]
fn fma_daz_ftz(a: f32, b: f32, c: f32) -> f32 {
    let (a, b, c) = (daz(a), daz(b), daz(c));
    let product = a * b;
    let exact = f64::from(product) == f64::from(a) * f64::from(b);
    let sum = if exact { product + c } else { a.mul_add(b, c) };
    daz(sum)
}

/// `x`, or zero of `x`'s sign if `x` is denormal.
#[inline]
fn daz(x: f32) -> f32 {
    if x.is_subnormal() {
        f32::from_bits(x.to_bits() & 0x8000_0000)
    } else {
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(even: f32, odd: f32) -> u32 {
        u32::from(bf16::from_f32(even).to_bits()) | u32::from(bf16::from_f32(odd).to_bits()) << 16
    }

    #[test]
    fn adds_the_odd_product_first() {
        // 1 + 2^24 (odd pair) rounds to 2^24, then + 1 (even pair) rounds again: 2^24, not 2^24 + 2.
        let two24 = 16_777_216.0f32;
        let got = dpbf16_pair(1.0, pair(1.0, two24), pair(1.0, 1.0));
        assert_eq!(got, two24);
        // The other order would give 2 + 2^24 exactly.
        assert_eq!((1.0f32 + 1.0) + two24, two24 + 2.0);
    }

    #[test]
    fn denormal_inputs_read_as_zero_and_denormal_results_flush() {
        let tiny = f32::from_bits(0x0001_0000); // a bf16-representable f32 denormal
        assert!(tiny.is_subnormal());
        assert_eq!(dpbf16_pair(0.0, pair(tiny, 0.0), pair(1.0, 0.0)), 0.0);
        // 2^-70 * 2^-70 = 2^-140: a denormal product, flushed.
        let small = 2f32.powi(-70);
        assert_eq!(dpbf16_pair(0.0, pair(small, 0.0), pair(small, 0.0)).to_bits(), 0);
        // A denormal accumulator reads as zero.
        assert_eq!(dpbf16_pair(tiny, pair(0.0, 0.0), pair(0.0, 0.0)), 0.0);
    }

    #[test]
    fn products_that_overflow_f32_take_the_fused_path() {
        let big = 2f32.powi(100);
        assert_eq!(dpbf16_pair(0.0, pair(big, 0.0), pair(big, 0.0)), f32::INFINITY);
        assert!(dpbf16_pair(f32::INFINITY, pair(0.0, 0.0), pair(0.0, 0.0)).is_infinite());
        assert!(dpbf16_pair(0.0, pair(f32::INFINITY, 0.0), pair(0.0, 0.0)).is_nan());
    }

    #[test]
    fn lane_and_pair_forms_agree() {
        let (a, b) =
            ([bf16::from_f32(1.5), bf16::from_f32(-3.25)], [bf16::from_f32(0.75), bf16::from_f32(2.0)]);
        let packed = |p: [bf16; 2]| u32::from(p[0].to_bits()) | u32::from(p[1].to_bits()) << 16;
        assert_eq!(dpbf16_lane(0.5, a, b), dpbf16_pair(0.5, packed(a), packed(b)));
        assert_eq!(dpbf16_lane(0.5, a, b), 0.5 + -3.25 * 2.0 + 1.5 * 0.75);
    }
}
