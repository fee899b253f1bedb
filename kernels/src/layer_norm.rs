//! Layer normalisation over the last dimension of a row-major `rows x d` matrix, forward and backward
//! in one pass each, in f32 with the row statistics accumulated in f64:
//!
//! `y = (x - mean) * rstd * weight + bias`, `rstd = 1 / sqrt(var + eps)` (the biased variance, as
//! PyTorch and candle-nn). Backward, with `xhat = (x - mean) * rstd` and `g = dy * weight`:
//! `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`, `dweight = sum over rows of dy * xhat`,
//! `dbias = sum over rows of dy`.
//!
//! Rows are split into fixed blocks run on the current rayon pool; the weight and bias gradients are
//! summed within each block in row order, then across blocks in block order, so every result is
//! deterministic and independent of the thread count. A row's f64 sums run in eight lanes added in a
//! fixed order, and its loops are compiled for the widest vector extension the CPU has
//! (`widest_vectors!`): every version computes the same bits. (Summed one element at a time, the f64
//! statistics kept the loops scalar: forward 3x and backward 1.9x slower on a `(1024, 256)` matrix.)
//!
//! The same passes compute an RMS norm ([`crate::rms_norm`]) with the mean taken as zero
//! (`Statistics::MeanSquare`). In f64 a square of any f32 cannot overflow, so a row of values beyond
//! `sqrt(f32::MAX)` (about 1.8e19) is normalised as any other; summed in f32 its variance would be
//! infinite and the row would come out as zeros.

use half::bf16;
use rayon::prelude::*;

use crate::lanes::lane_sum;
use crate::slices::Float;
use crate::{GradSlice, GradSliceMut};

/// Rows per block of the work split.
const ROWS_PER_BLOCK: usize = 32;

/// What a row is normalised by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Statistics {
    /// A layer norm's: the row's mean is subtracted and its biased variance divides.
    MeanAndVariance,
    /// An RMS norm's: nothing is subtracted (the mean is taken as zero) and the mean of the squares
    /// divides.
    MeanSquare,
}

/// The forward pass: `y` (`rows * d`) from `x` (f32, f16 or bf16, widened exactly).
///
/// # Panics
/// If a length does not match `rows` and `d`.
pub fn forward(x: GradSlice<'_>, d: usize, weight: &[f32], bias: Option<&[f32]>, eps: f32, y: &mut [f32]) {
    Rows::new(Statistics::MeanAndVariance, d, weight, bias, eps).forward(x, y);
}

/// [`forward`] into a new vector, written block by block in parallel ([`crate::fresh`]).
///
/// # Panics
/// As [`forward`].
pub fn forward_new(x: GradSlice<'_>, d: usize, weight: &[f32], bias: Option<&[f32]>, eps: f32) -> Vec<f32> {
    Rows::new(Statistics::MeanAndVariance, d, weight, bias, eps).forward_new(x)
}

/// The forward pass into `y` of any of f32, f16 and bf16: each row computed in f32 as [`forward`]
/// computes it, then rounded to `y`'s dtype (to nearest even), for a consumer that reads it in that
/// precision (a product that would round the f32 row as it reads it reads the same values).
///
/// # Panics
/// As [`forward`].
pub fn forward_into(
    x: GradSlice<'_>,
    d: usize,
    weight: &[f32],
    bias: Option<&[f32]>,
    eps: f32,
    y: GradSliceMut<'_>,
) {
    Rows::new(Statistics::MeanAndVariance, d, weight, bias, eps).forward_into(x, y);
}

/// The backward pass: `dx` (`rows * d`), `dweight` and `dbias` (`d` each, overwritten) from `x` and
/// the output gradient `dy`.
///
/// # Panics
/// If a length does not match `rows` and `d`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    x: GradSlice<'_>,
    dy: GradSlice<'_>,
    d: usize,
    weight: &[f32],
    eps: f32,
    dx: &mut [f32],
    dweight: &mut [f32],
    dbias: &mut [f32],
) {
    Rows::new(Statistics::MeanAndVariance, d, weight, None, eps).backward(x, dy, dx, dweight, dbias);
}

/// A normalisation of rows of `d` values: its statistics, weight, bias and `eps`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rows<'a> {
    statistics: Statistics,
    d: usize,
    weight: &'a [f32],
    bias: Option<&'a [f32]>,
    eps: f32,
}

impl<'a> Rows<'a> {
    /// # Panics
    /// If the weight or the bias is not `d` long.
    pub(crate) fn new(
        statistics: Statistics,
        d: usize,
        weight: &'a [f32],
        bias: Option<&'a [f32]>,
        eps: f32,
    ) -> Self {
        assert_eq!(weight.len(), d, "layer_norm: weight length");
        assert!(bias.is_none_or(|b| b.len() == d), "layer_norm: bias length");
        Rows { statistics, d, weight, bias, eps }
    }

    /// Panics unless `len` is whole rows (a partial last row would be left out without a word).
    fn assert_whole_rows(self, len: usize) {
        let d = self.d;
        assert!(d == 0 || len.is_multiple_of(d), "layer_norm: a length of {len} is not whole rows of {d}");
    }

    /// The forward pass into `y`.
    pub(crate) fn forward(self, x: GradSlice<'_>, y: &mut [f32]) {
        assert_eq!(x.len(), y.len(), "layer_norm: x and y lengths");
        self.assert_whole_rows(x.len());
        if self.d == 0 {
            return;
        }
        y.par_chunks_mut(self.d * ROWS_PER_BLOCK).enumerate().for_each(|(block, ys)| {
            self.forward_rows(x, block * ROWS_PER_BLOCK, ys);
        });
    }

    /// The forward pass into a new vector.
    pub(crate) fn forward_new(self, x: GradSlice<'_>) -> Vec<f32> {
        self.assert_whole_rows(x.len());
        if self.d == 0 {
            return vec![0.0; x.len()];
        }
        crate::fresh::written_in_blocks(x.len(), self.d * ROWS_PER_BLOCK, |start, ys| {
            self.forward_rows(x, start / self.d, ys);
        })
    }

    /// The forward pass into `y` of any of f32, f16 and bf16, each row rounded once.
    pub(crate) fn forward_into(self, x: GradSlice<'_>, y: GradSliceMut<'_>) {
        match y {
            GradSliceMut::F32(y) => self.forward(x, y),
            GradSliceMut::F16(y) => self.forward_rounded(x, y),
            GradSliceMut::Bf16(y) => self.forward_rounded(x, y),
        }
    }

    fn forward_rounded<T: Float>(self, x: GradSlice<'_>, y: &mut [T]) {
        assert_eq!(x.len(), y.len(), "layer_norm: x and y lengths");
        self.assert_whole_rows(x.len());
        let Rows { statistics, d, weight, bias, eps } = self;
        if d == 0 {
            return;
        }
        y.par_chunks_mut(d * ROWS_PER_BLOCK).enumerate().for_each(|(block, ys)| {
            let (mut row, mut out) = (vec![0f32; d], vec![0f32; d]);
            for (i, y) in ys.chunks_exact_mut(d).enumerate() {
                let at = (block * ROWS_PER_BLOCK + i) * d;
                forward_row(statistics, widen_row(x, at, &mut row), weight, bias, eps, &mut out);
                T::narrow(&out, y);
            }
        });
    }

    /// Rows `first..` of the forward pass into `ys` (whole rows).
    fn forward_rows(self, x: GradSlice<'_>, first: usize, ys: &mut [f32]) {
        let Rows { statistics, d, weight, bias, eps } = self;
        let mut row = vec![0f32; d];
        for (i, y) in ys.chunks_exact_mut(d).enumerate() {
            forward_row(statistics, widen_row(x, (first + i) * d, &mut row), weight, bias, eps, y);
        }
    }

    /// The backward pass: `dx`, and `dweight` and `dbias` (`d` each, overwritten; the bias's whether
    /// or not the norm has one).
    pub(crate) fn backward(
        self,
        x: GradSlice<'_>,
        dy: GradSlice<'_>,
        dx: &mut [f32],
        dweight: &mut [f32],
        dbias: &mut [f32],
    ) {
        let Rows { statistics, d, weight, eps, .. } = self;
        assert_eq!((dweight.len(), dbias.len()), (d, d), "layer_norm: gradient lengths");
        assert_eq!((x.len(), dy.len()), (dx.len(), dx.len()), "layer_norm: x, dy and dx lengths");
        self.assert_whole_rows(x.len());
        dweight.fill(0.0);
        dbias.fill(0.0);
        if d == 0 {
            return;
        }
        // Each block: its rows' dx, and its partial weight and bias gradients.
        let partials: Vec<Vec<f32>> = dx
            .par_chunks_mut(d * ROWS_PER_BLOCK)
            .enumerate()
            .map(|(block, dxs)| {
                let first = block * ROWS_PER_BLOCK;
                let (mut row, mut grad) = (vec![0f32; d], vec![0f32; d]);
                let mut sums = vec![0f32; 2 * d];
                for (i, dx) in dxs.chunks_exact_mut(d).enumerate() {
                    let at = (first + i) * d;
                    let (row, grad) = (widen_row(x, at, &mut row), widen_row(dy, at, &mut grad));
                    backward_row(statistics, row, grad, weight, eps, dx, &mut sums);
                }
                sums
            })
            .collect();
        for sums in &partials {
            for (acc, &s) in dweight.iter_mut().zip(&sums[..d]) {
                *acc += s;
            }
            for (acc, &s) in dbias.iter_mut().zip(&sums[d..]) {
                *acc += s;
            }
        }
    }
}

widest_vectors! {
    /// One row of the forward pass.
    fn forward_row(statistics: Statistics, row: &[f32], weight: &[f32], bias: Option<&[f32]>, eps: f32, y: &mut [f32]) => forward_row_any;
}

#[inline(always)]
fn forward_row_any(
    statistics: Statistics,
    row: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    eps: f32,
    y: &mut [f32],
) {
    let (mean, rstd) = stats(statistics, row, eps);
    let d = row.len();
    let (weight, y) = (&weight[..d], &mut y[..d]);
    match bias {
        Some(bias) => {
            let bias = &bias[..d];
            for j in 0..d {
                y[j] = (row[j] - mean) * rstd * weight[j] + bias[j];
            }
        }
        None => {
            for j in 0..d {
                y[j] = (row[j] - mean) * rstd * weight[j] + 0.0;
            }
        }
    }
}

widest_vectors! {
    /// One row of the backward pass: its `dx`, and its terms added to the block's weight and bias
    /// gradients (`sums`: `d` of each).
    fn backward_row(statistics: Statistics, row: &[f32], grad: &[f32], weight: &[f32], eps: f32, dx: &mut [f32], sums: &mut [f32]) => backward_row_any;
}

#[inline(always)]
fn backward_row_any(
    statistics: Statistics,
    row: &[f32],
    grad: &[f32],
    weight: &[f32],
    eps: f32,
    dx: &mut [f32],
    sums: &mut [f32],
) {
    let d = row.len();
    let (grad, weight, dx) = (&grad[..d], &weight[..d], &mut dx[..d]);
    let (dweight, dbias) = sums.split_at_mut(d);
    let (dweight, dbias) = (&mut dweight[..d], &mut dbias[..d]);
    let (mean, rstd) = stats(statistics, row, eps);
    // dx first holds g * xhat, to be summed.
    for j in 0..d {
        let xhat = (row[j] - mean) * rstd;
        dweight[j] += grad[j] * xhat;
        dbias[j] += grad[j];
        dx[j] = grad[j] * weight[j] * xhat;
    }
    // Without a mean subtracted in the forward pass, no mean of `g` is subtracted here.
    let sum_g = match statistics {
        Statistics::MeanAndVariance => lane_sum(grad, weight, |g, w| f64::from(g * w)),
        Statistics::MeanSquare => 0.0,
    };
    let sum_gx = lane_sum(dx, dx, |gx, _| f64::from(gx));
    let (mean_g, mean_gx) = ((sum_g / d as f64) as f32, (sum_gx / d as f64) as f32);
    for j in 0..d {
        let xhat = (row[j] - mean) * rstd;
        dx[j] = rstd * (grad[j] * weight[j] - mean_g - xhat * mean_gx);
    }
}

/// The row of `d = buffer.len()` elements from `at` of `x` as f32: where it lies when `x` is f32,
/// else widened into `buffer`.
fn widen_row<'a>(x: GradSlice<'a>, at: usize, buffer: &'a mut [f32]) -> &'a [f32] {
    let d = buffer.len();
    match x {
        GradSlice::F32(s) => return &s[at..at + d],
        GradSlice::F16(s) => {
            buffer.iter_mut().zip(&s[at..at + d]).for_each(|(o, v)| *o = crate::branchless::f16_to_f32(*v))
        }
        GradSlice::Bf16(s) => buffer.iter_mut().zip(&s[at..at + d]).for_each(|(o, v)| *o = bf16::to_f32(*v)),
    }
    buffer
}

/// A row's mean (zero for [`Statistics::MeanSquare`]) and `1 / sqrt(var + eps)`, with `var` the mean
/// square of the values less the mean, accumulated in f64 (two passes for a layer norm).
#[inline(always)]
fn stats(statistics: Statistics, row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len();
    let mean = match statistics {
        Statistics::MeanAndVariance => lane_sum(row, row, |x, _| f64::from(x)) / n as f64,
        Statistics::MeanSquare => 0.0,
    };
    let var = lane_sum(row, row, |x, _| {
        let centred = f64::from(x) - mean;
        centred * centred
    }) / n as f64;
    (mean as f32, (1.0 / (var + f64::from(eps)).sqrt()) as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f64 layer norm and its gradients, from the definition.
    fn reference(x: &[f32], dy: &[f32], d: usize, w: &[f32], b: &[f32], eps: f64) -> [Vec<f64>; 4] {
        let rows = x.len() / d;
        let (mut y, mut dx, mut dw, mut db) =
            (vec![0.0; x.len()], vec![0.0; x.len()], vec![0.0; d], vec![0.0; d]);
        for r in 0..rows {
            let row: Vec<f64> = x[r * d..][..d].iter().map(|&v| f64::from(v)).collect();
            let mean = row.iter().sum::<f64>() / d as f64;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
            let rstd = 1.0 / (var + eps).sqrt();
            let xhat: Vec<f64> = row.iter().map(|v| (v - mean) * rstd).collect();
            let g: Vec<f64> = (0..d).map(|j| f64::from(dy[r * d + j]) * f64::from(w[j])).collect();
            let mean_g = g.iter().sum::<f64>() / d as f64;
            let mean_gx = g.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / d as f64;
            for j in 0..d {
                y[r * d + j] = xhat[j] * f64::from(w[j]) + f64::from(b[j]);
                dx[r * d + j] = rstd * (g[j] - mean_g - xhat[j] * mean_gx);
                dw[j] += f64::from(dy[r * d + j]) * xhat[j];
                db[j] += f64::from(dy[r * d + j]);
            }
        }
        [y, dx, dw, db]
    }

    fn values(n: usize, seed: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.5 - 1.0) * scale).collect()
    }

    /// Forward and all three gradients within a few f32 roundings of the f64 reference: each output is
    /// a short chain of f32 operations on values of order one (|xhat| <= sqrt(d)), the row statistics
    /// are f64, and the weight and bias gradients are f32 sums over `rows` terms (their bound scales
    /// with the sum of the terms' magnitudes).
    #[test]
    fn matches_the_f64_definition() {
        for (rows, d) in [(1, 1), (3, 7), (70, 256), (33, 1000)] {
            let (x, dy) = (values(rows * d, 1, 3.0), values(rows * d, 2, 1.0));
            let (w, b) = (values(d, 3, 2.0), values(d, 4, 0.5));
            let eps = 1e-5;
            let [ry, rdx, rdw, rdb] = reference(&x, &dy, d, &w, &b, f64::from(eps));
            let mut y = vec![0f32; rows * d];
            forward(GradSlice::F32(&x), d, &w, Some(&b), eps, &mut y);
            let (mut dx, mut dw, mut db) = (vec![0f32; rows * d], vec![0f32; d], vec![0f32; d]);
            backward(GradSlice::F32(&x), GradSlice::F32(&dy), d, &w, eps, &mut dx, &mut dw, &mut db);
            let u = f64::from(f32::EPSILON);
            let close = |got: &[f32], want: &[f64], tol: f64, what: &str| {
                for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                    assert!((f64::from(g) - w).abs() <= tol, "{what} {rows}x{d} [{i}]: {g} vs {w}");
                }
            };
            let scale = (d as f64).sqrt();
            close(&y, &ry, 16.0 * u * 3.0 * scale, "y");
            close(&dx, &rdx, 64.0 * u * 3.0 * scale * 10.0, "dx");
            let sum_abs = rows as f64 * 2.0 * scale;
            close(&dw, &rdw, 4.0 * u * sum_abs, "dweight");
            close(&db, &rdb, 4.0 * u * rows as f64, "dbias");
        }
    }

    #[test]
    fn half_inputs_are_widened_exactly() {
        let (rows, d) = (5, 40);
        let x = values(rows * d, 5, 4.0);
        let halves: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let widened: Vec<f32> = halves.iter().map(|v| v.to_f32()).collect();
        let w = vec![1.0; d];
        let (mut a, mut b) = (vec![0f32; rows * d], vec![0f32; rows * d]);
        forward(GradSlice::Bf16(&halves), d, &w, None, 1e-5, &mut a);
        forward(GradSlice::F32(&widened), d, &w, None, 1e-5, &mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn a_new_output_is_bit_for_bit_the_written_one() {
        for (rows, d) in [(0, 4), (1, 1), (3, 7), (70, 256), (33, 1000)] {
            let (x, w, b) = (values(rows * d, 3, 4.0), values(d, 4, 1.0), values(d, 5, 0.5));
            let mut y = vec![f32::NAN; rows * d];
            forward(GradSlice::F32(&x), d, &w, Some(&b), 1e-5, &mut y);
            let fresh = forward_new(GradSlice::F32(&x), d, &w, Some(&b), 1e-5);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fresh), bits(&y), "{rows} x {d}");
        }
    }

    #[test]
    fn a_half_output_is_the_f32_one_rounded_to_nearest_even() {
        use half::f16;
        for (rows, d) in [(0, 4), (1, 1), (3, 7), (70, 256), (33, 1000)] {
            let (x, w, b) = (values(rows * d, 6, 4.0), values(d, 7, 1.0), values(d, 8, 0.5));
            let y = forward_new(GradSlice::F32(&x), d, &w, Some(&b), 1e-5);
            let mut as_f32 = vec![0f32; rows * d];
            let (mut as_bf16, mut as_f16) = (vec![bf16::ZERO; rows * d], vec![f16::ZERO; rows * d]);
            forward_into(GradSlice::F32(&x), d, &w, Some(&b), 1e-5, GradSliceMut::F32(&mut as_f32));
            forward_into(GradSlice::F32(&x), d, &w, Some(&b), 1e-5, GradSliceMut::Bf16(&mut as_bf16));
            forward_into(GradSlice::F32(&x), d, &w, Some(&b), 1e-5, GradSliceMut::F16(&mut as_f16));
            assert_eq!(
                as_f32.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
            for (i, &v) in y.iter().enumerate() {
                assert_eq!(as_bf16[i].to_bits(), bf16::from_f32(v).to_bits(), "bf16 {rows}x{d} [{i}]");
                assert_eq!(as_f16[i].to_bits(), f16::from_f32(v).to_bits(), "f16 {rows}x{d} [{i}]");
            }
        }
    }

    /// A length that is not whole rows is refused by every entry point (a partial last row was left
    /// out of `y`, `dx` and the weight gradients without a word).
    #[test]
    fn a_partial_row_is_refused() {
        let (x, w) = (vec![1.0f32; 10], vec![1.0f32; 3]);
        let refused = |f: &dyn Fn()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err();
        assert!(refused(&|| forward(GradSlice::F32(&x), 3, &w, None, 1e-5, &mut [0.0; 10])));
        assert!(refused(&|| drop(forward_new(GradSlice::F32(&x), 3, &w, None, 1e-5))));
        let into_halves = || {
            let mut halves = vec![bf16::ZERO; 10];
            forward_into(GradSlice::F32(&x), 3, &w, None, 1e-5, GradSliceMut::Bf16(&mut halves));
        };
        assert!(refused(&into_halves));
        let (mut dx, mut dw, mut db) = (vec![0.0; 10], vec![0.0; 3], vec![0.0; 3]);
        assert!(refused(&|| {
            let (dx, dw, db) = (&mut dx.clone(), &mut dw.clone(), &mut db.clone());
            backward(GradSlice::F32(&x), GradSlice::F32(&x), 3, &w, 1e-5, dx, dw, db);
        }));
        // Whole rows pass.
        backward(
            GradSlice::F32(&x[..9]),
            GradSlice::F32(&x[..9]),
            3,
            &w,
            1e-5,
            &mut dx[..9],
            &mut dw,
            &mut db,
        );
    }
}
