//! Conversions of one value between f32 and f16 / bf16, written without branches so that a loop of them
//! vectorises: `half` converts one value at a time behind a run-time feature check, which keeps such a
//! loop scalar (the GEMM's packing for f16 products spent a quarter of the main job's fp16 step there).
//! Each is `half`'s conversion bit for bit (tests below), NaN payloads and signs included.

use half::f16;

/// `bf16::from_f32(x).to_bits()`: rounded to nearest even on the bits; a NaN keeps its sign and top
/// payload bits and is made quiet, as `half` does.
#[inline(always)]
pub(crate) fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    // Wrapping: a negative NaN with a full payload (0xFFFF_8000 and above, f16's NaN 0xFFFF widened
    // among them) carries out of the word; its rounded value is not the one kept.
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16;
    let nan = (bits >> 16) | 0x40;
    (if bits & 0x7FFF_FFFF > 0x7F80_0000 { nan } else { rounded }) as u16
}

/// `f16::from_f32(x).to_f32()`: the mantissa rounded to 10 bits to nearest even, 65520 and beyond
/// infinite; below f16's smallest normal (2^-14) a multiple of 2^-24, which adding and taking away 0.5
/// (whose ulp that is) rounds to; a NaN quiet, its top payload bits kept, as `half` does.
#[inline(always)]
pub(crate) fn f16_rounded(x: f32) -> f32 {
    let bits = x.to_bits();
    let abs = bits & 0x7FFF_FFFF;
    let normal = (abs + 0x0FFF + ((abs >> 13) & 1)) & 0xFFFF_E000;
    let normal = if normal >= 0x4780_0000 { 0x7F80_0000 } else { normal };
    let tiny = ((f32::from_bits(abs) + 0.5) - 0.5).to_bits();
    let nan = 0x7FC0_0000 | (abs & 0x007F_E000);
    let magnitude = if abs > 0x7F80_0000 {
        nan
    } else if abs < 0x3880_0000 {
        tiny
    } else {
        normal
    };
    f32::from_bits((bits & 0x8000_0000) | magnitude)
}

/// `x.to_f32()`: the exponent rebiased; a subnormal its mantissa times 2^-24 (exact); infinities kept
/// and a NaN made quiet, as `half` does.
#[inline(always)]
pub(crate) fn f16_to_f32(x: f16) -> f32 {
    let h = u32::from(x.to_bits());
    let (exponent, mantissa) = (h & 0x7C00, h & 0x03FF);
    let normal = ((h & 0x7FFF) << 13) + 0x3800_0000;
    let tiny = (mantissa as i32 as f32 * f32::from_bits(0x3380_0000)).to_bits();
    let quiet = if mantissa != 0 { 0x0040_0000 } else { 0 };
    let special = 0x7F80_0000 | quiet | mantissa << 13;
    let magnitude = if exponent == 0x7C00 {
        special
    } else if exponent == 0 {
        tiny
    } else {
        normal
    };
    f32::from_bits((h & 0x8000) << 16 | magnitude)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn bf16_rounding_is_halfs() {
        let mut bits = 0x0123_4567u32;
        let specials =
            [0.0f32, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, f32::MAX, f32::MIN];
        // Negative NaNs from 0xFFFF_8000 up carry out of the word while rounding (a debug build once
        // panicked there).
        #[rustfmt::skip]
        let edges = [
            0x7F7F_8000u32, 0x7F7F_7FFF, 0x0000_8000, 0x3F80_8000, 0x3F81_8000, 0x7F80_0001, 0xFFC0_0001,
            0xFFFF_8000, 0xFFFF_E000, 0xFFFF_FFFF,
        ];
        let randoms = (0..200_000).map(|_| {
            bits ^= bits << 13;
            bits ^= bits >> 17;
            bits ^= bits << 5;
            bits
        });
        for x in specials.into_iter().chain(edges.into_iter().chain(randoms).map(f32::from_bits)) {
            assert_eq!(bf16_bits(x), bf16::from_f32(x).to_bits(), "{x:e} ({:#010x})", x.to_bits());
        }
    }

    #[test]
    fn f16_conversions_are_halfs_bit_for_bit() {
        for h in 0..=u16::MAX {
            let x = f16::from_bits(h);
            assert_eq!(f16_to_f32(x).to_bits(), x.to_f32().to_bits(), "f16 {h:#06x}");
        }
        // Every f32 exponent and sign with a spread of mantissas, and the neighbourhoods of f16's edges:
        // its smallest subnormal and normal, its largest finite, the overflow threshold, NaN payloads.
        let mut patterns: Vec<u32> = (0..=u32::MAX).step_by(4099).collect();
        for edge in [0x3380_0000u32, 0x3880_0000, 0x477F_E000, 0x477F_F000, 0x7F80_0000, 0x7FC0_0000] {
            patterns.extend(edge.saturating_sub(4096)..=edge.saturating_add(4096));
        }
        patterns.extend([0x7F80_0001, 0x7FBF_FFFF, 0x7F80_2000, 0x0000_0001, 0x007F_FFFF]);
        for bits in patterns.iter().flat_map(|&b| [b, b | 0x8000_0000]) {
            let x = f32::from_bits(bits);
            let want = f16::from_f32(x).to_f32().to_bits();
            assert_eq!(f16_rounded(x).to_bits(), want, "f32 {bits:#010x}");
        }
    }
}
