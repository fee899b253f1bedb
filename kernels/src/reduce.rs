//! Column sums of a row-major matrix in f32: the bias gradient of a linear layer (the upstream gradient
//! summed over its rows), and any reduction over the leading dimension.
//!
//! The rows are split into fixed bands of 32 rows (`BAND`) run on the current rayon pool (each a
//! contiguous stretch of memory, streamed past its band's sums in L1); each column is summed within a
//! band in row order in one f32 accumulator, then across bands in band order, so the result is
//! deterministic and does not depend on the thread count. The loops are plain Rust the compiler
//! vectorises, compiled a second time with AVX-512 or AVX2 enabled and chosen at run time. A kernel
//! that produces such a matrix can sum it as it writes it, in the same order: `band_sums` and
//! `combine_bands` (GELU's backward pass with its bias gradient, `crate::gelu`).

use half::{bf16, f16};
use rayon::prelude::*;

use crate::slices::Float;
use crate::{GradSlice, GradSliceMut};

/// Rows per band.
pub(crate) const BAND: usize = 32;

/// Below this many elements the sums run on the calling thread.
const PARALLEL_ELEMENTS: usize = 1 << 16;

/// `out[j] = sum over i of src[i * cols + j]` for a row-major `rows x cols` matrix (f16 and bf16
/// widened exactly), in f32: within each band of 32 rows in row order, then the bands' sums in band
/// order (a matrix of at most 32 rows is summed in row order).
///
/// # Panics
/// If `src.len() != rows * cols` or `out.len() != cols`.
pub fn column_sums(src: GradSlice<'_>, rows: usize, cols: usize, out: &mut [f32]) {
    assert_eq!(src.len(), rows * cols, "column_sums: the source is not rows x cols");
    assert_eq!(out.len(), cols, "column_sums: one output per column");
    match src {
        GradSlice::F32(s) => in_bands(s, rows, cols, out),
        GradSlice::F16(s) => in_bands(s, rows, cols, out),
        GradSlice::Bf16(s) => in_bands(s, rows, cols, out),
    }
}

/// `dst = src` rounded to `dst`'s dtype (to nearest even; a copy for f32) and `sums` the column sums of
/// the f32 `src`, bit for bit what [`column_sums`] gives of it, in one pass: a gradient kept in the half
/// precision its products read, with its bias gradient from the values before the rounding.
///
/// # Panics
/// If `src` and `dst` differ in length, are not whole rows of `cols`, or `sums.len() != cols`.
pub fn rounded_with_column_sums(src: &[f32], dst: GradSliceMut<'_>, cols: usize, sums: &mut [f32]) {
    assert_eq!(sums.len(), cols, "rounded_with_column_sums: one sum per column");
    assert!(
        src.len() == dst.len() && (cols == 0 || src.len().is_multiple_of(cols)),
        "rounded_with_column_sums: src and dst are not the same (rows, {cols}) matrix"
    );
    match dst {
        GradSliceMut::F32(d) => rounded_in_bands(src, d, cols, sums),
        GradSliceMut::F16(d) => rounded_in_bands(src, d, cols, sums),
        GradSliceMut::Bf16(d) => rounded_in_bands(src, d, cols, sums),
    }
}

fn rounded_in_bands<T: Float>(src: &[f32], dst: &mut [T], cols: usize, sums: &mut [f32]) {
    if cols == 0 {
        return;
    }
    let rows = src.len() / cols;
    let mut bands = band_sums(rows, cols);
    let band = |((src, dst), sums): ((&[f32], &mut [T]), &mut [f32])| {
        for (row, out) in src.chunks_exact(cols).zip(dst.chunks_exact_mut(cols)) {
            add_rows(row, sums);
            T::narrow(row, out);
        }
    };
    if rows * cols >= PARALLEL_ELEMENTS {
        let parts = src.par_chunks(BAND * cols).zip(dst.par_chunks_mut(BAND * cols));
        parts.zip(bands.par_chunks_mut(cols)).for_each(band);
    } else {
        src.chunks(BAND * cols).zip(dst.chunks_mut(BAND * cols)).zip(bands.chunks_mut(cols)).for_each(band);
    }
    combine_bands(&bands, cols, sums);
}

/// Zeroed sums for every band of a `rows x cols` matrix, band by band (`cols` each): what a band's
/// rows are added into, in row order.
pub(crate) fn band_sums(rows: usize, cols: usize) -> Vec<f32> {
    vec![0f32; rows.div_ceil(BAND) * cols]
}

/// `out[j]`: the bands' sums of column `j` added in band order (`out` is band 0's where there is one
/// band, zeros where there is none).
pub(crate) fn combine_bands(bands: &[f32], cols: usize, out: &mut [f32]) {
    let mut bands = bands.chunks_exact(cols.max(1));
    match bands.next() {
        Some(first) => out.copy_from_slice(first),
        None => out.fill(0.0),
    }
    for band in bands {
        add(band, out);
    }
}

trait Widen: Copy + Send + Sync {
    fn widen(self) -> f32;
}

impl Widen for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Widen for f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        crate::branchless::f16_to_f32(self)
    }
}

impl Widen for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
}

fn in_bands<T: Widen>(src: &[T], rows: usize, cols: usize, out: &mut [f32]) {
    if cols == 0 {
        return;
    }
    let mut sums = band_sums(rows, cols);
    let band = |(rows, sums): (&[T], &mut [f32])| add_rows(rows, sums);
    if rows * cols >= PARALLEL_ELEMENTS {
        src.par_chunks(BAND * cols).zip(sums.par_chunks_mut(cols)).for_each(band);
    } else {
        src.chunks(BAND * cols).zip(sums.chunks_mut(cols)).for_each(band);
    }
    combine_bands(&sums, cols, out);
}

widest_vectors! {
    /// `sums[j] += row[j]` for every row of `rows` (`sums.len()` columns each), in row order.
    fn add_rows<T: Widen>(rows: &[T], sums: &mut [f32]) => add_rows_any;
}

#[inline(always)]
fn add_rows_any<T: Widen>(rows: &[T], sums: &mut [f32]) {
    for row in rows.chunks_exact(sums.len()) {
        for (s, &x) in sums.iter_mut().zip(row) {
            *s += x.widen();
        }
    }
}

widest_vectors! {
    /// `sums[j] += row[j]`.
    fn add(row: &[f32], sums: &mut [f32]) => add_any;
}

#[inline(always)]
fn add_any(row: &[f32], sums: &mut [f32]) {
    for (s, &x) in sums.iter_mut().zip(row) {
        *s += x;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, one column at a time: f32 sums of each band's rows in row order, then of the
    /// bands' sums in band order.
    fn reference(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let band = |j: usize, b: usize| {
            (b * BAND..rows.min((b + 1) * BAND)).fold(0f32, |s, i| s + src[i * cols + j])
        };
        (0..cols).map(|j| (1..rows.div_ceil(BAND)).fold(band(j, 0), |s, b| s + band(j, b))).collect()
    }

    #[test]
    fn every_shape_and_dtype_is_the_banded_sum_bit_for_bit() {
        for (rows, cols) in
            [(0, 3), (1, 1), (3, 5), (7, 257), (32, 9), (33, 9), (300, 513), (1000, 300), (5, 0)]
        {
            let src: Vec<f32> =
                (0..rows * cols).map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 0.37e-2).collect();
            let mut out = vec![f32::NAN; cols];
            column_sums(GradSlice::F32(&src), rows, cols, &mut out);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&out), bits(&reference(&src, rows, cols)), "f32 {rows} x {cols}");
            let halves: Vec<bf16> = src.iter().map(|&x| bf16::from_f32(x)).collect();
            let widened: Vec<f32> = halves.iter().map(|x| x.to_f32()).collect();
            column_sums(GradSlice::Bf16(&halves), rows, cols, &mut out);
            assert_eq!(bits(&out), bits(&reference(&widened, rows, cols)), "bf16 {rows} x {cols}");
            let halves: Vec<f16> = src.iter().map(|&x| f16::from_f32(x)).collect();
            let widened: Vec<f32> = halves.iter().map(|x| x.to_f32()).collect();
            column_sums(GradSlice::F16(&halves), rows, cols, &mut out);
            assert_eq!(bits(&out), bits(&reference(&widened, rows, cols)), "f16 {rows} x {cols}");
        }
    }

    #[test]
    fn rounding_with_the_sums_is_the_rounding_and_the_sums_of_the_f32_values() {
        for (rows, cols) in [(0, 3), (1, 1), (33, 9), (300, 513), (1000, 300), (5, 0)] {
            let src: Vec<f32> =
                (0..rows * cols).map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 0.37e-2).collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let want = reference(&src, rows, cols);
            let (mut sums, mut halves) = (vec![f32::NAN; cols], vec![bf16::ZERO; rows * cols]);
            rounded_with_column_sums(&src, GradSliceMut::Bf16(&mut halves), cols, &mut sums);
            assert_eq!(bits(&sums), bits(&want), "bf16 sums {rows} x {cols}");
            assert!(halves.iter().zip(&src).all(|(h, &x)| h.to_bits() == bf16::from_f32(x).to_bits()));
            let mut f16s = vec![f16::ZERO; rows * cols];
            rounded_with_column_sums(&src, GradSliceMut::F16(&mut f16s), cols, &mut sums);
            assert_eq!(bits(&sums), bits(&want), "f16 sums {rows} x {cols}");
            assert!(f16s.iter().zip(&src).all(|(h, &x)| h.to_bits() == f16::from_f32(x).to_bits()));
            let mut copy = vec![f32::NAN; rows * cols];
            rounded_with_column_sums(&src, GradSliceMut::F32(&mut copy), cols, &mut sums);
            assert_eq!((bits(&copy), bits(&sums)), (bits(&src), bits(&want)), "f32 {rows} x {cols}");
        }
    }

    #[test]
    fn infinities_and_nans_propagate() {
        let src = [1.0, f32::INFINITY, 2.0, f32::NAN, 3.0, 1.0];
        let mut out = [0f32; 2];
        column_sums(GradSlice::F32(&src), 3, 2, &mut out);
        assert_eq!(out[0], 6.0);
        assert!(out[1].is_nan());
    }
}
