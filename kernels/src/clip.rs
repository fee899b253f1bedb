//! Gradient clipping: by value (a pass over the gradients) and by global norm (a coefficient to fold into
//! the optimizer's `inv_grad_scale`, so clipping by norm costs no extra pass).

use half::{bf16, f16};

use crate::backend::{dispatch, Backend, Element};
use crate::par::{self, Kernel};
use crate::{GradSliceMut, Isa};

/// Clamps every gradient element to `[-clip_value, clip_value]` in place (PyTorch's `clip_grad_value_`).
/// Computed in f32, stored in the gradient's dtype; NaN stays NaN. Runs on [`Isa::detect`].
///
/// # Panics
/// If `clip_value` is negative or NaN.
pub fn clip_by_value(grads: &mut [GradSliceMut<'_>], clip_value: f32) {
    clip_by_value_with(Isa::detect(), grads, clip_value);
}

/// [`clip_by_value`] on an explicit code path.
///
/// # Panics
/// If `clip_value` is negative or NaN.
pub fn clip_by_value_with(isa: Isa, grads: &mut [GradSliceMut<'_>], clip_value: f32) {
    assert!(clip_value >= 0.0, "clip_by_value: clip_value must be >= 0, got {clip_value}");
    par::run(grads, &Clamp { backend: Backend::new(isa), lo: -clip_value, hi: clip_value });
}

/// The factor PyTorch's `clip_grad_norm_` multiplies gradients by: `min(1, max_norm / (total_norm +
/// 1e-6))`, computed in f64. Multiply it into the optimizer's `inv_grad_scale` instead of making a pass.
/// A non-finite `total_norm` gives a non-finite or zero factor: skip the step instead.
#[must_use]
pub fn clip_coefficient(total_norm: f32, max_norm: f32) -> f32 {
    let coef = f64::from(max_norm) / (f64::from(total_norm) + 1e-6);
    // Written so a NaN coefficient stays NaN, as torch's clamp.
    (if coef > 1.0 { 1.0 } else { coef }) as f32
}

struct Clamp {
    backend: Backend,
    lo: f32,
    hi: f32,
}

fn clamp_piece<T: Element>(backend: Backend, x: &mut [T], lo: f32, hi: f32) {
    dispatch!(backend, kernels::clamp::<T>(x, lo, hi));
}

impl<'a> Kernel<&'a mut [GradSliceMut<'_>]> for Clamp {
    type Acc = ();
    type Out = ();

    fn leaf(&self, piece: GradSliceMut<'a>) {
        match piece {
            GradSliceMut::F32(x) => clamp_piece::<f32>(self.backend, x, self.lo, self.hi),
            GradSliceMut::F16(x) => clamp_piece::<f16>(self.backend, x, self.lo, self.hi),
            GradSliceMut::Bf16(x) => clamp_piece::<bf16>(self.backend, x, self.lo, self.hi),
        }
    }
    fn merge(&self, (): (), (): ()) {}
    fn finish(&self, _index: usize, (): (), (): ()) {}
    fn join(&self, (): (), (): ()) {}
    fn empty(&self) {}
}
