//! The elementwise activations' driver: a function of one f32 and its slope ([`Activation`]), run
//! forward (`y = f(x)`) and backward (`dx = dy * f'(x)`) over f32, f16 or bf16 elements, computed in
//! f32 and rounded once to the output's dtype.
//!
//! Floats are split into fixed chunks on the current rayon pool; inside a chunk, blocks are widened to
//! f32, computed by loops compiled for the widest vector extension the CPU has, and narrowed (f32
//! chunks are computed where they lie, without the copies). The multiply-adds are fused where the CPU
//! has FMA ([`crate::mul_add`]). Each element's result is the same on every path and thread count of
//! every CPU with FMA. GELU ([`crate::gelu`]) and SiLU ([`crate::silu`]) run on it.

use rayon::prelude::*;

use crate::mul_add::{cpu_fuses, Fused, MulAdd, Separate};
use crate::slices::Float;
use crate::{GradSlice, GradSliceMut};

/// Floats per parallel chunk: large enough that a chunk's work outweighs scheduling it.
pub(crate) const CHUNK: usize = 8192;
/// Floats widened, computed and narrowed at a time (stack buffers).
pub(crate) const BLOCK: usize = 256;

/// An elementwise function and its slope, in f32, with multiply-adds as `A` does them.
pub(crate) trait Activation: 'static {
    /// The name panics give.
    const NAME: &'static str;

    /// `f(x)` and `f'(x)`.
    fn value_and_slope<A: MulAdd>(x: f32) -> (f32, f32);
}

/// `f(x)` and `f'(x)` as the kernels compute them on this CPU: multiply-adds fused where it has FMA.
pub(crate) fn value_and_slope<F: Activation>(x: f32) -> (f32, f32) {
    if cpu_fuses() {
        F::value_and_slope::<Fused>(x)
    } else {
        F::value_and_slope::<Separate>(x)
    }
}

/// `y = f(x)`, computed in f32 and rounded once to `y`'s dtype, which may differ from `x`'s.
///
/// # Panics
/// If the lengths differ.
pub(crate) fn forward<F: Activation>(x: GradSlice<'_>, y: GradSliceMut<'_>) {
    assert_eq!(x.len(), y.len(), "{}: x and y lengths", F::NAME);
    match x {
        GradSlice::F32(x) => forward_from::<F, _>(x, y),
        GradSlice::F16(x) => forward_from::<F, _>(x, y),
        GradSlice::Bf16(x) => forward_from::<F, _>(x, y),
    }
}

fn forward_from<F: Activation, T: Float>(x: &[T], y: GradSliceMut<'_>) {
    match y {
        GradSliceMut::F32(y) => map::<F, _, _>(x, y),
        GradSliceMut::F16(y) => map::<F, _, _>(x, y),
        GradSliceMut::Bf16(y) => map::<F, _, _>(x, y),
    }
}

/// `dx = dy * f'(x)`, `dx` in `x`'s dtype, `dy` of any.
///
/// # Panics
/// If the lengths differ, or `dx`'s dtype is not `x`'s.
pub(crate) fn backward<F: Activation>(x: GradSlice<'_>, dy: GradSlice<'_>, dx: GradSliceMut<'_>) {
    assert_eq!((x.len(), dy.len()), (dx.len(), dx.len()), "{}: x, dy and dx lengths", F::NAME);
    match dy {
        GradSlice::F32(dy) => backward_from::<F, _>(x, dy, dx),
        GradSlice::F16(dy) => backward_from::<F, _>(x, dy, dx),
        GradSlice::Bf16(dy) => backward_from::<F, _>(x, dy, dx),
    }
}

fn backward_from<F: Activation, G: Float>(x: GradSlice<'_>, dy: &[G], dx: GradSliceMut<'_>) {
    match (x, dx) {
        (GradSlice::F32(x), GradSliceMut::F32(dx)) => map_with::<F, _, _>(x, dy, dx),
        (GradSlice::F16(x), GradSliceMut::F16(dx)) => map_with::<F, _, _>(x, dy, dx),
        (GradSlice::Bf16(x), GradSliceMut::Bf16(dx)) => map_with::<F, _, _>(x, dy, dx),
        (x, dx) => panic!("{}: x is {:?} but dx is {:?}", F::NAME, x.dtype(), dx.dtype()),
    }
}

fn map<F: Activation, T: Float, U: Float>(x: &[T], y: &mut [U]) {
    let values = if cpu_fuses() { values::<F, Fused> } else { values::<F, Separate> };
    y.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).for_each(|(y, x)| {
        if let (Some(x), Some(y)) = (T::as_f32(x), U::as_f32_mut(y)) {
            return values(x, y);
        }
        let (mut wide, mut out) = ([0f32; BLOCK], [0f32; BLOCK]);
        for (y, x) in y.chunks_mut(BLOCK).zip(x.chunks(BLOCK)) {
            let n = x.len();
            // f32 inputs are read where they lie; half ones widened first.
            let x = match T::as_f32(x) {
                Some(x) => x,
                None => {
                    T::widen(x, &mut wide[..n]);
                    &wide[..n]
                }
            };
            values(x, &mut out[..n]);
            U::narrow(&out[..n], y);
        }
    });
}

fn map_with<F: Activation, T: Float, G: Float>(x: &[T], dy: &[G], dx: &mut [T]) {
    let gradients = if cpu_fuses() { gradients::<F, Fused> } else { gradients::<F, Separate> };
    dx.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK).zip(dy.par_chunks(CHUNK))).for_each(|(dx, (x, dy))| {
        if let (Some(x), Some(dy), Some(dx)) = (T::as_f32(x), G::as_f32(dy), T::as_f32_mut(dx)) {
            return gradients(x, dy, dx);
        }
        let (mut wide, mut grad, mut out) = ([0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK]);
        for (dx, (x, dy)) in dx.chunks_mut(BLOCK).zip(x.chunks(BLOCK).zip(dy.chunks(BLOCK))) {
            let n = x.len();
            let (wide, grad, out) = (&mut wide[..n], &mut grad[..n], &mut out[..n]);
            T::widen(x, wide);
            G::widen(dy, grad);
            gradients(wide, grad, out);
            T::narrow(out, dx);
        }
    });
}

widest_vectors! {
    /// `out = f(x)` for a block, multiply-adds as `A` does them.
    pub(crate) fn values<F: Activation, A: MulAdd>(x: &[f32], out: &mut [f32]) => values_any;
}

#[inline(always)]
fn values_any<F: Activation, A: MulAdd>(x: &[f32], out: &mut [f32]) {
    for (out, &x) in out.iter_mut().zip(x) {
        *out = F::value_and_slope::<A>(x).0;
    }
}

widest_vectors! {
    /// `out = dy * f'(x)` for a block, multiply-adds as `A` does them.
    pub(crate) fn gradients<F: Activation, A: MulAdd>(x: &[f32], dy: &[f32], out: &mut [f32]) => gradients_any;
}

#[inline(always)]
fn gradients_any<F: Activation, A: MulAdd>(x: &[f32], dy: &[f32], out: &mut [f32]) {
    for ((out, &x), &dy) in out.iter_mut().zip(x).zip(dy) {
        *out = dy * F::value_and_slope::<A>(x).1;
    }
}
