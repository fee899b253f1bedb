//! Softmax over the rows of a row-major `rows x cols` f32 matrix, forward and backward in one pass
//! each, with an optional scale and causal mask (attention's `softmax(scale * Q K^T + mask)`):
//!
//! `y_j = e^(v_j - m) / sum_k e^(v_k - m)` over the row's visible columns, `v_j = scale * x_j`,
//! `m = max_k v_k`; masked columns are 0. Backward, from the output `y` and its gradient `dy`:
//! `dx_j = scale * y_j * (dy_j - sum_k y_k dy_k)` (masked columns get 0, as their `y` is 0).
//!
//! The sums are accumulated in f64 (in eight lanes added in a fixed order, the maximum in sixteen: the
//! loops vectorise, and every version computes the same bits) and each result is rounded to f32 once;
//! `e^..` is [`crate::exp::exp_nonpositive`] (2 ulps), so a row is within a few f32 roundings of the f64
//! definition (`tests` states the bound). Non-finite inputs behave as the definition computed in f32:
//! `-inf` gives an exact 0, and a row with a NaN, a `+inf`, or no finite visible value is NaN.
//!
//! Rows are independent, split into fixed blocks on the current rayon pool: results do not depend on
//! the thread count.

use rayon::prelude::*;

use crate::exp::exp_nonpositive;
use crate::lanes::{lane_max, lane_sum};

/// Rows per block of the work split.
const ROWS_PER_BLOCK: usize = 32;

/// Which columns of a row take part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mask {
    /// Every column.
    None,
    /// Causal attention: the matrix is a stack of `(t_q, cols)` score matrices with `t_q =
    /// rows_per_matrix`, and query `i` (row `i` of its matrix) sees columns `j <= i`.
    Causal {
        /// Rows of one score matrix (`t_q`, at least 1).
        rows_per_matrix: usize,
    },
}

impl Mask {
    /// How many leading columns of row `row` are visible.
    fn visible(self, row: usize, cols: usize) -> usize {
        match self {
            Mask::None => cols,
            Mask::Causal { rows_per_matrix } => (row % rows_per_matrix.max(1) + 1).min(cols),
        }
    }
}

/// The forward pass: `y = softmax(scale * x)` row by row (`x` and `y` of `rows * cols` elements).
///
/// # Panics
/// If `x` and `y` differ in length or `cols` does not divide it.
pub fn forward(x: &[f32], cols: usize, scale: f32, mask: Mask, y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "softmax: x and y lengths");
    in_row_blocks(cols, y, |first, ys| forward_block(Some(x), cols, scale, mask, first, ys));
}

/// [`forward`] where the scores lie: `v` holds `x` and is overwritten with `y` (the same bits as
/// [`forward`]'s `y`), for a caller that has no further use for the scores.
///
/// # Panics
/// If `cols` does not divide `v`'s length.
pub fn forward_in_place(v: &mut [f32], cols: usize, scale: f32, mask: Mask) {
    in_row_blocks(cols, v, |first, ys| forward_block(None, cols, scale, mask, first, ys));
}

/// Runs `block(first_row, rows)` over `out`'s blocks of whole rows on the current rayon pool.
fn in_row_blocks(cols: usize, out: &mut [f32], block: impl Fn(usize, &mut [f32]) + Sync) {
    if cols == 0 {
        assert!(out.is_empty(), "softmax: rows of 0 columns cannot hold {} values", out.len());
        return;
    }
    assert_eq!(out.len() % cols, 0, "softmax: length not a multiple of cols");
    out.par_chunks_mut(cols * ROWS_PER_BLOCK)
        .enumerate()
        .for_each(|(b, rows)| block(b * ROWS_PER_BLOCK, rows));
}

widest_vectors! {
    /// Rows `first..` of `y` (whole rows), from `x` or, without one, from the scores `y` holds.
    fn forward_block(x: Option<&[f32]>, cols: usize, scale: f32, mask: Mask, first: usize, ys: &mut [f32])
        => forward_block_any;
}

#[inline(always)]
fn forward_block_any(x: Option<&[f32]>, cols: usize, scale: f32, mask: Mask, first: usize, ys: &mut [f32]) {
    for (i, y) in ys.chunks_exact_mut(cols).enumerate() {
        let row = first + i;
        let visible = mask.visible(row, cols);
        let (shown, hidden) = y.split_at_mut(visible);
        match x {
            Some(x) => {
                for (v, &x) in shown.iter_mut().zip(&x[row * cols..][..visible]) {
                    *v = scale * x;
                }
            }
            None => {
                for v in shown.iter_mut() {
                    *v *= scale;
                }
            }
        }
        forward_row(shown);
        hidden.fill(0.0);
    }
}

/// One row's visible part, `scale * x` on entry, its probabilities on return.
#[inline(always)]
fn forward_row(shown: &mut [f32]) {
    // `f32::max` skips NaN; a NaN still reaches the sum below through `v - m`.
    let max = lane_max(shown);
    for v in shown.iter_mut() {
        *v = exp_nonpositive(*v - max);
    }
    // In f64 lanes: a loop of its own, so that the one above vectorises.
    let sum = lane_sum(shown, shown, |v, _| f64::from(v));
    let inverse = 1.0 / sum;
    for v in shown.iter_mut() {
        *v = (f64::from(*v) * inverse) as f32;
    }
}

/// The backward pass: `dx` from the forward's output `y` and its gradient `dy` (all `rows * cols`
/// elements), for the `scale` the forward used. Masked columns need no mask here: their `y` is 0.
///
/// # Panics
/// If the lengths differ or `cols` does not divide them.
pub fn backward(y: &[f32], dy: &[f32], cols: usize, scale: f32, dx: &mut [f32]) {
    assert_eq!((y.len(), dy.len()), (dx.len(), dx.len()), "softmax: y, dy and dx lengths");
    in_row_blocks(cols, dx, |first, dxs| backward_block(y, Some(dy), cols, scale, first, dxs));
}

/// [`backward`] where the output's gradient lies: `g` holds `dy` and is overwritten with `dx` (the
/// same bits as [`backward`]'s `dx`).
///
/// # Panics
/// If `y` and `g` differ in length or `cols` does not divide it.
pub fn backward_in_place(y: &[f32], g: &mut [f32], cols: usize, scale: f32) {
    assert_eq!(y.len(), g.len(), "softmax: y and dy lengths");
    in_row_blocks(cols, g, |first, dxs| backward_block(y, None, cols, scale, first, dxs));
}

widest_vectors! {
    /// Rows `first..` of `dx` (whole rows), from `dy` or, without one, from the gradient `dx` holds.
    fn backward_block(y: &[f32], dy: Option<&[f32]>, cols: usize, scale: f32, first: usize, dxs: &mut [f32])
        => backward_block_any;
}

#[inline(always)]
fn backward_block_any(y: &[f32], dy: Option<&[f32]>, cols: usize, scale: f32, first: usize, dxs: &mut [f32]) {
    let scale = f64::from(scale);
    for (i, dx) in dxs.chunks_exact_mut(cols).enumerate() {
        let at = (first + i) * cols;
        let y = &y[at..][..cols];
        let gradient = |y: f32, g: f32, dot: f64| (scale * f64::from(y) * (f64::from(g) - dot)) as f32;
        match dy {
            Some(dy) => {
                let dy = &dy[at..][..cols];
                let dot = lane_sum(y, dy, |y, g| f64::from(y) * f64::from(g));
                for ((dx, &y), &g) in dx.iter_mut().zip(y).zip(dy) {
                    *dx = gradient(y, g, dot);
                }
            }
            None => {
                let dot = lane_sum(y, dx, |y, g| f64::from(y) * f64::from(g));
                for (dx, &y) in dx.iter_mut().zip(y) {
                    *dx = gradient(y, *dx, dot);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in `[-spread, spread]`.
    fn values(n: usize, seed: usize, spread: f32) -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.5 - 1.0) * spread).collect()
    }

    /// The f64 definition: `(y, v - m)` per element of the visible part, 0 elsewhere.
    fn reference(x: &[f32], cols: usize, scale: f32, mask: Mask) -> Vec<(f64, f64)> {
        let mut out = vec![(0.0, 0.0); x.len()];
        for (r, row) in x.chunks_exact(cols).enumerate() {
            let visible = mask.visible(r, cols);
            let v: Vec<f64> = row[..visible].iter().map(|&x| f64::from(scale) * f64::from(x)).collect();
            let m = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = v.iter().map(|v| (v - m).exp()).sum();
            for (j, v) in v.iter().enumerate() {
                out[r * cols + j] = ((v - m).exp() / sum, v - m);
            }
        }
        out
    }

    /// Each `y` is within `(8 + 4 |v - m|) 2^-24` relative of the f64 definition (the exp's 2 ulps
    /// and the final rounding; `scale * x` and `v - m` each rounded in f32, an absolute error of
    /// up to `|v - m| 2^-24` in the exponent, counted twice for the sum's share of it) plus 1.2e-38
    /// (results below f32's smallest normal number are flushed); masked entries are exactly 0.
    #[test]
    fn forward_matches_the_f64_definition() {
        let mut worst = 0f64;
        for (rows, cols) in [(1, 1), (3, 7), (130, 128), (40, 300), (5, 1000)] {
            for (scale, spread) in [(1.0, 1.0), (0.125, 40.0), (0.3, 8.0)] {
                for mask in [Mask::None, Mask::Causal { rows_per_matrix: rows.min(cols).max(1) }] {
                    let x = values(rows * cols, rows + cols, spread);
                    let mut y = vec![f32::NAN; x.len()];
                    forward(&x, cols, scale, mask, &mut y);
                    for (i, (&got, &(want, gap))) in
                        y.iter().zip(&reference(&x, cols, scale, mask)).enumerate()
                    {
                        let bound = (8.0 + 4.0 * gap.abs()) * 2f64.powi(-24) * want + 1.2e-38;
                        let err = (f64::from(got) - want).abs();
                        assert!(err <= bound, "{rows}x{cols} scale {scale} {mask:?} [{i}]: {got} vs {want}");
                        worst = worst.max(err / bound);
                    }
                    if let Mask::Causal { rows_per_matrix } = mask {
                        for (r, row) in y.chunks_exact(cols).enumerate() {
                            assert!(row[(r % rows_per_matrix + 1).min(cols)..].iter().all(|&v| v == 0.0));
                        }
                    }
                }
            }
        }
        assert!(worst > 0.01, "the bound is not loose by orders of magnitude: {worst}");
    }

    /// Given the forward's own `y`, each `dx` is the f64 formula on the same `y` and `dy` rounded once.
    #[test]
    fn backward_is_the_formula_rounded_once() {
        for (rows, cols) in [(1, 1), (3, 7), (70, 128), (5, 1000)] {
            let (x, dy) = (values(rows * cols, 1, 6.0), values(rows * cols, 2, 1.0));
            let scale = 0.3;
            let mut y = vec![0f32; x.len()];
            forward(&x, cols, scale, Mask::Causal { rows_per_matrix: rows }, &mut y);
            let mut dx = vec![f32::NAN; x.len()];
            backward(&y, &dy, cols, scale, &mut dx);
            for (r, (yr, gr)) in y.chunks_exact(cols).zip(dy.chunks_exact(cols)).enumerate() {
                let dot: f64 = yr.iter().zip(gr).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
                let magnitude: f64 =
                    yr.iter().zip(gr).map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs()).sum();
                for j in 0..cols {
                    let (y, g) = (f64::from(yr[j]), f64::from(gr[j]));
                    let want = 0.3f32 as f64 * y * (g - dot);
                    // One f32 rounding, plus the f64 sum's error carried through (|y| <= 1).
                    let bound = 2f64.powi(-24) * want.abs() + 2f64.powi(-50) * magnitude;
                    let got = f64::from(dx[r * cols + j]);
                    assert!((got - want).abs() <= bound, "{rows}x{cols} [{r}, {j}]: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn non_finite_inputs_behave_as_the_definition() {
        let inf = f32::INFINITY;
        let rows: [&[f32]; 5] = [
            &[0.0, -inf, 1.0, -inf],
            &[0.0, f32::NAN, 1.0, 2.0],
            &[0.0, inf, 1.0, 2.0],
            &[-inf, -inf, -inf, -inf],
            &[1e30, -1e30, 0.0, 3.0],
        ];
        let x: Vec<f32> = rows.concat();
        let mut y = vec![0f32; x.len()];
        forward(&x, 4, 1.0, Mask::None, &mut y);
        let e = 1.0 / (1.0 + std::f64::consts::E);
        assert_eq!([y[1], y[3]], [0.0, 0.0], "-inf gives exactly 0");
        assert!((f64::from(y[0]) - e).abs() < 1e-7 && (f64::from(y[2]) - (1.0 - e)).abs() < 1e-7);
        assert!(y[4..16].iter().all(|v| v.is_nan()), "NaN, +inf and all -inf rows are NaN: {y:?}");
        assert_eq!(&y[16..], &[1.0, 0.0, 0.0, 0.0], "a huge score takes the whole row");
        let mut dx = vec![0f32; x.len()];
        backward(&y, &[1.0; 20], 4, 1.0, &mut dx);
        assert!(dx[..4].iter().all(|v| v.abs() < 1e-7) && dx[4..16].iter().all(|v| v.is_nan()));
    }

    #[test]
    fn causal_rows_are_the_softmax_of_their_visible_prefix() {
        // 3 matrices of 5 queries over 7 keys: query i sees keys 0..=i.
        let (rows, cols) = (15, 7);
        let x = values(rows * cols, 9, 3.0);
        let mut y = vec![0f32; x.len()];
        forward(&x, cols, 1.0, Mask::Causal { rows_per_matrix: 5 }, &mut y);
        for (r, row) in y.chunks_exact(cols).enumerate() {
            let mut alone = vec![0f32; cols];
            forward(&x[r * cols..][..r % 5 + 1], r % 5 + 1, 1.0, Mask::None, &mut alone[..r % 5 + 1]);
            assert_eq!(row, &alone[..], "row {r}");
        }
    }
    /// The in-place versions write the bits the out-of-place ones do, NaN and infinities included.
    #[test]
    fn in_place_is_bit_for_bit_the_out_of_place_result() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (rows, cols) in [(1, 1), (3, 7), (70, 128), (130, 33), (5, 1000)] {
            let mut x = values(rows * cols, rows, 9.0);
            let dy = values(rows * cols, cols, 2.0);
            let n = x.len();
            (x[0], x[n / 2], x[n - 1]) = (f32::NEG_INFINITY, f32::NAN, 1e30);
            for mask in [Mask::None, Mask::Causal { rows_per_matrix: rows.min(cols).max(1) }] {
                let mut y = vec![0f32; x.len()];
                forward(&x, cols, 0.3, mask, &mut y);
                let mut v = x.clone();
                forward_in_place(&mut v, cols, 0.3, mask);
                assert_eq!(bits(&v), bits(&y), "forward {rows}x{cols} {mask:?}");
                let mut dx = vec![0f32; x.len()];
                backward(&y, &dy, cols, 0.3, &mut dx);
                let mut g = dy.clone();
                backward_in_place(&y, &mut g, cols, 0.3);
                assert_eq!(bits(&g), bits(&dx), "backward {rows}x{cols} {mask:?}");
            }
        }
    }

    /// Values in rows of no columns are refused (they were left unwritten without a word); an empty
    /// matrix of no columns is fine.
    #[test]
    fn rows_of_no_columns_hold_no_values() {
        let refused = |f: &dyn Fn()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err();
        assert!(refused(&|| forward(&[1.0; 4], 0, 1.0, Mask::None, &mut [0.0; 4])));
        assert!(refused(&|| forward_in_place(&mut [1.0; 4], 0, 1.0, Mask::None)));
        forward(&[], 0, 1.0, Mask::None, &mut []);
    }
}
