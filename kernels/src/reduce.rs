//! Column sums of a row-major matrix in f32: the bias gradient of a linear layer (the upstream gradient
//! summed over its rows), and any reduction over the leading dimension.
//!
//! Each column is summed in row order in one f32 accumulator, so the result is deterministic and does
//! not depend on the thread count; columns are split into blocks run on the current rayon pool, each
//! block's accumulators held in L1 while the rows stream past (a loop the compiler vectorises; it is
//! compiled a second time with AVX-512 or AVX2 enabled and chosen at run time).

use half::{bf16, f16};
use rayon::prelude::*;

use crate::GradSlice;

/// Columns per block: 1 KiB of f32 accumulators.
const BLOCK: usize = 256;

/// Below this many elements the sums run on the calling thread.
const PARALLEL_ELEMENTS: usize = 1 << 16;

/// `out[j] = sum over i of src[i * cols + j]` for a row-major `rows x cols` matrix (f16 and bf16
/// widened exactly), each sum taken in row order in f32.
///
/// # Panics
/// If `src.len() != rows * cols` or `out.len() != cols`.
pub fn column_sums(src: GradSlice<'_>, rows: usize, cols: usize, out: &mut [f32]) {
    assert_eq!(src.len(), rows * cols, "column_sums: the source is not rows x cols");
    assert_eq!(out.len(), cols, "column_sums: one output per column");
    match src {
        GradSlice::F32(s) => dispatch(s, rows, cols, out),
        GradSlice::F16(s) => dispatch(s, rows, cols, out),
        GradSlice::Bf16(s) => dispatch(s, rows, cols, out),
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

fn dispatch<T: Widen>(src: &[T], rows: usize, cols: usize, out: &mut [f32]) {
    let block = |(b, out): (usize, &mut [f32])| sum_block(src, rows, cols, b * BLOCK, out);
    if rows * cols >= PARALLEL_ELEMENTS {
        out.par_chunks_mut(BLOCK).enumerate().for_each(block);
    } else {
        out.chunks_mut(BLOCK).enumerate().for_each(block);
    }
}

widest_vectors! {
    /// Sums columns `first..first + out.len()`.
    fn sum_block<T: Widen>(src: &[T], rows: usize, cols: usize, first: usize, out: &mut [f32]) => sum_block_any;
}

#[inline(always)]
fn sum_block_any<T: Widen>(src: &[T], rows: usize, cols: usize, first: usize, out: &mut [f32]) {
    let mut acc = [0f32; BLOCK];
    let acc = &mut acc[..out.len()];
    for row in src.chunks_exact(cols).take(rows) {
        for (a, &x) in acc.iter_mut().zip(&row[first..first + out.len()]) {
            *a += x.widen();
        }
    }
    out.copy_from_slice(acc);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row-order f32 sums, one column at a time: the definition.
    fn reference(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        (0..cols).map(|j| (0..rows).fold(0f32, |s, i| s + src[i * cols + j])).collect()
    }

    #[test]
    fn every_shape_and_dtype_is_the_row_order_sum_bit_for_bit() {
        for (rows, cols) in [(0, 3), (1, 1), (3, 5), (7, 257), (300, 513), (1000, 300), (5, 0)] {
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
    fn infinities_and_nans_propagate() {
        let src = [1.0, f32::INFINITY, 2.0, f32::NAN, 3.0, 1.0];
        let mut out = [0f32; 2];
        column_sums(GradSlice::F32(&src), 3, 2, &mut out);
        assert_eq!(out[0], 6.0);
        assert!(out[1].is_nan());
    }
}
