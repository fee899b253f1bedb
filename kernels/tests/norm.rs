//! L2 norms: both code paths bit-identical to each other, within 1 ulp of the sequential f64 reference,
//! deterministic across thread counts, and NaN / inf propagating.

mod common;

use amp_kernels::clip::clip_coefficient;
use amp_kernels::norm::{global_l2_norm_with, l2_norms_with};
use amp_kernels::{reference, Dtype, GradSlice, Isa};
use common::{tensor_set, views, Owned, Rng, DTYPES};

/// Distance in units in the last place between two finite non-negative f32.
fn ulps(a: f32, b: f32) -> u32 {
    a.to_bits().abs_diff(b.to_bits())
}

/// A mixed-dtype list: every length in every dtype.
fn mixed(rng: &mut Rng) -> Vec<Owned> {
    DTYPES.iter().flat_map(|&d| tensor_set(rng, d, -10, 10)).collect()
}

#[test]
fn norms_are_within_one_ulp_of_the_f64_reference_and_identical_across_paths() {
    let mut rng = Rng(11);
    let ts = mixed(&mut rng);
    let grads = views(&ts);
    let mut expect = vec![0f32; grads.len()];
    let expect_global = reference::l2_norms(&grads, 0.25, &mut expect);
    let mut first: Option<(f32, Vec<f32>)> = None;
    for isa in Isa::supported() {
        let mut per = vec![0f32; grads.len()];
        let global = l2_norms_with(isa, &grads, 0.25, &mut per);
        // Sums of f32 squares in f64 (exact products, 2^-53 per addition over < 2^20 terms) then sqrt:
        // the only difference from the reference is the summation order, < 2^-33 relative, so the f32
        // results can differ only where the exact value sits on a rounding boundary: at most 1 ulp.
        assert!(ulps(global, expect_global) <= 1, "{isa:?} global {global} vs {expect_global}");
        for (i, (&a, &b)) in per.iter().zip(&expect).enumerate() {
            assert!(ulps(a, b) <= 1, "{isa:?} tensor {i}: {a} vs {b}");
        }
        assert_eq!(global.to_bits(), global_l2_norm_with(isa, &grads, 0.25).to_bits());
        match &first {
            None => first = Some((global, per)),
            Some((g, p)) => {
                assert_eq!(g.to_bits(), global.to_bits(), "paths differ");
                assert_eq!(p, &per, "paths differ");
            }
        }
    }
}

#[test]
fn the_global_norm_does_not_depend_on_the_thread_count() {
    let mut rng = Rng(12);
    // Enough elements for many leaves: 3 tensors over 64 Ki plus small ones.
    let mut ts = mixed(&mut rng);
    ts.push(Owned::new(Dtype::F32, &rng.vec(5 * 65536 + 3, -20, 20)));
    let grads = views(&ts);
    for isa in Isa::supported() {
        let norms: Vec<u32> = [1, 2, 3, 5]
            .iter()
            .map(|&n| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap();
                pool.install(|| global_l2_norm_with(isa, &grads, 1.0).to_bits())
            })
            .collect();
        assert!(norms.iter().all(|&b| b == norms[0]), "{isa:?}: {norms:?}");
    }
}

#[test]
fn a_nan_gives_nan_and_an_infinity_gives_infinity() {
    for isa in Isa::supported() {
        for dtype in DTYPES {
            let mut ts = vec![Owned::new(dtype, &[1.0; 17]), Owned::new(dtype, &[1.0; 17])];
            ts[1].set(16, f32::INFINITY);
            assert_eq!(global_l2_norm_with(isa, &views(&ts), 1.0), f32::INFINITY);
            ts[0].set(0, f32::NAN);
            assert!(global_l2_norm_with(isa, &views(&ts), 1.0).is_nan());
        }
    }
}

#[test]
fn known_values_empty_tensors_and_no_f32_overflow_of_squares() {
    for isa in Isa::supported() {
        let x = [3.0f32, 4.0];
        assert_eq!(global_l2_norm_with(isa, &[GradSlice::F32(&x)], 1.0), 5.0);
        assert_eq!(global_l2_norm_with(isa, &[GradSlice::F32(&x)], -0.5), 2.5);
        assert_eq!(global_l2_norm_with(isa, &[], 1.0), 0.0);
        assert_eq!(global_l2_norm_with(isa, &[GradSlice::F32(&[])], 1.0), 0.0);
        // 1e30² overflows f32 but not the f64 accumulator; the unscaled norm is finite.
        let big = [1e30f32; 4];
        assert_eq!(global_l2_norm_with(isa, &[GradSlice::F32(&big)], 1e-10), 2e20);
    }
}

#[test]
fn clip_coefficient_follows_torch() {
    assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
    assert!((clip_coefficient(4.0, 1.0) - 0.25).abs() < 1e-7);
    assert_eq!(clip_coefficient(f32::INFINITY, 1.0), 0.0);
    assert!(clip_coefficient(f32::NAN, 1.0).is_nan());
}
