//! Unscale + non-finite check, and the read-only check: both code paths against the scalar reference,
//! bit for bit, on every dtype and tail length, with infinities and NaNs injected at the first, middle
//! and last element of one tensor among several, and with finite values that overflow when unscaled.

mod common;

use amp_kernels::reference;
use amp_kernels::unscale::{find_non_finite_with, unscale_and_check_with};
use amp_kernels::{Dtype, Isa};
use common::{assert_same_owned, tensor_set, views, views_mut, Owned, Rng, DTYPES, LENGTHS};

/// Runs the kernel on `isa` and the reference on copies of `ts`; asserts identical results and values.
fn check(isa: Isa, ts: &[Owned], inv_scale: f32) -> Option<usize> {
    let (mut a, mut b) = (ts.to_vec(), ts.to_vec());
    let expect_ro = reference::find_non_finite(&views(ts));
    assert_eq!(find_non_finite_with(isa, &views(ts)), expect_ro, "{isa:?} find_non_finite");
    let got = unscale_and_check_with(isa, &mut views_mut(&mut a), inv_scale);
    let expect = reference::unscale_and_check(&mut views_mut(&mut b), inv_scale);
    assert_eq!(got, expect, "{isa:?} unscale_and_check index");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_same_owned(&format!("{isa:?} tensor {i}"), x, y);
    }
    got
}

#[test]
fn finite_gradients_unscale_exactly_like_the_reference_and_report_none() {
    let mut rng = Rng(1);
    for isa in Isa::supported() {
        for dtype in DTYPES {
            let ts = tensor_set(&mut rng, dtype, -12, 14);
            assert_eq!(check(isa, &ts, 1.0 / 1024.0), None);
            // A non-power-of-two factor rounds: still bit-identical.
            assert_eq!(check(isa, &ts, 0.3), None);
        }
    }
}

#[test]
fn injected_nan_or_inf_at_first_middle_last_is_reported_by_tensor_index() {
    let mut rng = Rng(2);
    let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY];
    for isa in Isa::supported() {
        for dtype in DTYPES {
            let base = tensor_set(&mut rng, dtype, -8, 8);
            for (t, &n) in LENGTHS.iter().enumerate().filter(|(_, &n)| n > 0) {
                for pos in [0, n / 2, n - 1] {
                    for bad in specials {
                        let mut ts = base.clone();
                        ts[t].set(pos, bad);
                        assert_eq!(check(isa, &ts, 0.5), Some(t), "{isa:?} {dtype:?} t={t} pos={pos} {bad}");
                    }
                }
            }
        }
    }
}

#[test]
fn the_first_of_several_bad_tensors_is_reported() {
    let mut rng = Rng(3);
    for isa in Isa::supported() {
        let mut ts = tensor_set(&mut rng, Dtype::F32, -8, 8);
        ts[8].set(65536, f32::NAN);
        ts[3].set(7, f32::INFINITY);
        ts[5].set(0, f32::NAN);
        assert_eq!(check(isa, &ts, 1.0), Some(3));
    }
}

#[test]
fn finite_values_that_overflow_on_unscale_are_reported() {
    for isa in Isa::supported() {
        // f32: 3e38 * 4 overflows f32.
        let mut ts = vec![Owned::new(Dtype::F32, &[1.0; 17]), Owned::new(Dtype::F32, &[1.0; 17])];
        ts[1].set(16, 3e38);
        assert_eq!(check(isa, &ts, 4.0), Some(1), "{isa:?} f32");
        // f16: 40000 * 2 = 80000 is a finite f32 but overflows f16 when stored back.
        let mut ts = vec![Owned::new(Dtype::F16, &[1.0; 9]), Owned::new(Dtype::F16, &[1.0; 9])];
        ts[0].set(4, 40000.0);
        assert_eq!(check(isa, &ts, 2.0), Some(0), "{isa:?} f16");
        // bf16: 3e38 * 4 overflows.
        let mut ts = vec![Owned::new(Dtype::Bf16, &[1.0; 8])];
        ts[0].set(7, 3e38);
        assert_eq!(check(isa, &ts, 4.0), Some(0), "{isa:?} bf16");
    }
}

#[test]
fn overflow_on_narrowing_is_flagged_exactly_at_the_rounding_boundary() {
    // f16: 32768 * s lands exactly on 65520 (the tie between 65504 and inf, which rounds to inf) or one
    // f32 ulp below it (rounds to 65504). bf16: 2^127 * s lands on 0x7F7F_8000 or just below.
    let cases =
        [(Dtype::F16, 32768.0f32, 65520.0f32), (Dtype::Bf16, 2f32.powi(127), f32::from_bits(0x7F7F_8000))];
    for isa in Isa::supported() {
        for (dtype, x, tie) in cases {
            let at = tie / x;
            let below = f32::from_bits(at.to_bits() - 1);
            assert_eq!(x * at, tie);
            let ts = vec![Owned::new(dtype, &[x; 11])];
            assert_eq!(check(isa, &ts, at), Some(0), "{isa:?} {dtype:?} at the tie");
            assert_eq!(check(isa, &ts, below), None, "{isa:?} {dtype:?} below the tie");
            assert_eq!(check(isa, &ts, -at), Some(0), "{isa:?} {dtype:?} negative tie");
        }
    }
}

#[test]
fn unscaling_by_zero_flags_only_infinities_and_nans() {
    for isa in Isa::supported() {
        let mut ts = vec![Owned::new(Dtype::F16, &[65504.0; 20]), Owned::new(Dtype::F32, &[1.0; 20])];
        assert_eq!(check(isa, &ts, 0.0), None);
        ts[1].set(19, f32::INFINITY);
        assert_eq!(check(isa, &ts, 0.0), Some(1), "inf * 0 is NaN");
    }
}

#[test]
fn subnormal_results_are_kept_not_flushed() {
    for isa in Isa::supported() {
        for dtype in DTYPES {
            let ts = vec![Owned::new(dtype, &[1e-3; 33])];
            let mut out = ts.clone();
            assert_eq!(check(isa, &ts, 1e-36), None);
            unscale_and_check_with(isa, &mut views_mut(&mut out), 1e-36);
            // 1e-39 is subnormal in f32 and bf16 (same exponent range); f16 underflows to 0 by rounding.
            let y = out[0].get(32);
            if dtype == Dtype::F16 {
                assert_eq!(y, 0.0);
            } else {
                assert!(y > 0.9e-39 && y < 1.1e-39, "{dtype:?}: {y:e}");
            }
        }
    }
}

#[test]
fn an_empty_list_and_empty_tensors_are_finite() {
    for isa in Isa::supported() {
        assert_eq!(unscale_and_check_with(isa, &mut [], 2.0), None);
        assert_eq!(check(isa, &[Owned::new(Dtype::F16, &[]), Owned::new(Dtype::F32, &[])], 2.0), None);
    }
}
