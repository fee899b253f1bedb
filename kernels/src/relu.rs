//! ReLU, forward in place and backward, over f32, f16 or bf16 elements.
//!
//! `relu(x) = x < 0 ? 0 : x`: a NaN stays NaN (so a loss scaler still sees an overflow that reached an
//! activation) and `-0` stays `-0`. The backward is PyTorch's: `dx = y > 0 ? dy : 0` from the output
//! `y`, so the slope at 0 is 0 (candle's own `relu` backward takes it as 1), and a NaN output passes no
//! gradient. Both are exact in every dtype (a select, no arithmetic), and both run in fixed chunks on the
//! current rayon pool, widened to f32 by blocks where the dtype is half (f32 read where it lies), with
//! loops compiled for the widest vector extension the CPU has.

use rayon::prelude::*;

use crate::slices::Float;
use crate::{GradSlice, GradSliceMut};

/// Floats per parallel chunk: large enough that a chunk's work outweighs scheduling it.
const CHUNK: usize = 16 * 1024;
/// Floats widened, computed and narrowed at a time (stack buffers).
const BLOCK: usize = 256;

/// `y = relu(x)`, `y` in `x`'s dtype, in one pass.
///
/// # Panics
/// If the lengths or the dtypes differ.
pub fn forward(x: GradSlice<'_>, y: GradSliceMut<'_>) {
    assert_eq!(x.len(), y.len(), "relu: x and y lengths");
    match (x, y) {
        (GradSlice::F32(x), GradSliceMut::F32(y)) => map(x, y),
        (GradSlice::F16(x), GradSliceMut::F16(y)) => map(x, y),
        (GradSlice::Bf16(x), GradSliceMut::Bf16(y)) => map(x, y),
        (x, y) => panic!("relu: x is {:?} but y is {:?}", x.dtype(), y.dtype()),
    }
}

/// `y = relu(y)` in place.
pub fn forward_in_place(y: GradSliceMut<'_>) {
    match y {
        GradSliceMut::F32(y) => y.par_chunks_mut(CHUNK).for_each(clamp_block),
        GradSliceMut::F16(y) => in_place(y),
        GradSliceMut::Bf16(y) => in_place(y),
    }
}

/// `dx = y > 0 ? dy : 0` from the forward's output `y` (any float dtype), `dx` in `dy`'s dtype.
///
/// # Panics
/// If the lengths differ, or `dx`'s dtype is not `dy`'s.
pub fn backward(y: GradSlice<'_>, dy: GradSlice<'_>, dx: GradSliceMut<'_>) {
    assert_eq!((y.len(), dy.len()), (dx.len(), dx.len()), "relu: y, dy and dx lengths");
    match (y, dy, dx) {
        // All f32 (an fp32 model, or a mixed one's f32 activations): no widening copies.
        (GradSlice::F32(y), GradSlice::F32(dy), GradSliceMut::F32(dx)) => {
            let chunks = dx.par_chunks_mut(CHUNK).zip(y.par_chunks(CHUNK).zip(dy.par_chunks(CHUNK)));
            chunks.for_each(|(dx, (y, dy))| mask_block(y, dy, dx));
        }
        (GradSlice::F32(y), dy, dx) => backward_from(y, dy, dx),
        (GradSlice::F16(y), dy, dx) => backward_from(y, dy, dx),
        (GradSlice::Bf16(y), dy, dx) => backward_from(y, dy, dx),
    }
}

fn backward_from<Y: Float>(y: &[Y], dy: GradSlice<'_>, dx: GradSliceMut<'_>) {
    match (dy, dx) {
        (GradSlice::F32(dy), GradSliceMut::F32(dx)) => masked(y, dy, dx),
        (GradSlice::F16(dy), GradSliceMut::F16(dx)) => masked(y, dy, dx),
        (GradSlice::Bf16(dy), GradSliceMut::Bf16(dx)) => masked(y, dy, dx),
        (dy, dx) => panic!("relu: dy is {:?} but dx is {:?}", dy.dtype(), dx.dtype()),
    }
}

fn in_place<T: Float>(y: &mut [T]) {
    y.par_chunks_mut(CHUNK).for_each(|y| {
        if let Some(y) = T::as_f32_mut(y) {
            return clamp_block(y);
        }
        let mut wide = [0f32; BLOCK];
        for y in y.chunks_mut(BLOCK) {
            let wide = &mut wide[..y.len()];
            T::widen(y, wide);
            clamp_block(wide);
            T::narrow(wide, y);
        }
    });
}

fn map<T: Float>(x: &[T], y: &mut [T]) {
    y.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).for_each(|(y, x)| {
        if let (Some(x), Some(y)) = (T::as_f32(x), T::as_f32_mut(y)) {
            return clamp_into(x, y);
        }
        let mut wide = [0f32; BLOCK];
        for (y, x) in y.chunks_mut(BLOCK).zip(x.chunks(BLOCK)) {
            let wide = &mut wide[..x.len()];
            T::widen(x, wide);
            clamp_block(wide);
            T::narrow(wide, y);
        }
    });
}

fn masked<Y: Float, G: Float>(y: &[Y], dy: &[G], dx: &mut [G]) {
    dx.par_chunks_mut(CHUNK).zip(y.par_chunks(CHUNK).zip(dy.par_chunks(CHUNK))).for_each(|(dx, (y, dy))| {
        if let (Some(y), Some(dy), Some(dx)) = (Y::as_f32(y), G::as_f32(dy), G::as_f32_mut(dx)) {
            return mask_block(y, dy, dx);
        }
        let (mut out, mut grad, mut wide) = ([0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK]);
        for (dx, (y, dy)) in dx.chunks_mut(BLOCK).zip(y.chunks(BLOCK).zip(dy.chunks(BLOCK))) {
            let n = y.len();
            let (out, grad, wide) = (&mut out[..n], &mut grad[..n], &mut wide[..n]);
            Y::widen(y, out);
            G::widen(dy, grad);
            mask_block(out, grad, wide);
            G::narrow(wide, dx);
        }
    });
}

widest_vectors! {
    /// `x = relu(x)` for a block.
    fn clamp_block(x: &mut [f32]) => clamp_any;
}

#[inline(always)]
fn clamp_any(x: &mut [f32]) {
    for x in x {
        *x = if *x < 0.0 { 0.0 } else { *x };
    }
}

widest_vectors! {
    /// `y = relu(x)` for a block.
    fn clamp_into(x: &[f32], y: &mut [f32]) => clamp_into_any;
}

#[inline(always)]
fn clamp_into_any(x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = if x < 0.0 { 0.0 } else { x };
    }
}

widest_vectors! {
    /// `dx = y > 0 ? dy : 0` for a block.
    fn mask_block(y: &[f32], dy: &[f32], dx: &mut [f32]) => mask_any;
}

#[inline(always)]
fn mask_any(y: &[f32], dy: &[f32], dx: &mut [f32]) {
    for ((dx, &y), &dy) in dx.iter_mut().zip(y).zip(dy) {
        *dx = if y > 0.0 { dy } else { 0.0 };
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;

    /// Inputs around every case: negatives, zeros of both signs, positives, infinities, NaNs of both
    /// signs, subnormals; repeated past the block and chunk edges.
    fn inputs(n: usize) -> Vec<f32> {
        let special = [
            -3.5,
            -0.0,
            0.0,
            2.25,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            -1e-40,
            1e-40,
            f32::MIN_POSITIVE,
        ];
        (0..n)
            .map(|i| if i % 3 == 0 { special[i / 3 % special.len()] } else { (i % 17) as f32 - 8.5 })
            .collect()
    }

    /// The definition, on one value.
    fn relu(x: f32) -> f32 {
        if x < 0.0 {
            0.0
        } else {
            x
        }
    }

    #[test]
    fn f32_is_the_definition_bit_for_bit() {
        for n in [1, BLOCK - 1, BLOCK + 1, CHUNK + 3, 2 * CHUNK + BLOCK + 7] {
            let x = inputs(n);
            let mut y = x.clone();
            forward_in_place(GradSliceMut::F32(&mut y));
            let mut fresh = vec![f32::NAN; n];
            forward(GradSlice::F32(&x), GradSliceMut::F32(&mut fresh));
            assert!(y.iter().zip(&fresh).all(|(a, b)| a.to_bits() == b.to_bits()), "n {n}: forward");
            let dy: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
            let mut dx = vec![f32::NAN; n];
            backward(GradSlice::F32(&y), GradSlice::F32(&dy), GradSliceMut::F32(&mut dx));
            for i in 0..n {
                assert_eq!(y[i].to_bits(), relu(x[i]).to_bits(), "y[{i}] of {}", x[i]);
                let want = if y[i] > 0.0 { dy[i] } else { 0.0 };
                assert_eq!(dx[i].to_bits(), want.to_bits(), "dx[{i}] at y {}", y[i]);
            }
            // NaN in, NaN out; -0 stays -0; the slope at 0 and at NaN is 0.
            assert!(x.iter().zip(&y).all(|(x, y)| x.is_nan() == y.is_nan()));
        }
    }

    #[test]
    fn half_dtypes_are_exact_and_keep_their_dtype() {
        let n = CHUNK + 2 * BLOCK + 5;
        let x = inputs(n);
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let (mut yb, mut yh) = (xb.clone(), xh.clone());
        forward_in_place(GradSliceMut::Bf16(&mut yb));
        forward_in_place(GradSliceMut::F16(&mut yh));
        let (mut fb, mut fh) = (vec![bf16::NAN; n], vec![f16::NAN; n]);
        forward(GradSlice::Bf16(&xb), GradSliceMut::Bf16(&mut fb));
        forward(GradSlice::F16(&xh), GradSliceMut::F16(&mut fh));
        assert!(yb.iter().zip(&fb).all(|(a, b)| a.to_bits() == b.to_bits()), "bf16 forward");
        assert!(yh.iter().zip(&fh).all(|(a, b)| a.to_bits() == b.to_bits()), "f16 forward");
        for i in 0..n {
            assert_eq!(yb[i].to_bits(), bf16::from_f32(relu(xb[i].to_f32())).to_bits(), "bf16 [{i}]");
            assert_eq!(yh[i].to_bits(), f16::from_f32(relu(xh[i].to_f32())).to_bits(), "f16 [{i}]");
        }
        // A bf16 output masking an f16 gradient: dx in f16.
        let dy: Vec<f16> = (0..n).map(|i| f16::from_f32((i % 9) as f32 - 4.0)).collect();
        let mut dx = vec![f16::NAN; n];
        backward(GradSlice::Bf16(&yb), GradSlice::F16(&dy), GradSliceMut::F16(&mut dx));
        for i in 0..n {
            let want = if yb[i].to_f32() > 0.0 { dy[i] } else { f16::ZERO };
            assert_eq!(dx[i].to_bits(), want.to_bits(), "dx[{i}]");
        }
    }

    #[test]
    #[should_panic(expected = "relu: dy is F32 but dx is Bf16")]
    fn a_gradient_of_another_dtype_is_refused() {
        let (y, dy, mut dx) = ([1f32], [1f32], [bf16::ZERO]);
        backward(GradSlice::F32(&y), GradSlice::F32(&dy), GradSliceMut::Bf16(&mut dx));
    }
}
