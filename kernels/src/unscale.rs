//! Multi-tensor gradient unscale with non-finite detection, in one pass.
//!
//! For every element `x` of every gradient: `y = x * inv_scale` computed in f32 and stored back in the
//! gradient's own dtype (round to nearest even for f16 / bf16). A tensor is *non-finite* when a stored
//! `y` is infinite or NaN, which covers three cases:
//! - an input `x` that is infinite or NaN (it stays non-finite after the multiply, including `inf * 0`);
//! - a finite `x` whose product overflows f32;
//! - a finite product that overflows when narrowed to f16 / bf16 (possible when `inv_scale > 1`).
//!
//! This is PyTorch's `_amp_foreach_non_finite_check_and_unscale_` with the check made on the stored value
//! instead of the input, so an overflow *caused* by unscaling is reported rather than silently stored.
//!
//! Every element is unscaled even after a non-finite one is found; the caller then skips the optimizer
//! step (see [`crate::optim`]) and lowers the loss scale.

use half::{bf16, f16};

use crate::backend::{dispatch, Backend, Element};
use crate::par::{self, Kernel};
use crate::{GradSlice, GradSliceMut, Isa};

/// Multiplies every gradient by `inv_scale` in place and returns the index (in list order) of the first
/// tensor holding a non-finite value afterwards, or `None` if all are finite. Runs on [`Isa::detect`].
pub fn unscale_and_check(grads: &mut [GradSliceMut<'_>], inv_scale: f32) -> Option<usize> {
    unscale_and_check_with(Isa::detect(), grads, inv_scale)
}

/// [`unscale_and_check`] on an explicit code path (an unsupported `isa` runs the portable path).
pub fn unscale_and_check_with(isa: Isa, grads: &mut [GradSliceMut<'_>], inv_scale: f32) -> Option<usize> {
    par::run(grads, &Unscale { backend: Backend::new(isa), inv_scale })
}

/// The index (in list order) of the first tensor holding an infinite or NaN value, or `None`. Read-only;
/// tests the exponent bits directly, so no conversion is needed. Runs on [`Isa::detect`].
pub fn find_non_finite(grads: &[GradSlice<'_>]) -> Option<usize> {
    find_non_finite_with(Isa::detect(), grads)
}

/// [`find_non_finite`] on an explicit code path.
pub fn find_non_finite_with(isa: Isa, grads: &[GradSlice<'_>]) -> Option<usize> {
    par::run(grads, &FindNonFinite(Backend::new(isa)))
}

struct Unscale {
    backend: Backend,
    inv_scale: f32,
}

fn unscale_piece<T: Element>(backend: Backend, x: &mut [T], s: f32) -> bool {
    dispatch!(backend, kernels::unscale::<T>(x, s))
}

impl<'a> Kernel<&'a mut [GradSliceMut<'_>]> for Unscale {
    type Acc = bool;
    type Out = Option<usize>;

    fn leaf(&self, piece: GradSliceMut<'a>) -> bool {
        match piece {
            GradSliceMut::F32(x) => unscale_piece::<f32>(self.backend, x, self.inv_scale),
            GradSliceMut::F16(x) => unscale_piece::<f16>(self.backend, x, self.inv_scale),
            GradSliceMut::Bf16(x) => unscale_piece::<bf16>(self.backend, x, self.inv_scale),
        }
    }
    fn merge(&self, left: bool, right: bool) -> bool {
        left | right
    }
    fn finish(&self, index: usize, bad: bool, (): ()) -> Option<usize> {
        bad.then_some(index)
    }
    fn join(&self, left: Option<usize>, right: Option<usize>) -> Option<usize> {
        left.or(right)
    }
    fn empty(&self) -> Option<usize> {
        None
    }
}

struct FindNonFinite(Backend);

/// Whether any element of `x` is infinite or NaN.
pub(crate) fn any_nonfinite(backend: Backend, x: GradSlice<'_>) -> bool {
    #[cfg(target_arch = "x86_64")]
    if backend.is_avx2() {
        // Raw-bit test over the slice's bytes (32 per step).
        let (bytes, exp16) = match x {
            GradSlice::F32(s) => (as_bytes(s), 0),
            GradSlice::F16(s) => (as_bytes(s), 0x7C00),
            GradSlice::Bf16(s) => (as_bytes(s), 0x7F80),
        };
        // SAFETY: `backend` is AVX2, so the features are present; `bytes` matches `exp16`'s type.
        return unsafe { crate::simd::kernels::any_nonfinite_bits(bytes, exp16) };
    }
    let _ = backend;
    match x {
        GradSlice::F32(s) => crate::portable::kernels::any_nonfinite(s),
        GradSlice::F16(s) => crate::portable::kernels::any_nonfinite(s),
        GradSlice::Bf16(s) => crate::portable::kernels::any_nonfinite(s),
    }
}

/// The memory of a slice of plain floats.
#[cfg(target_arch = "x86_64")]
fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: f32 / f16 / bf16 have no padding and no invalid bit patterns; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

impl<'a> Kernel<&[GradSlice<'a>]> for FindNonFinite {
    type Acc = bool;
    type Out = Option<usize>;

    fn leaf(&self, piece: GradSlice<'a>) -> bool {
        any_nonfinite(self.0, piece)
    }
    fn merge(&self, left: bool, right: bool) -> bool {
        left | right
    }
    fn finish(&self, index: usize, bad: bool, (): ()) -> Option<usize> {
        bad.then_some(index)
    }
    fn join(&self, left: Option<usize>, right: Option<usize>) -> Option<usize> {
        left.or(right)
    }
    fn empty(&self) -> Option<usize> {
        None
    }
}
