//! RMS normalisation over the last dimension of a row-major `rows x d` matrix, forward and backward in
//! one pass each, in f32 with the mean square accumulated in f64:
//!
//! `y = x * rstd * weight`, `rstd = 1 / sqrt(mean(x^2) + eps)` (as PyTorch's `RMSNorm` and candle-nn's
//! `rms_norm`). Backward, with `xhat = x * rstd` and `g = dy * weight`:
//! `dx = rstd * (g - xhat * mean(g * xhat))`, `dweight = sum over rows of dy * xhat`.
//!
//! These are [`crate::layer_norm`]'s passes with the mean taken as zero: the same blocks, lanes and
//! summation order, so the same determinism (independent of the thread count, the same bits on every
//! vector width). The squares are summed in f64, where no square of an f32 overflows: a row of values
//! beyond `sqrt(f32::MAX)` (about 1.8e19) is normalised as any other, where a mean of f32 squares would
//! be infinite and the row would come out as zeros.

use crate::layer_norm::{Rows, Statistics};
use crate::{GradSlice, GradSliceMut};

/// The forward pass into a new vector: `y` (`rows * d`) from `x` (f32, f16 or bf16, widened exactly).
///
/// # Panics
/// If a length does not match `rows` and `d`.
pub fn forward_new(x: GradSlice<'_>, d: usize, weight: &[f32], eps: f32) -> Vec<f32> {
    Rows::new(Statistics::MeanSquare, d, weight, None, eps).forward_new(x)
}

/// The forward pass into `y` of any of f32, f16 and bf16: each row computed in f32 as [`forward_new`]
/// computes it, then rounded to `y`'s dtype (to nearest even).
///
/// # Panics
/// If a length does not match `rows` and `d`.
pub fn forward_into(x: GradSlice<'_>, d: usize, weight: &[f32], eps: f32, y: GradSliceMut<'_>) {
    Rows::new(Statistics::MeanSquare, d, weight, None, eps).forward_into(x, y);
}

/// The backward pass: `dx` (`rows * d`) and `dweight` (`d`, overwritten) from `x` and the output
/// gradient `dy`.
///
/// # Panics
/// If a length does not match `rows` and `d`.
pub fn backward(
    x: GradSlice<'_>,
    dy: GradSlice<'_>,
    d: usize,
    weight: &[f32],
    eps: f32,
    dx: &mut [f32],
    dweight: &mut [f32],
) {
    // The passes also sum what would be a bias's gradient; an RMS norm has none.
    let mut unused_dbias = vec![0f32; d];
    Rows::new(Statistics::MeanSquare, d, weight, None, eps).backward(x, dy, dx, dweight, &mut unused_dbias);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f64 RMS norm and its gradients, from the definition.
    fn reference(x: &[f32], dy: &[f32], d: usize, w: &[f32], eps: f64) -> [Vec<f64>; 3] {
        let (mut y, mut dx, mut dw) = (vec![0.0; x.len()], vec![0.0; x.len()], vec![0.0; d]);
        for r in 0..x.len() / d {
            let row: Vec<f64> = x[r * d..][..d].iter().map(|&v| f64::from(v)).collect();
            let rstd = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
            let xhat: Vec<f64> = row.iter().map(|v| v * rstd).collect();
            let g: Vec<f64> = (0..d).map(|j| f64::from(dy[r * d + j]) * f64::from(w[j])).collect();
            let mean_gx = g.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / d as f64;
            for j in 0..d {
                y[r * d + j] = xhat[j] * f64::from(w[j]);
                dx[r * d + j] = rstd * (g[j] - xhat[j] * mean_gx);
                dw[j] += f64::from(dy[r * d + j]) * xhat[j];
            }
        }
        [y, dx, dw]
    }

    fn values(n: usize, seed: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.5 - 1.0) * scale).collect()
    }

    /// Forward and both gradients within a few f32 roundings of the f64 reference, relative to the
    /// row's scale: every output is a short chain of f32 operations on values of order one
    /// (|xhat| <= sqrt(d)) after an f64 mean square, and the weight gradient an f32 sum over `rows`
    /// terms. Rows of every magnitude f32 holds, past the 1.8e19 whose squares overflow f32, give the
    /// same normalised values: RMS norm is invariant to the row's scale (but for eps).
    #[test]
    fn matches_the_f64_definition_at_every_magnitude() {
        let u = f64::from(f32::EPSILON);
        for (rows, d) in [(1, 1), (3, 7), (70, 256), (33, 1000)] {
            let dy = values(rows * d, 2, 1.0);
            let w = values(d, 3, 2.0);
            let scale = (d as f64).sqrt();
            for magnitude in [1e-3f32, 3.0, 1e19, 4e19, 1e30] {
                let x = values(rows * d, 1, magnitude);
                let eps = 1e-5;
                let [ry, rdx, rdw] = reference(&x, &dy, d, &w, f64::from(eps));
                let y = forward_new(GradSlice::F32(&x), d, &w, eps);
                let (mut dx, mut dw) = (vec![0f32; rows * d], vec![f32::NAN; d]);
                backward(GradSlice::F32(&x), GradSlice::F32(&dy), d, &w, eps, &mut dx, &mut dw);
                // dx scales as 1 / magnitude.
                let dx_scale = 10.0 * 3.0 * scale / f64::from(magnitude).max(1e-2);
                let close = |got: &[f32], want: &[f64], tol: f64, what: &str| {
                    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                        let ok = (f64::from(g) - w).abs() <= tol;
                        assert!(ok, "{what} {rows}x{d} at {magnitude:e} [{i}]: {g} vs {w}");
                    }
                };
                close(&y, &ry, 16.0 * u * 2.0 * scale, "y");
                close(&dx, &rdx, 64.0 * u * dx_scale, "dx");
                close(&dw, &rdw, 4.0 * u * rows as f64 * 2.0 * scale, "dweight");
            }
        }
    }

    /// The layer norm's passes with the mean taken as zero: a row of mean zero (every value with its
    /// negation) gives a layer norm's output without a bias, bit for bit, and a half output is the f32
    /// one rounded.
    #[test]
    fn a_row_of_mean_zero_is_normalised_as_a_layer_norm_does() {
        use half::bf16;
        let d = 64;
        let half_row = values(d / 2, 4, 3.0);
        let row: Vec<f32> = half_row
            .iter()
            .chain(&half_row)
            .enumerate()
            .map(|(j, &v)| if j < d / 2 { v } else { -v })
            .collect();
        let x: Vec<f32> = row.iter().chain(&row).copied().collect();
        let w = values(d, 5, 1.0);
        let rms = forward_new(GradSlice::F32(&x), d, &w, 1e-5);
        let layer = crate::layer_norm::forward_new(GradSlice::F32(&x), d, &w, None, 1e-5);
        // The row's f64 sum is exactly zero (each lane adds a few f32 values and their negations), so
        // the layer norm subtracts an exact zero: the same bits.
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&rms), bits(&layer));
        let mut halves = vec![bf16::ZERO; x.len()];
        forward_into(GradSlice::F32(&x), d, &w, 1e-5, GradSliceMut::Bf16(&mut halves));
        for (h, v) in halves.iter().zip(&rms) {
            assert_eq!(h.to_bits(), bf16::from_f32(*v).to_bits());
        }
    }
}
