//! Conversions f32 <-> f16 / bf16: both code paths against `half`, bit for bit, including NaN payloads,
//! infinities, subnormals and rounding ties. `half`'s `from_f32` may itself use F16C, so f16 is also
//! checked against `half`'s software conversion (`from_f32_const`).

mod common;

use amp_kernels::convert::{add_widened_with, narrow_with, widen_with};
use amp_kernels::{GradSlice, HalfSliceMut, Isa};
use common::Rng;
use half::{bf16, f16};

#[test]
fn widening_every_f16_and_bf16_bit_pattern_matches_half() {
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let h: Vec<f16> = all.iter().map(|&b| f16::from_bits(b)).collect();
    let b: Vec<bf16> = all.iter().map(|&b| bf16::from_bits(b)).collect();
    for isa in Isa::supported() {
        let mut out = vec![0f32; all.len()];
        widen_with(isa, GradSlice::F16(&h), &mut out);
        for (x, y) in h.iter().zip(&out) {
            assert_eq!(y.to_bits(), x.to_f32_const().to_bits(), "{isa:?} f16 {:#06x}", x.to_bits());
        }
        widen_with(isa, GradSlice::Bf16(&b), &mut out);
        for (x, y) in b.iter().zip(&out) {
            assert_eq!(y.to_bits(), x.to_f32().to_bits(), "{isa:?} bf16 {:#06x}", x.to_bits());
        }
    }
}

/// `dst += src` widened, on every path, is the f32 sum of each element and its exact widening, bit for
/// bit (every f16 and bf16 pattern against a destination of mixed magnitudes, inf and NaN included; an
/// f32 source; lengths that end mid-block).
#[test]
fn adding_widened_values_is_one_f32_addition_per_element() {
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let h: Vec<f16> = all.iter().map(|&b| f16::from_bits(b)).collect();
    let b: Vec<bf16> = all.iter().map(|&b| bf16::from_bits(b)).collect();
    let mut rng = Rng(11);
    let mut start = rng.vec(all.len(), -20, 20);
    start[7] = f32::INFINITY;
    start[8] = f32::NAN;
    let f = rng.vec(all.len(), -20, 20);
    for isa in Isa::supported() {
        for len in [all.len(), 1023, 1025, 3] {
            let mut dst = start[..len].to_vec();
            add_widened_with(isa, GradSlice::F16(&h[..len]), &mut dst);
            let want: Vec<f32> = (0..len).map(|i| start[i] + h[i].to_f32_const()).collect();
            common::assert_same(&format!("{isa:?} f16"), &dst, &want);
            let mut dst = start[..len].to_vec();
            add_widened_with(isa, GradSlice::Bf16(&b[..len]), &mut dst);
            let want: Vec<f32> = (0..len).map(|i| start[i] + b[i].to_f32()).collect();
            common::assert_same(&format!("{isa:?} bf16"), &dst, &want);
            let mut dst = start[..len].to_vec();
            add_widened_with(isa, GradSlice::F32(&f[..len]), &mut dst);
            let want: Vec<f32> = (0..len).map(|i| start[i] + f[i]).collect();
            common::assert_same(&format!("{isa:?} f32"), &dst, &want);
        }
    }
}

/// f32 bit patterns around every rounding decision: for each of `highs` (upper bits) every low-bit
/// pattern in `lows` (below the kept mantissa: zero, one, just below / at / above the tie, all ones).
fn probes(kept_shift: u32, highs: impl Iterator<Item = u32>) -> Vec<f32> {
    let half = 1u32 << (kept_shift - 1);
    let lows = [0, 1, half - 1, half, half + 1, (1 << kept_shift) - 1];
    highs.flat_map(|h| lows.map(move |l| f32::from_bits((h << kept_shift) | l))).collect()
}

fn check_narrow(isa: Isa, src: &[f32]) {
    let mut h = vec![f16::ZERO; src.len()];
    let mut b = vec![bf16::ZERO; src.len()];
    narrow_with(isa, src, HalfSliceMut::F16(&mut h));
    narrow_with(isa, src, HalfSliceMut::Bf16(&mut b));
    for (i, &x) in src.iter().enumerate() {
        let (soft, lib) = (f16::from_f32_const(x).to_bits(), f16::from_f32(x).to_bits());
        assert_eq!(h[i].to_bits(), soft, "{isa:?} f16 of {:#010x}", x.to_bits());
        assert_eq!(h[i].to_bits(), lib, "{isa:?} f16 of {:#010x}", x.to_bits());
        assert_eq!(b[i].to_bits(), bf16::from_f32(x).to_bits(), "{isa:?} bf16 of {:#010x}", x.to_bits());
    }
}

#[test]
fn narrowing_to_bf16_matches_half_at_every_exponent_and_tie() {
    // Every sign, exponent (incl. subnormals, inf, NaN) and 7 kept mantissa bits, each with 6 low patterns.
    let src = probes(16, 0..=0xFFFF);
    for isa in Isa::supported() {
        check_narrow(isa, &src);
    }
}

#[test]
fn narrowing_to_f16_matches_half_at_every_exponent_and_tie() {
    // f16 keeps 10 mantissa bits, so its decisions are at bit 13; the sampled upper 19 bits cover every
    // sign and exponent with every kept-mantissa value's top 6 bits (2^15 highs x 6 lows x 2 shifts).
    let highs = (0u32..1 << 15).map(|h| h << 4 | (h & 0xF));
    let mut src = probes(13, highs);
    // Around f16's own subnormal / overflow boundaries every kept pattern: exponents 100..=143.
    src.extend(probes(13, (100u32 << 10)..(144 << 10)));
    for isa in Isa::supported() {
        check_narrow(isa, &src);
    }
}

#[test]
fn random_conversions_round_trip_like_half_on_all_tail_lengths() {
    let mut rng = Rng(7);
    for isa in Isa::supported() {
        for n in common::LENGTHS {
            let src: Vec<f32> = (0..n).map(|_| f32::from_bits(rng.next_u64() as u32)).collect();
            check_narrow(isa, &src);
        }
    }
}

#[test]
#[should_panic(expected = "lengths differ")]
fn mismatched_lengths_panic() {
    narrow_with(Isa::detect(), &[1.0; 3], HalfSliceMut::F16(&mut [f16::ZERO; 2]));
}
