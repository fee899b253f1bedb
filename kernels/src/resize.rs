//! Bilinear resizing of planes, forward and backward, separable: each output row blends two input rows,
//! then each output column two columns of that blend.
//!
//! Where each output element reads, and with which weight, is the caller's ([`Taps`], one per axis:
//! PyTorch's and candle's source coordinates are computed in `amp::ops`). Values are widened to f32 a
//! plane at a time and each result rounded once into the storage dtype. The forward computes
//! `a * (1 - t) + b * t` with every product and sum rounded to f32, rows first: the same operations, in
//! the same order, as the composed candle ops `amp::ops` uses off the CPU, so both give the same bits.
//! The backward spreads each output's gradient over its sources with the same weights, columns first,
//! summing in f32 in a fixed order: deterministic, whatever the threads.
//!
//! ```
//! use amp_kernels::resize::{bilinear_forward, Planes, Taps};
//!
//! // One plane, 1 x 2 to 1 x 3: the middle output halfway between the two inputs.
//! let rows = Taps { first: vec![0], second: vec![0], weight: vec![0.0] };
//! let cols = Taps { first: vec![0, 0, 1], second: vec![1, 1, 1], weight: vec![0.0, 0.5, 0.0] };
//! let planes = Planes { count: 1, height: 1, width: 2, rows: &rows, cols: &cols };
//! let mut y = [0f32; 3];
//! bilinear_forward(&planes, (&[2f32, 4.0][..]).into(), (&mut y[..]).into());
//! assert_eq!(y, [2.0, 3.0, 4.0]);
//! ```

use rayon::prelude::*;

use crate::slices::Float;
use crate::{GradSlice, GradSliceMut};

/// Along one axis, for each output element: the two input elements it blends and the second's
/// weight (the first's is `1 - weight`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Taps {
    /// The first source of each output element.
    pub first: Vec<u32>,
    /// The second source of each output element.
    pub second: Vec<u32>,
    /// The second source's weight, in `[0, 1]`.
    pub weight: Vec<f32>,
}

impl Taps {
    /// Output elements along the axis.
    #[must_use]
    pub fn len(&self) -> usize {
        self.first.len()
    }

    /// No output element.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.first.is_empty()
    }

    /// Panics unless the three lists agree and every source lies within `input` elements.
    fn check(&self, input: usize, axis: &str) {
        let n = self.first.len();
        assert!(self.second.len() == n && self.weight.len() == n, "resize: the {axis} taps' lengths differ");
        let inside = |s: &u32| (*s as usize) < input;
        assert!(self.first.iter().chain(&self.second).all(inside), "resize: a {axis} source past {input}");
    }
}

/// `count` planes of `height x width` resized to `rows.len() x cols.len()`.
#[derive(Clone, Copy, Debug)]
pub struct Planes<'a> {
    /// Planes (batch x channels).
    pub count: usize,
    /// Input rows per plane.
    pub height: usize,
    /// Input columns per plane.
    pub width: usize,
    /// The output rows' sources (input rows).
    pub rows: &'a Taps,
    /// The output columns' sources (input columns).
    pub cols: &'a Taps,
}

impl Planes<'_> {
    fn check(&self, input: usize, output: usize) {
        self.rows.check(self.height, "row");
        self.cols.check(self.width, "column");
        assert_eq!(input, self.count * self.height * self.width, "resize: the input's length");
        assert_eq!(output, self.count * self.rows.len() * self.cols.len(), "resize: the output's length");
    }

    fn plane_in(&self) -> usize {
        self.height * self.width
    }

    fn plane_out(&self) -> usize {
        self.rows.len() * self.cols.len()
    }
}

/// `y` (overwritten, `count x rows x cols`) = the bilinear blend of `x` (`count x height x width`).
///
/// # Panics
/// If a length does not match `planes`, a source lies outside its plane, or `x` and `y` differ in
/// dtype.
pub fn bilinear_forward(planes: &Planes<'_>, x: GradSlice<'_>, y: GradSliceMut<'_>) {
    planes.check(x.len(), y.len());
    match (x, y) {
        (GradSlice::F32(x), GradSliceMut::F32(y)) => forward(planes, x, y),
        (GradSlice::F16(x), GradSliceMut::F16(y)) => forward(planes, x, y),
        (GradSlice::Bf16(x), GradSliceMut::Bf16(y)) => forward(planes, x, y),
        (x, y) => panic!("resize: x is {:?} but y {:?}", x.dtype(), y.dtype()),
    }
}

/// `dx` (overwritten, `count x height x width`) from the output gradient `dy`: each output's gradient
/// spread over its four sources with the forward's weights.
///
/// # Panics
/// If a length does not match `planes` or a source lies outside its plane.
pub fn bilinear_backward(planes: &Planes<'_>, dy: GradSlice<'_>, dx: GradSliceMut<'_>) {
    planes.check(dx.len(), dy.len());
    match dx {
        GradSliceMut::F32(dx) => backward(planes, dy, dx),
        GradSliceMut::F16(dx) => backward(planes, dy, dx),
        GradSliceMut::Bf16(dx) => backward(planes, dy, dx),
    }
}

/// A worker's buffers, reused from plane to plane.
#[derive(Default)]
struct Scratch {
    /// A plane widened to f32 (input or output gradient).
    widened: Vec<f32>,
    /// The rows' blend, `rows x width` (forward), or the columns' gradient, `rows x width` (backward).
    middle: Vec<f32>,
    /// The result in f32.
    out: Vec<f32>,
}

/// `src` as f32: itself, or widened into `buffer`.
fn as_f32<'s, T: Float>(src: &'s [T], buffer: &'s mut Vec<f32>) -> &'s [f32] {
    if let Some(src) = T::as_f32(src) {
        return src;
    }
    buffer.resize(src.len(), 0.0);
    T::widen(src, buffer);
    buffer
}

fn forward<T: Float>(planes: &Planes<'_>, x: &[T], y: &mut [T]) {
    let (plane_in, plane_out, width) = (planes.plane_in(), planes.plane_out(), planes.width);
    if plane_out == 0 {
        return;
    }
    y.par_chunks_mut(plane_out).enumerate().for_each_init(Scratch::default, |scratch, (p, y)| {
        let x = as_f32(&x[p * plane_in..][..plane_in], &mut scratch.widened);
        let middle = &mut scratch.middle;
        middle.resize(planes.rows.len() * width, 0.0);
        for (r, row) in middle.chunks_exact_mut(width.max(1)).enumerate() {
            let (a, b) = (planes.rows.first[r] as usize, planes.rows.second[r] as usize);
            let t = planes.rows.weight[r];
            let (a, b) = (&x[a * width..][..width], &x[b * width..][..width]);
            for ((m, &a), &b) in row.iter_mut().zip(a).zip(b) {
                *m = a * (1.0 - t) + b * t;
            }
        }
        let cols = planes.cols;
        let out = &mut scratch.out;
        out.resize(plane_out, 0.0);
        for (row, middle) in out.chunks_exact_mut(cols.len()).zip(middle.chunks_exact(width.max(1))) {
            for (c, o) in row.iter_mut().enumerate() {
                let (a, b, t) =
                    (middle[cols.first[c] as usize], middle[cols.second[c] as usize], cols.weight[c]);
                *o = a * (1.0 - t) + b * t;
            }
        }
        T::narrow(out, y);
    });
}

fn backward<T: Float>(planes: &Planes<'_>, dy: GradSlice<'_>, dx: &mut [T]) {
    let (plane_in, plane_out, width) = (planes.plane_in(), planes.plane_out(), planes.width);
    if plane_in == 0 {
        return;
    }
    let (rows, cols) = (planes.rows, planes.cols);
    dx.par_chunks_mut(plane_in).enumerate().for_each_init(Scratch::default, |scratch, (p, dx)| {
        let dy = dy.split_at(p * plane_out).1.split_at(plane_out).0;
        scratch.widened.resize(plane_out, 0.0);
        match dy {
            GradSlice::F32(dy) => scratch.widened.copy_from_slice(dy),
            GradSlice::F16(dy) => Float::widen(dy, &mut scratch.widened),
            GradSlice::Bf16(dy) => Float::widen(dy, &mut scratch.widened),
        }
        // Columns: each output's gradient to its two columns of the rows' blend.
        let middle = &mut scratch.middle;
        middle.clear();
        middle.resize(rows.len() * width, 0.0);
        for (g, m) in scratch.widened.chunks_exact(cols.len().max(1)).zip(middle.chunks_exact_mut(width)) {
            for (c, &g) in g.iter().enumerate() {
                let t = cols.weight[c];
                m[cols.first[c] as usize] += g * (1.0 - t);
                m[cols.second[c] as usize] += g * t;
            }
        }
        // Rows: each blended row's gradient to its two input rows.
        let out = &mut scratch.out;
        out.clear();
        out.resize(plane_in, 0.0);
        for (r, g) in middle.chunks_exact(width).enumerate() {
            let t = rows.weight[r];
            let first = &mut out[rows.first[r] as usize * width..][..width];
            first.iter_mut().zip(g).for_each(|(o, &g)| *o += g * (1.0 - t));
            let second = &mut out[rows.second[r] as usize * width..][..width];
            second.iter_mut().zip(g).for_each(|(o, &g)| *o += g * t);
        }
        T::narrow(out, dx);
    });
}
