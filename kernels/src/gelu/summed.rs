//! GELU's backward pass over the rows of a matrix with the sums of its result's columns: the gradient
//! of a Linear's product through GELU and that Linear's bias gradient in one pass, so the gradient can
//! be kept in the half precision the Linear's backward products read while its bias gradient is
//! summed from the f32 values.
//!
//! The rows are split into [`crate::reduce`]'s bands, run on the current rayon pool; a band's results
//! are added into its column sums as they are computed, and the bands' sums combined in band order:
//! the order in which [`crate::reduce::column_sums`] sums a matrix.

use rayon::prelude::*;

use super::value_and_slope_with;
use crate::mul_add::{cpu_fuses, Fused, MulAdd, Separate};
use crate::reduce::{band_sums, combine_bands, BAND};
use crate::slices::Float;
use crate::{GradSlice, GradSliceMut};

/// Elements of a row computed at a time (stack buffers, for inputs or an output that are not f32).
const BLOCK: usize = 256;

/// `dx = dy * gelu'(x)` for row-major `(rows, cols)` matrices `x` and `dy`, computed in f32 and
/// rounded once to `dx`'s dtype (which may differ from `x`'s: a gradient kept in the half precision
/// the products that read it round it to), and `sums` the column sums of the f32 `dx` before that
/// rounding, bit for bit what [`crate::reduce::column_sums`] gives of it. Each element is
/// [`super::backward`]'s.
///
/// # Panics
/// If `x`, `dy` and `dx` are not `rows x cols` for some `rows`, or `sums.len() != cols`.
pub fn backward_with_column_sums(
    x: GradSlice<'_>,
    dy: GradSlice<'_>,
    dx: GradSliceMut<'_>,
    cols: usize,
    sums: &mut [f32],
) {
    assert_eq!(sums.len(), cols, "gelu: one sum per column");
    assert!(
        x.len() == dy.len() && x.len() == dx.len() && (cols == 0 || x.len().is_multiple_of(cols)),
        "gelu: x, dy and dx are not the same (rows, {cols}) matrix"
    );
    match x {
        GradSlice::F32(x) => from_x(x, dy, dx, cols, sums),
        GradSlice::F16(x) => from_x(x, dy, dx, cols, sums),
        GradSlice::Bf16(x) => from_x(x, dy, dx, cols, sums),
    }
}

fn from_x<T: Float>(x: &[T], dy: GradSlice<'_>, dx: GradSliceMut<'_>, cols: usize, sums: &mut [f32]) {
    match dy {
        GradSlice::F32(dy) => from_dy(x, dy, dx, cols, sums),
        GradSlice::F16(dy) => from_dy(x, dy, dx, cols, sums),
        GradSlice::Bf16(dy) => from_dy(x, dy, dx, cols, sums),
    }
}

fn from_dy<T: Float, G: Float>(x: &[T], dy: &[G], dx: GradSliceMut<'_>, cols: usize, sums: &mut [f32]) {
    match dx {
        GradSliceMut::F32(dx) => in_bands(x, dy, dx, cols, sums),
        GradSliceMut::F16(dx) => in_bands(x, dy, dx, cols, sums),
        GradSliceMut::Bf16(dx) => in_bands(x, dy, dx, cols, sums),
    }
}

fn in_bands<T: Float, G: Float, U: Float>(x: &[T], dy: &[G], dx: &mut [U], cols: usize, sums: &mut [f32]) {
    if cols == 0 {
        return;
    }
    let summed = if cpu_fuses() { summed::<Fused> } else { summed::<Separate> };
    let mut bands = band_sums(x.len() / cols, cols);
    let band = BAND * cols;
    let inputs = x.par_chunks(band).zip(dy.par_chunks(band));
    dx.par_chunks_mut(band).zip(inputs).zip(bands.par_chunks_mut(cols)).for_each(|((dx, (x, dy)), sums)| {
        let (mut wide_x, mut wide_dy, mut out) = ([0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK]);
        for ((dx, x), dy) in dx.chunks_exact_mut(cols).zip(x.chunks_exact(cols)).zip(dy.chunks_exact(cols)) {
            let pieces = dx.chunks_mut(BLOCK).zip(x.chunks(BLOCK)).zip(dy.chunks(BLOCK));
            for (((dx, x), dy), sums) in pieces.zip(sums.chunks_mut(BLOCK)) {
                let n = x.len();
                // f32 inputs are read where they lie, an f32 output written where it lies.
                let x = T::as_f32(x).unwrap_or_else(|| {
                    T::widen(x, &mut wide_x[..n]);
                    &wide_x[..n]
                });
                let dy = G::as_f32(dy).unwrap_or_else(|| {
                    G::widen(dy, &mut wide_dy[..n]);
                    &wide_dy[..n]
                });
                match U::as_f32_mut(dx) {
                    Some(dx) => summed(x, dy, dx, sums),
                    None => {
                        summed(x, dy, &mut out[..n], sums);
                        U::narrow(&out[..n], dx);
                    }
                }
            }
        }
    });
    combine_bands(&bands, cols, sums);
}

widest_vectors! {
    /// `out = dy * gelu'(x)` for a block, multiply-adds as `A` does them, and `sums += out`.
    fn summed<A: MulAdd>(x: &[f32], dy: &[f32], out: &mut [f32], sums: &mut [f32]) => summed_any;
}

#[inline(always)]
fn summed_any<A: MulAdd>(x: &[f32], dy: &[f32], out: &mut [f32], sums: &mut [f32]) {
    for (((out, sum), &x), &dy) in out.iter_mut().zip(sums).zip(x).zip(dy) {
        let dx = dy * value_and_slope_with::<A>(x).1;
        *out = dx;
        *sum += dx;
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;
    use crate::reduce::column_sums;
    use crate::Dtype;

    /// Values held in one of the three dtypes.
    enum Held {
        F32(Vec<f32>),
        F16(Vec<f16>),
        Bf16(Vec<bf16>),
    }

    impl Held {
        /// `v` rounded to `dtype`.
        fn new(dtype: Dtype, v: &[f32]) -> Held {
            match dtype {
                Dtype::F32 => Held::F32(v.to_vec()),
                Dtype::F16 => Held::F16(v.iter().map(|&x| f16::from_f32(x)).collect()),
                Dtype::Bf16 => Held::Bf16(v.iter().map(|&x| bf16::from_f32(x)).collect()),
            }
        }

        fn view(&self) -> GradSlice<'_> {
            match self {
                Held::F32(v) => GradSlice::F32(v),
                Held::F16(v) => GradSlice::F16(v),
                Held::Bf16(v) => GradSlice::Bf16(v),
            }
        }

        fn view_mut(&mut self) -> GradSliceMut<'_> {
            match self {
                Held::F32(v) => GradSliceMut::F32(v),
                Held::F16(v) => GradSliceMut::F16(v),
                Held::Bf16(v) => GradSliceMut::Bf16(v),
            }
        }

        fn to_f32(&self) -> Vec<f32> {
            match self {
                Held::F32(v) => v.clone(),
                Held::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
                Held::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
            }
        }
    }

    /// `x` and `dy` rounded to their dtypes, the f32 values they then hold, and the pass's `dx` of its
    /// dtype (as f32) and sums.
    fn run(
        (x, dy): (&[f32], &[f32]),
        (x_dtype, dy_dtype, dx_dtype): (Dtype, Dtype, Dtype),
        cols: usize,
    ) -> ([Vec<f32>; 2], Vec<f32>, Vec<f32>) {
        let (x, dy) = (Held::new(x_dtype, x), Held::new(dy_dtype, dy));
        let mut dx = Held::new(dx_dtype, &vec![f32::NAN; x.view().len()]);
        let mut sums = vec![f32::NAN; cols];
        backward_with_column_sums(x.view(), dy.view(), dx.view_mut(), cols, &mut sums);
        ([x.to_f32(), dy.to_f32()], dx.to_f32(), sums)
    }

    /// What the pass replaces: GELU's backward of the (widened) inputs into f32, its column sums, then
    /// the rounding to `dx`'s dtype; on a pool of 3 threads.
    #[test]
    fn is_the_f32_backward_rounded_once_and_its_column_sums_bit_for_bit() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("a pool");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let dtypes = [
            (Dtype::F32, Dtype::F32, Dtype::F32),
            (Dtype::F32, Dtype::F32, Dtype::Bf16),
            (Dtype::F16, Dtype::Bf16, Dtype::F16),
            (Dtype::Bf16, Dtype::F32, Dtype::F32),
        ];
        for (rows, cols) in [(0, 5), (1, 1), (3, 17), (7, 300), (64, 1024), (33, 513)] {
            let n = rows * cols;
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919 % 2003) as f32 - 1001.0) * 7.3e-3).collect();
            let dy: Vec<f32> = (0..n).map(|i| ((i * 104_729 % 1009) as f32 - 504.0) * 1.1e-2).collect();
            for dtypes in dtypes {
                let ([x, dy], dx, sums) = pool.install(|| run((&x, &dy), dtypes, cols));
                let mut want = vec![0f32; n];
                crate::gelu::backward(GradSlice::F32(&x), GradSlice::F32(&dy), GradSliceMut::F32(&mut want));
                let mut want_sums = vec![0f32; cols];
                column_sums(GradSlice::F32(&want), rows, cols, &mut want_sums);
                let rounded: Vec<f32> = match dtypes.2 {
                    Dtype::F32 => want,
                    Dtype::F16 => want.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
                    Dtype::Bf16 => want.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
                };
                assert_eq!(bits(&dx), bits(&rounded), "dx {rows} x {cols} {dtypes:?}");
                assert_eq!(bits(&sums), bits(&want_sums), "sums {rows} x {cols} {dtypes:?}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "not the same")]
    fn a_matrix_of_another_width_is_refused() {
        let x = [0f32; 6];
        backward_with_column_sums(
            GradSlice::F32(&x),
            GradSlice::F32(&x),
            GradSliceMut::F32(&mut [0f32; 6]),
            4,
            &mut [0f32; 4],
        );
    }
}
