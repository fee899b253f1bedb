//! Building blocks of the portable kernels: dtype conversion by blocks, non-finite tests on raw bits, the
//! fixed-order f64 lane reduction.
//!
//! The portable kernels work on blocks of [`BLOCK`] elements through f32 stack buffers, with plain loops
//! over slices that LLVM auto-vectorises for the compile target. f16 blocks convert through `half`'s slice
//! conversions (F16C / NEON fp16 when the CPU has them); bf16 conversions are written here branch-free
//! so they vectorise, with `half::bf16::from_f32` semantics.

pub(crate) mod kernels;
pub(crate) mod lamb;
pub(crate) mod optim;
pub(crate) mod stochastic;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Elements per block of the portable kernels. A multiple of [`LANES`].
pub(crate) const BLOCK: usize = 256;

/// Number of f64 partial sums a norm keeps: element `j` of a leaf goes to lane `j % LANES`. Both code
/// paths use this layout, then [`reduce_lanes`], so their sums are bit-identical.
pub(crate) const LANES: usize = 16;

/// Sums the lanes of a norm accumulator in a fixed pairwise order.
pub(crate) fn reduce_lanes(lanes: &[f64; LANES]) -> f64 {
    let mut v = *lanes;
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            v[i] += v[i + width];
        }
    }
    v[0]
}

/// `half::bf16::from_f32(x).to_bits()`, branch-free: round to nearest, ties to even; a NaN keeps its sign
/// and top mantissa bits and gets the quiet bit set.
#[inline(always)]
pub(crate) fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    let quiet = ((b >> 16) | 0x0040) as u16;
    if b & 0x7FFF_FFFF > 0x7F80_0000 {
        quiet
    } else {
        rounded
    }
}

/// `half::bf16::to_f32` as bits, branch-free: a shift, plus the quiet bit for a NaN.
#[inline(always)]
pub(crate) fn bf16_widen_bits(b: u16) -> u32 {
    let x = u32::from(b) << 16;
    if x & 0x7FFF_FFFF > 0x7F80_0000 {
        x | 0x0040_0000
    } else {
        x
    }
}

/// An element type the portable kernels read and write through f32.
pub(crate) trait Elem: Copy + Send + Sync {
    /// Widens `src` into `dst` (equal lengths). Exact.
    fn widen(src: &[Self], dst: &mut [f32]);

    /// Narrows `src` into `dst` (equal lengths) with `half`'s `from_f32` semantics.
    fn narrow(src: &[f32], dst: &mut [Self]);

    /// Whether any element is infinite or NaN.
    fn any_nonfinite(s: &[Self]) -> bool;

    /// Calls `f` with the values of `src` (at most [`BLOCK`]) as f32: `src` itself for f32, else a
    /// widened copy in `buf`.
    #[inline(always)]
    fn read<R>(src: &[Self], buf: &mut [f32; BLOCK], f: impl FnOnce(&[f32]) -> R) -> R {
        let buf = &mut buf[..src.len()];
        Self::widen(src, buf);
        f(buf)
    }

    /// Calls `f` to update the values of `dst` (at most [`BLOCK`]) in f32, then stores them back.
    #[inline(always)]
    fn update<R>(dst: &mut [Self], buf: &mut [f32; BLOCK], f: impl FnOnce(&mut [f32]) -> R) -> R {
        let buf = &mut buf[..dst.len()];
        Self::widen(dst, buf);
        let r = f(buf);
        Self::narrow(buf, dst);
        r
    }
}

/// Whether any `bits & exp == exp`, i.e. any element with an all-ones exponent field.
#[inline(always)]
fn any_exp_all_ones_u16(bits: &[u16], exp: u16) -> bool {
    bits.iter().fold(0u16, |acc, &b| acc | u16::from(b & exp == exp)) != 0
}

impl Elem for f32 {
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    fn narrow(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    fn any_nonfinite(s: &[f32]) -> bool {
        s.iter().fold(0u32, |acc, x| acc | u32::from(x.to_bits() & 0x7F80_0000 == 0x7F80_0000)) != 0
    }

    #[inline(always)]
    fn read<R>(src: &[f32], _buf: &mut [f32; BLOCK], f: impl FnOnce(&[f32]) -> R) -> R {
        f(src)
    }

    #[inline(always)]
    fn update<R>(dst: &mut [f32], _buf: &mut [f32; BLOCK], f: impl FnOnce(&mut [f32]) -> R) -> R {
        f(dst)
    }
}

impl Elem for f16 {
    fn widen(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }

    fn narrow(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }

    fn any_nonfinite(s: &[f16]) -> bool {
        any_exp_all_ones_u16(s.reinterpret_cast(), 0x7C00)
    }
}

impl Elem for bf16 {
    fn widen(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(bf16_widen_bits(s.to_bits()));
        }
    }

    fn narrow(src: &[f32], dst: &mut [bf16]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = bf16::from_bits(bf16_bits(s));
        }
    }

    fn any_nonfinite(s: &[bf16]) -> bool {
        any_exp_all_ones_u16(s.reinterpret_cast(), 0x7F80)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_bits_matches_half_on_ties_nan_inf_and_subnormals() {
        let cases = [
            0x3F80_8000u32, // tie, even below: stays
            0x3F81_8000,    // tie, odd below: rounds up
            0x3F80_8001,    // above tie
            0x3F80_7FFF,    // below tie
            0x7F7F_FFFF,    // max finite: rounds to inf
            0xFF7F_FFFF,    // -max finite: rounds to -inf
            0x7F80_0000,    // inf
            0xFF80_0000,    // -inf
            0x7F80_0001,    // signalling NaN with only low payload
            0xFFC1_2345,    // negative quiet NaN
            0x0000_8000,    // subnormal tie
            0x0001_8000,    // subnormal tie, odd
            0x8000_0001,    // tiny negative subnormal
        ];
        for bits in cases {
            let x = f32::from_bits(bits);
            assert_eq!(bf16_bits(x), bf16::from_f32(x).to_bits(), "{bits:#010x}");
        }
    }

    #[test]
    fn reduce_lanes_sums_exactly_representable_values() {
        let mut lanes = [0.0; LANES];
        for (i, l) in lanes.iter_mut().enumerate() {
            *l = i as f64;
        }
        assert_eq!(reduce_lanes(&lanes), 120.0);
    }
}
