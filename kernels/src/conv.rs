//! Convolution as matrix products: an image's patches laid out as the columns of a matrix ([`unfold`],
//! "im2col"), so that a convolution is one GEMM per image, `W (out, patch) · columns (patch,
//! positions)`, and a gradient of that matrix added back onto the image ([`fold`], "col2im"), which
//! gives the input's gradient.
//!
//! The columns matrix has one row per (channel, kernel row, kernel column), in the order a candle or
//! PyTorch weight `(out, channels, kh, kw)` flattens, and one column per output position, row-major.
//! A 1-d convolution is a 2-d one of height 1. A group's channels are consecutive, so a group is a
//! range of rows and needs nothing here.
//!
//! ```
//! use amp_kernels::conv::{unfold, ConvShape};
//!
//! // One channel, 3 x 3, a 2 x 2 kernel: 4 output positions, 4 rows (the kernel's taps).
//! let shape = ConvShape { kernel: [2, 2], ..ConvShape::new(1, 3, 3) };
//! let image: Vec<f32> = (1..=9).map(|v| v as f32).collect();
//! let mut columns = vec![0.0f32; shape.patch_len() * shape.positions()];
//! unfold(&shape, (&image[..]).into(), (&mut columns[..]).into())?;
//! // Row (tap) 0 is each patch's top-left element, row 3 its bottom-right.
//! assert_eq!(columns[..4], [1.0, 2.0, 4.0, 5.0]);
//! assert_eq!(columns[12..], [5.0, 6.0, 8.0, 9.0]);
//! # Ok::<(), amp_kernels::conv::ConvError>(())
//! ```

use rayon::prelude::*;

use crate::slices::Float;
use crate::{Dtype, GradSlice, GradSliceMut};

/// The geometry of a convolution over one image of `channels x height x width`; per spatial
/// dimension (`[height, width]`): the kernel's size, the zero padding on each side, the stride and
/// the dilation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvShape {
    /// Input channels (of all groups).
    pub channels: usize,
    /// Rows of the image.
    pub height: usize,
    /// Columns of the image.
    pub width: usize,
    /// Kernel rows and columns.
    pub kernel: [usize; 2],
    /// Zeros added before the first and after the last row / column.
    pub padding: [usize; 2],
    /// Distance between consecutive output positions, in input rows / columns.
    pub stride: [usize; 2],
    /// Distance between consecutive kernel taps, in input rows / columns.
    pub dilation: [usize; 2],
}

impl ConvShape {
    /// A 1 x 1 kernel over the image, no padding, stride and dilation 1.
    #[must_use]
    pub fn new(channels: usize, height: usize, width: usize) -> ConvShape {
        ConvShape {
            channels,
            height,
            width,
            kernel: [1, 1],
            padding: [0, 0],
            stride: [1, 1],
            dilation: [1, 1],
        }
    }

    /// Output rows and columns, `(in + 2 pad - dilation (kernel - 1) - 1) / stride + 1`; `None` when the
    /// dilated kernel outgrows the padded image or a kernel size, stride or dilation is zero.
    #[must_use]
    pub fn output(&self) -> Option<[usize; 2]> {
        let dim = |d: usize, size: usize| {
            let (kernel, stride, dilation) = (self.kernel[d], self.stride[d], self.dilation[d]);
            if kernel == 0 || stride == 0 || dilation == 0 {
                return None;
            }
            let reach = dilation * (kernel - 1) + 1;
            (size + 2 * self.padding[d]).checked_sub(reach).map(|room| room / stride + 1)
        };
        Some([dim(0, self.height)?, dim(1, self.width)?])
    }

    /// Rows of the columns matrix: `channels x kernel rows x kernel columns`.
    #[must_use]
    pub fn patch_len(&self) -> usize {
        self.channels * self.kernel[0] * self.kernel[1]
    }

    /// Columns of the columns matrix: the output positions (0 when there is no output).
    #[must_use]
    pub fn positions(&self) -> usize {
        self.output().map_or(0, |[rows, cols]| rows * cols)
    }

    /// Elements of the image.
    #[must_use]
    pub fn image_len(&self) -> usize {
        self.channels * self.height * self.width
    }

    /// Kernel tap `tap` (row-major over the kernel) as its kernel row and its line along the width.
    pub(crate) fn tap(&self, tap: usize) -> (usize, Line) {
        let (i, j) = (tap / self.kernel[1], tap % self.kernel[1]);
        let line = Line {
            width: self.width,
            offset: j * self.dilation[1],
            pad: self.padding[1],
            stride: self.stride[1],
        };
        (i, line)
    }

    /// The image row that output row `oh` reads with kernel row `i`; `None` in the padding.
    pub(crate) fn image_row(&self, i: usize, oh: usize) -> Option<usize> {
        (oh * self.stride[0] + i * self.dilation[0]).checked_sub(self.padding[0]).filter(|&h| h < self.height)
    }

    /// The output's size, with the lengths of the image and the columns checked.
    fn check(&self, image: usize, columns: usize) -> Result<[usize; 2], ConvError> {
        let output = self.output().ok_or(ConvError::NoOutput(*self))?;
        for (what, expected, got) in [
            ("image", self.image_len(), image),
            ("columns", self.patch_len() * output[0] * output[1], columns),
        ] {
            if expected != got {
                return Err(ConvError::Length { what, expected, got });
            }
        }
        Ok(output)
    }
}

/// Why [`unfold`] or [`fold`] refused a call; nothing is written then.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConvError {
    /// The shape has no output position.
    #[error(
        "convolution {0:?} has no output: the dilated kernel is larger than the padded image, or a kernel \
         size, stride or dilation is zero"
    )]
    NoOutput(ConvShape),
    /// A slice's length does not match the shape.
    #[error("convolution {what}: the shape needs {expected} elements, the slice has {got}")]
    Length {
        /// "image" or "columns".
        what: &'static str,
        /// The length the shape gives.
        expected: usize,
        /// The slice's length.
        got: usize,
    },
    /// [`unfold`] copies elements, or rounds f32 to a half type: other pairs of dtypes are refused.
    #[error(
        "im2col copies elements or rounds f32 to f16 / bf16: the image is {image:?} but the columns are \
         {columns:?}"
    )]
    Dtype {
        /// The image's dtype.
        image: Dtype,
        /// The columns' dtype.
        columns: Dtype,
    },
}

/// Writes the columns matrix of one image (`channels x height x width`, contiguous):
/// `columns[(c, i, j)][(oh, ow)] = image[c][oh * stride + i * dilation - pad][ow * stride + j *
/// dilation - pad]`, zero where that falls in the padding. An f32 image is rounded to f16 or bf16
/// columns on the way (`half`'s rounding, bit for bit), so a half convolution of f32 activations
/// needs no cast pass; other pairs must share a dtype. Channels run in parallel.
///
/// # Errors
/// [`ConvError`] when the shape has no output, a length does not match it, or the dtypes are neither
/// equal nor f32 to a half type.
pub fn unfold(shape: &ConvShape, image: GradSlice<'_>, columns: GradSliceMut<'_>) -> Result<(), ConvError> {
    let output = shape.check(image.len(), columns.len())?;
    match (image, columns) {
        (GradSlice::F32(x), GradSliceMut::F32(c)) => unfold_typed(shape, output, x, c),
        (GradSlice::F16(x), GradSliceMut::F16(c)) => unfold_typed(shape, output, x, c),
        (GradSlice::Bf16(x), GradSliceMut::Bf16(c)) => unfold_typed(shape, output, x, c),
        (GradSlice::F32(x), GradSliceMut::F16(c)) => unfold_rounded(shape, output, x, c),
        (GradSlice::F32(x), GradSliceMut::Bf16(c)) => unfold_rounded(shape, output, x, c),
        (x, c) => return Err(ConvError::Dtype { image: x.dtype(), columns: c.dtype() }),
    }
    Ok(())
}

/// Overwrites `image` with the sum, for each of its elements, of the entries of `columns` that
/// [`unfold`] would have copied from it (the adjoint of [`unfold`]: the input's gradient from the
/// columns' gradient). Sums run in f32 in a fixed order (kernel taps, then positions) and are rounded
/// once into the image's dtype. Channels run in parallel.
///
/// # Errors
/// [`ConvError`] when the shape has no output or a length does not match it.
pub fn fold(shape: &ConvShape, columns: &[f32], image: GradSliceMut<'_>) -> Result<(), ConvError> {
    let output = shape.check(image.len(), columns.len())?;
    match image {
        GradSliceMut::F32(x) => fold_typed(shape, output, columns, x),
        GradSliceMut::F16(x) => fold_typed(shape, output, columns, x),
        GradSliceMut::Bf16(x) => fold_typed(shape, output, columns, x),
    }
    Ok(())
}

/// One row of the image against one row of output positions along the width: output position `ow`
/// reads column `ow * stride + offset - pad` (`offset` = the tap's `j * dilation`).
#[derive(Clone, Copy)]
pub(crate) struct Line {
    width: usize,
    offset: usize,
    pad: usize,
    pub(crate) stride: usize,
}

impl Line {
    /// The output positions `first..end` (of `positions`) that read inside the image.
    pub(crate) fn inside(self, positions: usize) -> (usize, usize) {
        let first = self.pad.saturating_sub(self.offset).div_ceil(self.stride).min(positions);
        // ow * stride + offset - pad < width  <=>  ow < (width + pad - offset) / stride, rounded up.
        let end = (self.width + self.pad).saturating_sub(self.offset).div_ceil(self.stride);
        (first, end.clamp(first, positions))
    }

    /// The image column that output position `ow` (inside) reads.
    pub(crate) fn column(self, ow: usize) -> usize {
        ow * self.stride + self.offset - self.pad
    }
}

/// [`unfold`] for an image and columns of one dtype: each channel straight from the image.
fn unfold_typed<T: Copy + Default + Send + Sync>(
    shape: &ConvShape,
    output: [usize; 2],
    image: &[T],
    columns: &mut [T],
) {
    let Some((plane, per_channel)) = channel_sizes(shape, output) else {
        columns.fill(T::default());
        return;
    };
    columns
        .par_chunks_mut(per_channel)
        .zip(image.par_chunks(plane))
        .for_each(|(channel, plane)| unfold_channel(shape, output, plane, channel));
}

/// [`unfold`] for an f32 image and half columns: each channel's plane rounded once into a buffer (in
/// cache), then unfolded from there (rounding while copying would round each element once per tap).
fn unfold_rounded<T: Float>(shape: &ConvShape, output: [usize; 2], image: &[f32], columns: &mut [T]) {
    let Some((plane, per_channel)) = channel_sizes(shape, output) else {
        columns.fill(T::default());
        return;
    };
    columns.par_chunks_mut(per_channel).zip(image.par_chunks(plane)).for_each_init(
        Vec::new,
        |rounded: &mut Vec<T>, (channel, plane)| {
            rounded.resize(plane.len(), T::default());
            T::narrow(plane, rounded);
            unfold_channel(shape, output, rounded, channel);
        },
    );
}

/// Elements of one channel's plane and of its rows of the columns matrix; `None` when either is empty.
fn channel_sizes(shape: &ConvShape, [rows, cols]: [usize; 2]) -> Option<(usize, usize)> {
    let plane = shape.height * shape.width;
    let per_channel = shape.kernel[0] * shape.kernel[1] * rows * cols;
    (plane > 0 && per_channel > 0).then_some((plane, per_channel))
}

/// One channel's rows of the columns matrix (`[taps][rows][cols]`) from its plane of the image.
fn unfold_channel<T: Copy + Default>(
    shape: &ConvShape,
    [rows, cols]: [usize; 2],
    plane: &[T],
    channel: &mut [T],
) {
    for (tap, row) in channel.chunks_exact_mut(rows * cols).enumerate() {
        let (i, line) = shape.tap(tap);
        let (first, end) = line.inside(cols);
        for (oh, out) in row.chunks_exact_mut(cols).enumerate() {
            let Some(h) = shape.image_row(i, oh) else {
                out.fill(T::default());
                continue;
            };
            let src = &plane[h * shape.width..][..shape.width];
            out[..first].fill(T::default());
            out[end..].fill(T::default());
            if line.stride == 1 {
                out[first..end].copy_from_slice(&src[line.column(first)..][..end - first]);
            } else {
                for (ow, o) in (first..end).zip(&mut out[first..end]) {
                    *o = src[line.column(ow)];
                }
            }
        }
    }
}

fn fold_typed<T: Float>(shape: &ConvShape, [rows, cols]: [usize; 2], columns: &[f32], image: &mut [T]) {
    let Some((plane, per_channel)) = channel_sizes(shape, [rows, cols]) else {
        image.fill(T::default());
        return;
    };
    image.par_chunks_mut(plane).zip(columns.par_chunks(per_channel)).for_each_init(
        Vec::new,
        |sums: &mut Vec<f32>, (out, channel)| {
            sums.clear();
            sums.resize(plane, 0.0);
            for (tap, row) in channel.chunks_exact(rows * cols).enumerate() {
                let (i, line) = shape.tap(tap);
                let (first, end) = line.inside(cols);
                for (oh, src) in row.chunks_exact(cols).enumerate() {
                    let Some(h) = shape.image_row(i, oh) else { continue };
                    let dst = &mut sums[h * shape.width..][..shape.width];
                    if line.stride == 1 {
                        let dst = &mut dst[line.column(first)..][..end - first];
                        for (d, &s) in dst.iter_mut().zip(&src[first..end]) {
                            *d += s;
                        }
                    } else {
                        for (ow, &s) in (first..end).zip(&src[first..end]) {
                            dst[line.column(ow)] += s;
                        }
                    }
                }
            }
            T::narrow(sums, out);
        },
    );
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;

    /// Every shape the tests run: odd sizes, padding wider than a tap, strides, dilations, a kernel
    /// as large as the padded image, 1-d (height 1), long strided rows.
    fn shapes() -> Vec<ConvShape> {
        let mut v = Vec::new();
        for (channels, height, width) in [(1, 1, 7), (2, 5, 6), (3, 9, 4), (1, 2, 150)] {
            for kernel in [[1, 1], [1, 3], [3, 3], [2, 4]] {
                for padding in [[0, 0], [1, 2], [3, 1]] {
                    for (stride, dilation) in [([1, 1], [1, 1]), ([2, 3], [1, 1]), ([1, 2], [2, 1])] {
                        let shape = ConvShape {
                            kernel,
                            padding,
                            stride,
                            dilation,
                            ..ConvShape::new(channels, height, width)
                        };
                        if shape.output().is_some() {
                            v.push(shape);
                        }
                    }
                }
            }
        }
        v
    }

    /// The definition, element by element, in f64 (`None` in the padding).
    fn source(s: &ConvShape, [c, i, j]: [usize; 3], [oh, ow]: [usize; 2]) -> Option<usize> {
        let h = (oh * s.stride[0] + i * s.dilation[0]).checked_sub(s.padding[0])?;
        let w = (ow * s.stride[1] + j * s.dilation[1]).checked_sub(s.padding[1])?;
        (h < s.height && w < s.width).then_some((c * s.height + h) * s.width + w)
    }

    fn for_each_entry(s: &ConvShape, mut f: impl FnMut(usize, Option<usize>)) {
        let [rows, cols] = s.output().unwrap();
        let [kh, kw] = s.kernel;
        for c in 0..s.channels {
            for i in 0..kh {
                for j in 0..kw {
                    for oh in 0..rows {
                        for ow in 0..cols {
                            let entry = (((c * kh + i) * kw + j) * rows + oh) * cols + ow;
                            f(entry, source(s, [c, i, j], [oh, ow]));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn unfold_copies_each_patch_element_and_zeros_the_padding() {
        for s in shapes() {
            let image: Vec<f32> = (0..s.image_len()).map(|v| v as f32 + 1.0).collect();
            let mut columns = vec![f32::NAN; s.patch_len() * s.positions()];
            unfold(&s, (&image[..]).into(), (&mut columns[..]).into()).unwrap();
            for_each_entry(&s, |entry, src| {
                let expected = src.map_or(0.0, |at| image[at]);
                assert_eq!(columns[entry], expected, "{s:?} entry {entry}");
            });
        }
    }

    #[test]
    fn fold_adds_each_entry_back_where_unfold_read_it() {
        for s in shapes() {
            let columns: Vec<f32> =
                (0..s.patch_len() * s.positions()).map(|v| (v % 13) as f32 - 6.0).collect();
            let mut expected = vec![0.0f64; s.image_len()];
            for_each_entry(&s, |entry, src| {
                if let Some(at) = src {
                    expected[at] += f64::from(columns[entry]);
                }
            });
            let mut image = vec![f32::NAN; s.image_len()];
            fold(&s, &columns, (&mut image[..]).into()).unwrap();
            // Small integers: every partial sum is exact in f32.
            let got: Vec<f64> = image.iter().map(|&v| f64::from(v)).collect();
            assert_eq!(got, expected, "{s:?}");
        }
    }

    #[test]
    fn fold_sums_in_f32_and_rounds_once_into_half_images() {
        // 9 taps of 1 + 2^-8 on the centre pixel: 9.035 in f32, which bf16 rounds to 9.0625; the taps
        // rounded to bf16 first (1.0 each) would sum to 9.0.
        let s = ConvShape { kernel: [3, 3], padding: [1, 1], ..ConvShape::new(1, 3, 3) };
        let columns = vec![1.0 + 1.0 / 256.0; s.patch_len() * s.positions()];
        let mut image = [bf16::ZERO; 9];
        fold(&s, &columns, (&mut image[..]).into()).unwrap();
        assert_eq!(image[4], bf16::from_f32(9.0 * (1.0 + 1.0 / 256.0)));
    }

    #[test]
    fn unfold_works_in_every_dtype_and_refuses_mixed_ones_and_bad_lengths() {
        let s = ConvShape { kernel: [2, 2], ..ConvShape::new(1, 3, 3) };
        let image: Vec<bf16> = (1..=9).map(|v| bf16::from_f32(v as f32)).collect();
        let mut columns = [bf16::ZERO; 16];
        unfold(&s, (&image[..]).into(), (&mut columns[..]).into()).unwrap();
        assert_eq!(columns[..4], [1.0, 2.0, 4.0, 5.0].map(bf16::from_f32));
        let mut f32_columns = [0.0f32; 16];
        let err = unfold(&s, (&image[..]).into(), (&mut f32_columns[..]).into()).unwrap_err();
        assert_eq!(err, ConvError::Dtype { image: Dtype::Bf16, columns: Dtype::F32 });
        // f32 rounded to bf16 on the way, as `half` rounds (1 + 2^-8 is a tie: to even, 1.0; 1 + 3 *
        // 2^-8 rounds up to 1 + 2^-6).
        let fine: Vec<f32> = (0..9).map(|v| 1.0 + v as f32 / 256.0).collect();
        unfold(&s, (&fine[..]).into(), (&mut columns[..]).into()).unwrap();
        let rounded: Vec<bf16> = [0, 1, 3, 4].map(|at| bf16::from_f32(fine[at])).to_vec();
        assert_eq!(columns[..4], rounded[..]);
        assert_eq!(columns[1], bf16::ONE);
        let err = unfold(&s, (&image[..8]).into(), (&mut columns[..]).into()).unwrap_err();
        assert_eq!(err, ConvError::Length { what: "image", expected: 9, got: 8 });
        let mut f32_image = [0.0f32; 9];
        let err = fold(&s, &f32_columns[..15], (&mut f32_image[..]).into()).unwrap_err();
        assert_eq!(err, ConvError::Length { what: "columns", expected: 16, got: 15 });
        let too_big = ConvShape { kernel: [4, 1], ..s };
        assert_eq!(too_big.output(), None);
        let err = fold(&too_big, &[], (&mut f32_image[..]).into()).unwrap_err();
        assert!(err.to_string().contains("no output"), "{err}");
    }
}
