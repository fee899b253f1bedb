//! Stochastic rounding to bf16: unbiased exactly (all 2^16 random values averaged give the f32 back, in
//! f64), bracketed by its two neighbours, special values kept, every code path the same bits.

mod common;

use amp_kernels::stochastic::{narrow_bf16_with, random_bits, round_bf16, stream_key};
use amp_kernels::Isa;
use common::Rng;
use half::bf16;

/// Values with every kind of low half: random normals, subnormals, both sides of a binade's end, the
/// largest finite bf16's neighbourhood, exact bf16 values, negatives.
fn samples(rng: &mut Rng) -> Vec<f32> {
    let mut x = rng.vec(200, -130, 120);
    x.extend([
        1.0,
        -1.0,
        1.999_999_9,
        -1.999_999_9,
        f32::from_bits(0x3F80_0001),
        f32::from_bits(0x0000_0001),
        f32::from_bits(0x8000_FFFF),
        f32::from_bits(0x007F_FFFF),
        f32::from_bits(0x7F7E_0001),
        0.0,
        -0.0,
    ]);
    x
}

#[test]
fn the_average_over_all_random_values_is_the_value_itself_in_f64() {
    let mut rng = Rng(1);
    for x in samples(&mut rng) {
        let sum: f64 = (0..=0xFFFFu32).map(|r| f64::from(round_bf16(x, r).to_f32())).sum();
        // Each rounded value is a bf16, and 2^16 of them sum exactly in f64 (53 bits hold 8 + 16 + 1).
        assert_eq!(sum / 65536.0, f64::from(x), "x = {x:e} ({:#010x})", x.to_bits());
    }
}

#[test]
fn each_result_is_one_of_the_two_neighbours_and_exact_values_stay() {
    let mut rng = Rng(2);
    for x in samples(&mut rng) {
        let toward_zero = bf16::from_bits((x.to_bits() >> 16) as u16);
        let away = bf16::from_bits((x.to_bits() >> 16) as u16 + u16::from(x.to_bits() & 0xFFFF != 0));
        for r in [0, 1, 0x7FFF, 0x8000, 0xFFFF, 0xDEAD_BEEF] {
            let got = round_bf16(x, r);
            assert!(got == toward_zero || got == away, "{x:e} with {r:#x}: {got}");
        }
        assert_eq!(round_bf16(x, 0), toward_zero, "no carry: truncation");
        let exact = toward_zero.to_f32();
        for r in [0, 0xFFFF, 0x1234_5678] {
            assert_eq!(round_bf16(exact, r).to_bits(), toward_zero.to_bits(), "{exact:e} is a bf16 already");
        }
    }
}

#[test]
fn infinities_stay_nans_become_quiet_and_overflow_follows_the_same_rule() {
    for r in [0, 0x8000, 0xFFFF] {
        assert_eq!(round_bf16(f32::INFINITY, r), bf16::INFINITY);
        assert_eq!(round_bf16(f32::NEG_INFINITY, r), bf16::NEG_INFINITY);
        for nan in [f32::NAN, -f32::NAN, f32::from_bits(0x7F80_0001), f32::from_bits(0xFFFF_FFFF)] {
            assert_eq!(round_bf16(nan, r).to_bits(), bf16::from_f32(nan).to_bits(), "{:#x}", nan.to_bits());
        }
    }
    // f32::MAX lies past bf16's largest finite value: it rounds to it or to infinity.
    assert_eq!(round_bf16(f32::MAX, 0), bf16::MAX);
    assert_eq!(round_bf16(f32::MAX, 1), bf16::INFINITY);
}

/// The rounding of `src[i]` with the bits of index `first + i`, one element at a time.
fn expected(src: &[f32], key: u32, first: u64) -> Vec<u16> {
    src.iter()
        .enumerate()
        .map(|(i, &x)| round_bf16(x, random_bits(key, first + i as u64)).to_bits())
        .collect()
}

#[test]
fn every_path_writes_the_bits_of_the_element_formula_at_any_start_and_length() {
    let mut rng = Rng(3);
    let key = stream_key(&[7, 11]);
    let starts = [0, 1, 5, 1 << 20, (1 << 32) - 5, (1 << 32) + 3, (1 << 33) - 3];
    for n in [0, 1, 7, 8, 9, 31, 1000] {
        let mut src = rng.vec(n, -20, 20);
        if n > 3 {
            (src[0], src[1], src[2]) = (f32::NAN, f32::INFINITY, -0.0);
        }
        for first in starts {
            let want = expected(&src, key, first);
            for isa in Isa::supported() {
                let mut dst = vec![bf16::ZERO; n];
                narrow_bf16_with(isa, &src, &mut dst, key, first);
                let got: Vec<u16> = dst.iter().map(|b| b.to_bits()).collect();
                assert_eq!(got, want, "{isa:?}, {n} elements from {first}");
            }
        }
    }
}

#[test]
fn the_random_bits_round_up_as_often_as_the_fraction_says() {
    // x = 1 + 0.3 bf16 steps: over 200,000 indices about 30% round up. The standard error of the
    // fraction is 0.001; 0.005 is five of them.
    let steps = 0.3f32;
    let x = 1.0 + steps * 2f32.powi(-7);
    for key in [0, stream_key(&[1]), stream_key(&[1, 2, 3])] {
        let up = (0..200_000u64).filter(|&i| round_bf16(x, random_bits(key, i)).to_f32() > 1.0).count();
        let fraction = up as f64 / 200_000.0;
        assert!((fraction - f64::from(steps)).abs() < 0.005, "key {key:#x}: {fraction}");
    }
}

#[test]
fn keys_of_different_words_differ() {
    let keys: std::collections::HashSet<u32> =
        (0..64u64).flat_map(|a| (0..64u64).map(move |b| stream_key(&[a, b, a & 1]))).collect();
    assert_eq!(keys.len(), 64 * 64);
}
