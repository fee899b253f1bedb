//! A per-channel scale and shift, `y = x * weight[c] + bias[c]`, over a row-major f32 tensor viewed as
//! `(outer, channels, inner)`: the affine that ends a group norm or a batch norm, forward and backward
//! in one pass each.
//!
//! Backward: `dx = dy * weight[c]`, `dweight[c] = sum of dy * x`, `dbias[c] = sum of dy` over the
//! channel's `outer * inner` values. Each plane (one `outer` index, one channel: `inner` contiguous
//! values) sums its terms in eight f64 lanes added in a fixed order, as the row norms do; the planes of
//! a channel are added in `outer` order and rounded to f32 once. Every result is therefore
//! deterministic, independent of the thread count and the same bits on every vector width.
//!
//! The forward pass rounds `x * weight[c]` before adding `bias[c]` (no fused multiply-add), as a
//! multiply then an add of tensors does: candle-nn's norms compute those same bits.
//!
//! Written with broadcasting tensor ops, the affine and its backward (a broadcast product and sum, then
//! reductions of the gradient over every dimension but the channels') took 70 ms of a group norm's
//! 122 ms forward and backward at `(8, 256, 32, 32)`, against 9 ms for the normalisation itself.

use rayon::prelude::*;

use crate::lanes::lane_sum;

/// Elements per block of the work split (whole planes, at least one).
const BLOCK_ELEMENTS: usize = 1 << 15;

/// The shape of the `(outer, channels, inner)` view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Planes {
    /// Channels: the length of `weight` and `bias`.
    pub channels: usize,
    /// Contiguous values of one channel in one plane.
    pub inner: usize,
}

impl Planes {
    /// Planes per block of the work split.
    fn per_block(self) -> usize {
        (BLOCK_ELEMENTS / self.inner.max(1)).max(1)
    }

    /// Panics unless `len` is whole `(channels, inner)` slices and the parameters have `channels`
    /// values each.
    fn check(self, len: usize, weight: &[f32], bias: &[f32]) {
        assert_eq!(
            (weight.len(), bias.len()),
            (self.channels, self.channels),
            "channel_affine: parameter lengths"
        );
        let sample = self.channels * self.inner;
        assert!(
            sample == 0 && len == 0 || sample != 0 && len.is_multiple_of(sample),
            "channel_affine: a length of {len} is not whole samples of {} channels x {}",
            self.channels,
            self.inner
        );
    }
}

/// The forward pass into a new vector: `y = x * weight[c] + bias[c]`.
///
/// # Panics
/// If `x`'s length is not a whole number of `channels * inner`, or a parameter's is not `channels`.
pub fn forward_new(x: &[f32], planes: Planes, weight: &[f32], bias: &[f32]) -> Vec<f32> {
    planes.check(x.len(), weight, bias);
    if x.is_empty() {
        return Vec::new();
    }
    let block = planes.per_block() * planes.inner;
    crate::fresh::written_in_blocks(x.len(), block, |start, ys| {
        let first_plane = start / planes.inner;
        for (i, (y, x)) in
            ys.chunks_exact_mut(planes.inner).zip(x[start..].chunks_exact(planes.inner)).enumerate()
        {
            let c = (first_plane + i) % planes.channels;
            scale_and_shift(x, weight[c], bias[c], y);
        }
    })
}

/// The backward pass: `dx` (overwritten) from the output gradient `dy`, and `dweight` and `dbias`
/// (`channels` each, overwritten) from `dy` and the forward pass's input `x`.
///
/// # Panics
/// If a length does not match as in [`forward_new`], or `dy` and `dx` are not `x`'s length.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    x: &[f32],
    dy: &[f32],
    planes: Planes,
    weight: &[f32],
    dx: &mut [f32],
    dweight: &mut [f32],
    dbias: &mut [f32],
) {
    planes.check(x.len(), weight, dbias);
    assert_eq!((dy.len(), dx.len()), (x.len(), x.len()), "channel_affine: x, dy and dx lengths");
    assert_eq!(dweight.len(), planes.channels, "channel_affine: dweight length");
    dweight.fill(0.0);
    dbias.fill(0.0);
    if x.is_empty() {
        return;
    }
    let inner = planes.inner;
    let block = planes.per_block() * inner;
    // Each block: its planes' sums of dy * x and of dy, in plane order.
    let sums: Vec<Vec<[f64; 2]>> = dx
        .par_chunks_mut(block)
        .enumerate()
        .map(|(b, dxs)| {
            let start = b * block;
            let (xs, dys) = (&x[start..start + dxs.len()], &dy[start..start + dxs.len()]);
            let planes_here =
                dxs.chunks_exact_mut(inner).zip(xs.chunks_exact(inner).zip(dys.chunks_exact(inner)));
            planes_here
                .enumerate()
                .map(|(i, (dx, (x, dy)))| {
                    let mut sums = [0f64; 2];
                    plane_backward(x, dy, weight[(start / inner + i) % planes.channels], dx, &mut sums);
                    sums
                })
                .collect()
        })
        .collect();
    let mut dweight64 = vec![0f64; planes.channels];
    let mut dbias64 = vec![0f64; planes.channels];
    for (plane, [dyx, dy]) in sums.into_iter().flatten().enumerate() {
        let c = plane % planes.channels;
        dweight64[c] += dyx;
        dbias64[c] += dy;
    }
    for (out, sum) in dweight.iter_mut().zip(dweight64).chain(dbias.iter_mut().zip(dbias64)) {
        *out = sum as f32;
    }
}

widest_vectors! {
    /// `y = x * weight + bias` over one plane, the product rounded first.
    fn scale_and_shift(x: &[f32], weight: f32, bias: f32, y: &mut [f32]) => scale_and_shift_any;
}

#[inline(always)]
fn scale_and_shift_any(x: &[f32], weight: f32, bias: f32, y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = x * weight + bias;
    }
}

widest_vectors! {
    /// One plane of the backward pass: `dx = dy * weight`, and `sums = [sum of dy * x, sum of dy]`.
    fn plane_backward(x: &[f32], dy: &[f32], weight: f32, dx: &mut [f32], sums: &mut [f64; 2]) => plane_backward_any;
}

#[inline(always)]
fn plane_backward_any(x: &[f32], dy: &[f32], weight: f32, dx: &mut [f32], sums: &mut [f64; 2]) {
    for (dx, &dy) in dx.iter_mut().zip(dy) {
        *dx = dy * weight;
    }
    // The product of two f32 values is exact in f64.
    sums[0] = lane_sum(dy, x, |dy, x| f64::from(dy) * f64::from(x));
    sums[1] = lane_sum(dy, dy, |dy, _| f64::from(dy));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.5 - 1.0) * scale).collect()
    }

    /// Forward bit for bit as a multiply then an add; backward against f64 sums: `dx` is one rounding of
    /// an exact product, the parameter gradients one rounding of an f64 sum of `n` terms (error below
    /// `n * 2^-53` of the sum of magnitudes, far under the f32 rounding; 2 units of f32 roundoff).
    #[test]
    fn matches_the_definition() {
        for (outer, channels, inner) in [(1, 1, 1), (3, 5, 7), (2, 64, 1), (4, 3, 40_000), (5, 2, 3000)] {
            let planes = Planes { channels, inner };
            let n = outer * channels * inner;
            let (x, dy) = (values(n, 1, 3.0), values(n, 2, 1.0));
            let (w, b) = (values(channels, 3, 2.0), values(channels, 4, 0.5));
            let y = forward_new(&x, planes, &w, &b);
            let (mut dx, mut dw, mut db) =
                (vec![f32::NAN; n], vec![f32::NAN; channels], vec![f32::NAN; channels]);
            backward(&x, &dy, planes, &w, &mut dx, &mut dw, &mut db);
            let (mut rdw, mut rdb, mut magnitude) =
                (vec![0f64; channels], vec![0f64; channels], vec![0f64; channels]);
            for i in 0..n {
                let c = i / inner % channels;
                assert_eq!(y[i].to_bits(), (x[i] * w[c] + b[c]).to_bits(), "y [{i}]");
                assert_eq!(dx[i].to_bits(), (dy[i] * w[c]).to_bits(), "dx [{i}]");
                rdw[c] += f64::from(dy[i]) * f64::from(x[i]);
                rdb[c] += f64::from(dy[i]);
                magnitude[c] += f64::from(dy[i]).abs() * f64::from(x[i]).abs().max(1.0);
            }
            let u = f64::from(f32::EPSILON) / 2.0;
            for c in 0..channels {
                let what = format!("{outer}x{channels}x{inner} channel {c}");
                assert!((f64::from(dw[c]) - rdw[c]).abs() <= 2.0 * u * magnitude[c], "dweight {what}");
                assert!((f64::from(db[c]) - rdb[c]).abs() <= 2.0 * u * magnitude[c], "dbias {what}");
            }
        }
    }

    /// The same bits whatever the thread count: the planes' sums are added in a fixed order.
    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let planes = Planes { channels: 3, inner: 20_000 };
        let n = 7 * 3 * 20_000;
        let (x, dy) = (values(n, 5, 2.0), values(n, 6, 1.0));
        let (w, b) = (values(3, 7, 1.0), values(3, 8, 1.0));
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a pool");
            pool.install(|| {
                let y = forward_new(&x, planes, &w, &b);
                let (mut dx, mut dw, mut db) = (vec![0f32; n], vec![0f32; 3], vec![0f32; 3]);
                backward(&x, &dy, planes, &w, &mut dx, &mut dw, &mut db);
                [y, dx, dw, db].concat().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            })
        };
        assert_eq!(run(1), run(3));
    }

    #[test]
    fn partial_samples_and_wrong_parameter_lengths_are_refused() {
        let refused = |f: &dyn Fn()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err();
        let planes = Planes { channels: 2, inner: 3 };
        assert!(refused(&|| drop(forward_new(&[0.0; 7], planes, &[1.0; 2], &[0.0; 2]))));
        assert!(refused(&|| drop(forward_new(&[0.0; 6], planes, &[1.0; 3], &[0.0; 2]))));
        assert!(refused(&|| {
            let (mut dx, mut dw, mut db) = ([0.0; 6], [0.0; 2], [0.0; 2]);
            backward(&[0.0; 6], &[0.0; 5], planes, &[1.0; 2], &mut dx, &mut dw, &mut db);
        }));
        assert!(forward_new(&[], planes, &[1.0; 2], &[0.0; 2]).is_empty());
    }
}
