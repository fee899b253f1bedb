//! The software conversions the emulation uses instead of PTX `cvt` agree with `half` (round to nearest
//! even, exact widening); every other test relies on them.

use half::{bf16, f16};

use crate::common::Rng;
use crate::harness::emulator;

#[test]
fn emulated_half_conversions_match_half() {
    let Some(emu) = emulator() else { return };
    let m = emu.module("unscale");
    // SAFETY: the signatures of the header's test exports.
    let (widen, to_f16, to_bf16): (
        unsafe extern "C" fn(u16) -> f32,
        unsafe extern "C" fn(f32) -> u16,
        unsafe extern "C" fn(f32) -> u16,
    ) = unsafe {
        (
            m.kernel("amp_emu_test_f16_to_f32"),
            m.kernel("amp_emu_test_f32_to_f16"),
            m.kernel("amp_emu_test_f32_to_bf16"),
        )
    };
    for h in 0..=u16::MAX {
        // SAFETY: a pure function.
        let got = unsafe { widen(h) };
        let want = f16::from_bits(h).to_f32();
        assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "f16 {h:#06x}");
    }
    let check = |x: f32| {
        // SAFETY: pure functions.
        let (h, b) = unsafe { (to_f16(x), to_bf16(x)) };
        let (want_h, want_b) = (f16::from_f32(x), bf16::from_f32(x));
        if x.is_nan() {
            assert!(f16::from_bits(h).is_nan() && h & 0x0200 != 0, "{x:?} -> f16 {h:#06x}: not a quiet NaN");
            assert!(
                bf16::from_bits(b).is_nan() && b & 0x0040 != 0,
                "{x:?} -> bf16 {b:#06x}: not a quiet NaN"
            );
        } else {
            assert_eq!(h, want_h.to_bits(), "{x:e} ({:#010x}) -> f16", x.to_bits());
            assert_eq!(b, want_b.to_bits(), "{x:e} ({:#010x}) -> bf16", x.to_bits());
        }
    };
    // Every rounding point: the midpoints between consecutive finite f16 / bf16 values (exact in f32;
    // normals, subnormals, the overflow threshold), and their f32 neighbours on both sides.
    let neighbours = |x: f32| [x, f32::from_bits(x.to_bits() - 1), f32::from_bits(x.to_bits() + 1)];
    for bits in 0..0x7c00u16 {
        let (lo, hi) = (f16::from_bits(bits).to_f32(), f16::from_bits(bits + 1).to_f32());
        let mid = if hi.is_finite() { (lo + hi) / 2.0 } else { 65520.0 };
        for x in neighbours(mid) {
            check(x);
            check(-x);
        }
    }
    for bits in 0..0x7f80u32 {
        for x in neighbours(f32::from_bits(bits << 16 | 0x8000)) {
            check(x);
            check(-x);
        }
    }
    // Random values and payloads, and the specials.
    let mut rng = Rng(7);
    for _ in 0..200_000 {
        check(f32::from_bits(rng.next_u64() as u32));
    }
    for x in [0.0, f32::MIN_POSITIVE, f32::MAX, f32::INFINITY, f32::NAN, f32::from_bits(0x7f80_0001)] {
        check(x);
        check(-x);
    }
}
