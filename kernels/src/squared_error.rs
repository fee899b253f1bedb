//! The squared error of a prediction against a target, for the mean squared error loss: its sum and
//! its gradient, each in one pass over f32, f16 or bf16 elements (the two operands may differ).
//!
//! The sum squares each difference and adds it in f64: the differences are the f32 differences of the
//! widened values (as an f32 subtraction computes them), each square and the running sum exact to
//! f64's rounding, so the only f32 rounding in the loss is the final one. Work splits into fixed
//! chunks on the current rayon pool whose f64 partial sums are added in chunk order: the same bits on
//! every thread count.

use rayon::prelude::*;

use crate::slices::Float;
use crate::{GradSlice, GradSliceMut};

/// Elements per parallel chunk.
const CHUNK: usize = 16 * 1024;
/// Elements widened at a time (stack buffers).
const BLOCK: usize = 256;

/// `sum((p - t)^2)` with `p - t` in f32 and the squares summed in f64.
///
/// # Panics
/// If the lengths differ.
#[must_use]
pub fn sum(p: GradSlice<'_>, t: GradSlice<'_>) -> f64 {
    assert_eq!(p.len(), t.len(), "squared error: prediction and target lengths");
    match p {
        GradSlice::F32(p) => sum_from(p, t),
        GradSlice::F16(p) => sum_from(p, t),
        GradSlice::Bf16(p) => sum_from(p, t),
    }
}

/// `dp = scale * (p - t)`, computed in f32 and rounded once to `dp`'s dtype (the prediction's).
///
/// # Panics
/// If the lengths differ.
pub fn gradient(p: GradSlice<'_>, t: GradSlice<'_>, scale: f32, dp: GradSliceMut<'_>) {
    assert_eq!((p.len(), t.len()), (dp.len(), dp.len()), "squared error: p, t and dp lengths");
    match dp {
        GradSliceMut::F32(dp) => gradient_into(p, t, scale, dp),
        GradSliceMut::F16(dp) => gradient_into(p, t, scale, dp),
        GradSliceMut::Bf16(dp) => gradient_into(p, t, scale, dp),
    }
}

fn sum_from<P: Float>(p: &[P], t: GradSlice<'_>) -> f64 {
    match t {
        GradSlice::F32(t) => sum_of(p, t),
        GradSlice::F16(t) => sum_of(p, t),
        GradSlice::Bf16(t) => sum_of(p, t),
    }
}

fn sum_of<P: Float, T: Float>(p: &[P], t: &[T]) -> f64 {
    let partials: Vec<f64> = p
        .par_chunks(CHUNK)
        .zip(t.par_chunks(CHUNK))
        .map(|(p, t)| {
            let (mut wp, mut wt) = ([0f32; BLOCK], [0f32; BLOCK]);
            let mut total = 0f64;
            for (p, t) in p.chunks(BLOCK).zip(t.chunks(BLOCK)) {
                let n = p.len();
                P::widen(p, &mut wp[..n]);
                T::widen(t, &mut wt[..n]);
                total += block_sum(&wp[..n], &wt[..n]);
            }
            total
        })
        .collect();
    partials.iter().sum()
}

fn gradient_into<D: Float>(p: GradSlice<'_>, t: GradSlice<'_>, scale: f32, dp: &mut [D]) {
    // Widened whole: each chunk reads its part of both through `widen_range`.
    dp.par_chunks_mut(CHUNK).enumerate().for_each(|(c, dp)| {
        let (mut wp, mut wt, mut out) = ([0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK]);
        for (b, dp) in dp.chunks_mut(BLOCK).enumerate() {
            let (start, n) = (c * CHUNK + b * BLOCK, dp.len());
            widen_range(p, start, &mut wp[..n]);
            widen_range(t, start, &mut wt[..n]);
            scaled_difference(&wp[..n], &wt[..n], scale, &mut out[..n]);
            D::narrow(&out[..n], dp);
        }
    });
}

/// `dst` = the elements of `src` from `start`, widened to f32.
fn widen_range(src: GradSlice<'_>, start: usize, dst: &mut [f32]) {
    let end = start + dst.len();
    match src {
        GradSlice::F32(s) => f32::widen(&s[start..end], dst),
        GradSlice::F16(s) => Float::widen(&s[start..end], dst),
        GradSlice::Bf16(s) => Float::widen(&s[start..end], dst),
    }
}

widest_vectors! {
    /// `out = scale * (p - t)` for a block.
    fn scaled_difference(p: &[f32], t: &[f32], scale: f32, out: &mut [f32]) => scaled_difference_any;
}

#[inline(always)]
fn scaled_difference_any(p: &[f32], t: &[f32], scale: f32, out: &mut [f32]) {
    for ((out, &p), &t) in out.iter_mut().zip(p).zip(t) {
        *out = scale * (p - t);
    }
}

/// `sum((p - t)^2)` of a block, each difference in f32, squared and summed in f64 in element order
/// within each of 8 lanes, the lanes added last.
fn block_sum(p: &[f32], t: &[f32]) -> f64 {
    let mut out = [0f64; 8];
    lanes_sum(p, t, &mut out);
    out.iter().sum()
}

widest_vectors! {
    /// Per-lane sums of squared differences: element `i` goes to lane `i % 8`.
    fn lanes_sum(p: &[f32], t: &[f32], lanes: &mut [f64; 8]) => lanes_sum_any;
}

#[inline(always)]
fn lanes_sum_any(p: &[f32], t: &[f32], lanes: &mut [f64; 8]) {
    let (pc, tc) = (p.chunks_exact(8), t.chunks_exact(8));
    let (pr, tr) = (pc.remainder(), tc.remainder());
    for (p, t) in pc.zip(tc) {
        for l in 0..8 {
            let d = f64::from(p[l] - t[l]);
            lanes[l] += d * d;
        }
    }
    for (l, (&p, &t)) in pr.iter().zip(tr).enumerate() {
        let d = f64::from(p - t);
        lanes[l] += d * d;
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7919 + seed * 104_729) % 4001) as f32 / 250.0 - 8.0).collect()
    }

    #[test]
    fn sum_is_within_f64_rounding_of_the_exact_sum_and_independent_of_threads() {
        for n in [1, 7, BLOCK + 3, CHUNK + 1, 3 * CHUNK + BLOCK + 5] {
            let (p, t) = (values(n, 1), values(n, 2));
            let got = sum(GradSlice::F32(&p), GradSlice::F32(&t));
            // The reference squares the same f32 differences exactly (f64 holds their squares) and sums
            // them in another order: only f64's rounding of the sums separates the two.
            let want: f64 = p.iter().zip(&t).map(|(&p, &t)| f64::from(p - t).powi(2)).sum();
            assert!((got - want).abs() <= want * n as f64 * f64::EPSILON, "n {n}: {got} vs {want}");
            let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
            let alone = one.install(|| sum(GradSlice::F32(&p), GradSlice::F32(&t)));
            assert_eq!(got.to_bits(), alone.to_bits(), "n {n}: thread count changed the sum");
        }
    }

    #[test]
    fn gradient_is_the_scaled_f32_difference_rounded_once_in_every_dtype() {
        let n = CHUNK + 2 * BLOCK + 9;
        let (p, t) = (values(n, 3), values(n, 4));
        let mut dp = vec![0f32; n];
        gradient(GradSlice::F32(&p), GradSlice::F32(&t), 0.125, GradSliceMut::F32(&mut dp));
        for i in 0..n {
            assert_eq!(dp[i].to_bits(), (0.125 * (p[i] - t[i])).to_bits(), "[{i}]");
        }
        // A bf16 prediction against an f16 target: the gradient in bf16.
        let pb: Vec<bf16> = p.iter().map(|&v| bf16::from_f32(v)).collect();
        let th: Vec<f16> = t.iter().map(|&v| f16::from_f32(v)).collect();
        let mut db = vec![bf16::ZERO; n];
        gradient(GradSlice::Bf16(&pb), GradSlice::F16(&th), -3.0, GradSliceMut::Bf16(&mut db));
        for i in 0..n {
            assert_eq!(db[i], bf16::from_f32(-3.0 * (pb[i].to_f32() - th[i].to_f32())), "[{i}]");
        }
        let s = sum(GradSlice::Bf16(&pb), GradSlice::F16(&th));
        let want: f64 = pb.iter().zip(&th).map(|(p, t)| f64::from(p.to_f32() - t.to_f32()).powi(2)).sum();
        assert!((s - want).abs() <= want * 1e-12);
    }
}
