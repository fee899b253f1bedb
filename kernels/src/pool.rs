//! Max and average pooling over planes, forward and backward, for windows of any size, stride,
//! padding and (max) dilation: overlapping windows included, which candle's pooling cannot
//! differentiate.
//!
//! The geometry is a convolution's ([`ConvShape`]: each of its `channels` is one plane pooled on its
//! own, `batch x channels` of a tensor), so a window reads what a convolution's kernel would, and
//! the padding is read as nothing: it never wins a max and adds nothing to an average.
//!
//! Values are widened to f32 a plane at a time and results rounded once into the storage dtype. Max
//! is exact in any dtype. Averages sum their window in f32 in window order (row-major) and divide by
//! the window's size, padding included (PyTorch's `count_include_pad`, its default). Gradients
//! accumulate in f32 in a fixed order and are rounded once: deterministic, whatever the threads.
//!
//! Max follows PyTorch's rules: the first maximum of a window in row-major order takes the gradient,
//! and a NaN wins, so that a NaN propagates as through any other op (the gradient goes to the
//! window's first NaN, PyTorch's to its last). A window whose values are all negative infinity routes
//! its gradient to its first element inside the image, as PyTorch's does.
//!
//! ```
//! use amp_kernels::conv::ConvShape;
//! use amp_kernels::pool;
//!
//! // A 3 x 3 window at stride 2 with padding 1 over a 4 x 4 plane: ResNet's stem pool, 2 x 2 out.
//! let shape = ConvShape { kernel: [3, 3], stride: [2, 2], padding: [1, 1], ..ConvShape::new(1, 4, 4) };
//! let x: Vec<f32> = (0..16).map(|v| v as f32).collect();
//! let mut y = vec![0.0f32; 4];
//! pool::max_forward(&shape, (&x[..]).into(), (&mut y[..]).into());
//! assert_eq!(y, [5.0, 7.0, 13.0, 15.0]);
//! let mut dx = vec![0.0f32; 16];
//! pool::max_backward(&shape, (&x[..]).into(), (&[1.0f32; 4][..]).into(), (&mut dx[..]).into());
//! assert_eq!(dx.iter().sum::<f32>(), 4.0);
//! assert_eq!((dx[5], dx[7], dx[13], dx[15]), (1.0, 1.0, 1.0, 1.0));
//! ```

use rayon::prelude::*;

use std::ops::Range;

use crate::conv::{ConvShape, Line};
use crate::slices::Float;
use crate::{GradSlice, GradSliceMut};

/// No element won the window (it lies wholly in the padding): nothing to route a gradient to.
const NONE: u32 = u32::MAX;

/// `y` (overwritten, `planes x output rows x output columns`) = the maximum of each window of `x`
/// (`planes x height x width`); a window wholly in the padding gives negative infinity.
///
/// # Panics
/// If the shape has no output, a length does not match it, or a plane has 2^32 - 1 elements or more.
pub fn max_forward(shape: &ConvShape, x: GradSlice<'_>, y: GradSliceMut<'_>) {
    let planes = Planes::checked(shape, x.len(), y.len());
    match (x, y) {
        (GradSlice::F32(x), GradSliceMut::F32(y)) => planes.max_forward(x, y),
        (GradSlice::F16(x), GradSliceMut::F16(y)) => planes.max_forward(x, y),
        (GradSlice::Bf16(x), GradSliceMut::Bf16(y)) => planes.max_forward(x, y),
        (x, y) => panic!("pool: x is {:?} but y {:?}", x.dtype(), y.dtype()),
    }
}

/// `dx` (overwritten, `x`'s shape) from the output gradient `dy`: each window's gradient goes to its
/// maximum in `x` (the first, or the first NaN), the windows' parts summed in f32 and rounded once.
///
/// # Panics
/// As [`max_forward`], or if `x` and `dx` differ in dtype.
pub fn max_backward(shape: &ConvShape, x: GradSlice<'_>, dy: GradSlice<'_>, dx: GradSliceMut<'_>) {
    let planes = Planes::checked(shape, x.len(), dy.len());
    assert_eq!(dx.len(), x.len(), "pool: dx and x lengths");
    match (x, dx) {
        (GradSlice::F32(x), GradSliceMut::F32(dx)) => planes.max_backward(x, dy, dx),
        (GradSlice::F16(x), GradSliceMut::F16(dx)) => planes.max_backward(x, dy, dx),
        (GradSlice::Bf16(x), GradSliceMut::Bf16(dx)) => planes.max_backward(x, dy, dx),
        (x, dx) => panic!("pool: x is {:?} but dx {:?}", x.dtype(), dx.dtype()),
    }
}

/// `y` (overwritten) = the mean of each window of `x`, the padding counted as zeros.
///
/// # Panics
/// As [`max_forward`].
pub fn avg_forward(shape: &ConvShape, x: GradSlice<'_>, y: GradSliceMut<'_>) {
    let planes = Planes::checked(shape, x.len(), y.len());
    match (x, y) {
        (GradSlice::F32(x), GradSliceMut::F32(y)) => planes.avg_forward(x, y),
        (GradSlice::F16(x), GradSliceMut::F16(y)) => planes.avg_forward(x, y),
        (GradSlice::Bf16(x), GradSliceMut::Bf16(y)) => planes.avg_forward(x, y),
        (x, y) => panic!("pool: x is {:?} but y {:?}", x.dtype(), y.dtype()),
    }
}

/// `dx` (overwritten, `planes x height x width`) from the output gradient `dy`: each window's
/// gradient divided by its size and spread over its elements, summed in f32 and rounded once.
///
/// # Panics
/// As [`max_forward`].
pub fn avg_backward(shape: &ConvShape, dy: GradSlice<'_>, dx: GradSliceMut<'_>) {
    let planes = Planes::checked(shape, dx.len(), dy.len());
    match dx {
        GradSliceMut::F32(dx) => planes.avg_backward(dy, dx),
        GradSliceMut::F16(dx) => planes.avg_backward(dy, dx),
        GradSliceMut::Bf16(dx) => planes.avg_backward(dy, dx),
    }
}

/// A shape with an output, and the sizes of one plane in and out.
#[derive(Clone, Copy)]
struct Planes<'a> {
    shape: &'a ConvShape,
    rows: usize,
    cols: usize,
}

impl<'a> Planes<'a> {
    fn checked(shape: &'a ConvShape, input: usize, output: usize) -> Self {
        let [rows, cols] = shape.output().unwrap_or_else(|| panic!("pool: {shape:?} has no output"));
        let plane = shape.height * shape.width;
        assert!(plane < NONE as usize, "pool: a plane of {plane} elements (2^32 - 1 at most)");
        assert_eq!(input, shape.image_len(), "pool: the input's length");
        assert_eq!(output, shape.channels * rows * cols, "pool: the output's length");
        Planes { shape, rows, cols }
    }

    fn plane_in(&self) -> usize {
        self.shape.height * self.shape.width
    }

    fn plane_out(&self) -> usize {
        self.rows * self.cols
    }

    fn max_forward<T: Float>(self, x: &[T], y: &mut [T]) {
        let (plane_in, plane_out) = (self.plane_in(), self.plane_out());
        if plane_out == 0 {
            return;
        }
        y.par_chunks_mut(plane_out).enumerate().for_each_init(Scratch::default, |scratch, (p, y)| {
            let (x, work) = scratch.split(&x[p * plane_in..][..plane_in]);
            self.window_max(x, &mut work.values);
            T::narrow(&work.values, y);
        });
    }

    fn max_backward<T: Float>(self, x: &[T], dy: GradSlice<'_>, dx: &mut [T]) {
        let (plane_in, plane_out) = (self.plane_in(), self.plane_out());
        if plane_in == 0 {
            return;
        }
        dx.par_chunks_mut(plane_in).zip(x.par_chunks(plane_in)).enumerate().for_each_init(
            Scratch::default,
            |scratch, (p, (dx, x))| {
                let (x, work) = scratch.split(x);
                self.window_argmax(x, &mut work.values, &mut work.winners);
                work.sums.clear();
                work.sums.resize(plane_in, 0.0);
                widen_into(dy.split_at(p * plane_out).1.split_at(plane_out).0, &mut work.values);
                for (&at, &g) in work.winners.iter().zip(&work.values) {
                    if at != NONE {
                        work.sums[at as usize] += g;
                    }
                }
                T::narrow(&work.sums, dx);
            },
        );
    }

    fn avg_forward<T: Float>(self, x: &[T], y: &mut [T]) {
        let (plane_in, plane_out) = (self.plane_in(), self.plane_out());
        if plane_out == 0 {
            return;
        }
        let size = (self.shape.kernel[0] * self.shape.kernel[1]) as f32;
        y.par_chunks_mut(plane_out).enumerate().for_each_init(Scratch::default, |scratch, (p, y)| {
            let (x, work) = scratch.split(&x[p * plane_in..][..plane_in]);
            let sums = &mut work.values;
            sums.clear();
            sums.resize(plane_out, 0.0);
            self.for_each_tap(|t| {
                let src = self.image_row(x, t.image_row);
                for (ow, o) in t.columns.clone().zip(&mut sums[t.output_row * self.cols..][t.columns]) {
                    *o += src[t.line.column(ow)];
                }
            });
            sums.iter_mut().for_each(|s| *s /= size);
            T::narrow(sums, y);
        });
    }

    fn avg_backward<T: Float>(self, dy: GradSlice<'_>, dx: &mut [T]) {
        let (plane_in, plane_out) = (self.plane_in(), self.plane_out());
        if plane_in == 0 {
            return;
        }
        let size = (self.shape.kernel[0] * self.shape.kernel[1]) as f32;
        dx.par_chunks_mut(plane_in).enumerate().for_each_init(Work::default, |work, (p, dx)| {
            let shares = &mut work.values;
            widen_into(dy.split_at(p * plane_out).1.split_at(plane_out).0, shares);
            shares.iter_mut().for_each(|g| *g /= size);
            let sums = &mut work.sums;
            sums.clear();
            sums.resize(plane_in, 0.0);
            self.for_each_tap(|t| {
                let row = &mut sums[t.image_row * self.shape.width..][..self.shape.width];
                for (ow, &g) in t.columns.clone().zip(&shares[t.output_row * self.cols..][t.columns]) {
                    row[t.line.column(ow)] += g;
                }
            });
            T::narrow(sums, dx);
        });
    }

    /// Each window's maximum of the f32 plane `x` into `best` (a NaN wins, and stays).
    fn window_max(&self, x: &[f32], best: &mut Vec<f32>) {
        best.clear();
        best.resize(self.plane_out(), f32::NEG_INFINITY);
        self.for_each_tap(|t| {
            let src = self.image_row(x, t.image_row);
            let out = &mut best[t.output_row * self.cols..][t.columns.clone()];
            let wins = |v: f32, b: f32| v > b || v.is_nan();
            if t.line.stride == 1 {
                for (b, &v) in out.iter_mut().zip(&src[t.line.column(t.columns.start)..]) {
                    *b = if wins(v, *b) { v } else { *b };
                }
            } else {
                for (ow, b) in t.columns.zip(out) {
                    let v = src[t.line.column(ow)];
                    *b = if wins(v, *b) { v } else { *b };
                }
            }
        });
    }

    /// Where each window's first maximum lies in the plane `x`, into `winners` ([`NONE`] for a window
    /// wholly in the padding), the taps taken in row-major order: a later one wins only when larger,
    /// or when it is the window's first NaN. A window whose values are all negative infinity keeps its
    /// first. `best` holds the maxima.
    fn window_argmax(&self, x: &[f32], best: &mut Vec<f32>, winners: &mut Vec<u32>) {
        best.clear();
        best.resize(self.plane_out(), f32::NEG_INFINITY);
        winners.clear();
        winners.resize(self.plane_out(), NONE);
        self.for_each_tap(|t| {
            let row = t.image_row * self.shape.width;
            let at = t.output_row * self.cols;
            let out = best[at..][t.columns.clone()].iter_mut().zip(&mut winners[at..][t.columns.clone()]);
            for (ow, (b, w)) in t.columns.zip(out) {
                let column = t.line.column(ow);
                let v = x[row + column];
                if v > *b || (v.is_nan() && !b.is_nan()) || *w == NONE {
                    *b = v;
                    *w = (row + column) as u32;
                }
            }
        });
    }

    /// Row `row` of the f32 plane `x`.
    fn image_row<'x>(&self, x: &'x [f32], row: usize) -> &'x [f32] {
        &x[row * self.shape.width..][..self.shape.width]
    }

    /// Calls `f` for each kernel tap (row-major) and each output row whose window row that tap reads
    /// inside the image.
    fn for_each_tap(&self, mut f: impl FnMut(TapRow)) {
        for tap in 0..self.shape.kernel[0] * self.shape.kernel[1] {
            let (i, line) = self.shape.tap(tap);
            let (first, end) = line.inside(self.cols);
            if first == end {
                continue;
            }
            for output_row in 0..self.rows {
                if let Some(image_row) = self.shape.image_row(i, output_row) {
                    f(TapRow { image_row, output_row, columns: first..end, line });
                }
            }
        }
    }
}

/// One kernel tap over one output row: output columns `columns` read image row `image_row`, output
/// column `ow` at column `line.column(ow)`.
struct TapRow {
    image_row: usize,
    output_row: usize,
    columns: Range<usize>,
    line: Line,
}

/// A worker's buffers, reused from plane to plane.
#[derive(Default)]
struct Scratch {
    /// A half plane widened to f32.
    widened: Vec<f32>,
    work: Work,
}

/// The buffers a plane's pass writes.
#[derive(Default)]
struct Work {
    /// One f32 per output: maxima, sums or the output gradient.
    values: Vec<f32>,
    /// One f32 per input: the input gradient's sums.
    sums: Vec<f32>,
    /// One per output: where in the plane the window's maximum lies.
    winners: Vec<u32>,
}

impl Scratch {
    /// The plane `x` as f32 (itself, or widened into this scratch), and the work buffers.
    fn split<'s, T: Float>(&'s mut self, x: &'s [T]) -> (&'s [f32], &'s mut Work) {
        if let Some(x) = T::as_f32(x) {
            return (x, &mut self.work);
        }
        self.widened.resize(x.len(), 0.0);
        T::widen(x, &mut self.widened);
        (&self.widened, &mut self.work)
    }
}

/// `src` widened to f32 into `dst` (resized to it).
fn widen_into(src: GradSlice<'_>, dst: &mut Vec<f32>) {
    dst.resize(src.len(), 0.0);
    match src {
        GradSlice::F32(s) => dst.copy_from_slice(s),
        GradSlice::F16(s) => Float::widen(s, dst),
        GradSlice::Bf16(s) => Float::widen(s, dst),
    }
}
