//! Multi-tensor L2 norms: global (clipping by norm) and per tensor (LAMB, per-tensor clipping).
//!
//! Accumulation is in f64: each leaf of the work split (see the crate docs: up to 64 Ki elements of one
//! tensor, cut at fixed offsets) sums `x²` into 16 lanes (element `j` into lane `j % 16`), reduces the
//! lanes pairwise in a fixed order, and leaves combine in the order of the split tree, which depends only
//! on the tensor lengths. The result is therefore deterministic: independent of the thread count and of
//! scheduling, and identical between the AVX2 and portable paths. Squares of f32 values are exact in
//! f64, and 25 M terms lose at most ~25e6 * 2^-53 ≈ 3e-9 relative, far below f32 resolution.
//!
//! `inv_scale` is applied once to the final norm, in f64: `norm = sqrt(Σ x²) * |inv_scale|`. That is the
//! norm of the unscaled gradient (up to the f32 rounding an explicit unscale would add). A NaN anywhere
//! gives NaN; an infinity gives infinity.

use half::{bf16, f16};

use crate::backend::{dispatch, Backend, Element};
use crate::par::{self, Kernel, Tensors};
use crate::{GradSlice, Isa};

/// L2 norm of all gradients together, times `|inv_scale|`. Runs on [`Isa::detect`].
#[must_use]
pub fn global_l2_norm(grads: &[GradSlice<'_>], inv_scale: f32) -> f32 {
    global_l2_norm_with(Isa::detect(), grads, inv_scale)
}

/// [`global_l2_norm`] on an explicit code path.
#[must_use]
pub fn global_l2_norm_with(isa: Isa, grads: &[GradSlice<'_>], inv_scale: f32) -> f32 {
    let sum = par::run(WithNorms { grads, out: None }, &SumSquares { backend: Backend::new(isa), inv_scale });
    scale_root(sum, inv_scale)
}

/// Writes the L2 norm of each gradient (times `|inv_scale|`) to `per_tensor` and returns the global norm,
/// in one pass. The global norm equals [`global_l2_norm`]'s bit for bit.
///
/// # Panics
/// If `per_tensor.len() != grads.len()`.
pub fn l2_norms(grads: &[GradSlice<'_>], inv_scale: f32, per_tensor: &mut [f32]) -> f32 {
    l2_norms_with(Isa::detect(), grads, inv_scale, per_tensor)
}

/// [`l2_norms`] on an explicit code path.
///
/// # Panics
/// If `per_tensor.len() != grads.len()`.
pub fn l2_norms_with(isa: Isa, grads: &[GradSlice<'_>], inv_scale: f32, per_tensor: &mut [f32]) -> f32 {
    assert_eq!(per_tensor.len(), grads.len(), "l2_norms: one output per gradient");
    let kernel = SumSquares { backend: Backend::new(isa), inv_scale };
    let sum = par::run(WithNorms { grads, out: Some(per_tensor) }, &kernel);
    scale_root(sum, inv_scale)
}

/// `sqrt(sum) * |inv_scale|` in f64, rounded to f32.
pub(crate) fn scale_root(sum: f64, inv_scale: f32) -> f32 {
    (sum.sqrt() * f64::from(inv_scale.abs())) as f32
}

/// Sum of squares of one piece, in f64.
pub(crate) fn sum_squares(backend: Backend, x: GradSlice<'_>) -> f64 {
    fn typed<T: Element>(backend: Backend, x: &[T]) -> f64 {
        dispatch!(backend, kernels::sum_squares::<T>(x))
    }
    match x {
        GradSlice::F32(x) => typed::<f32>(backend, x),
        GradSlice::F16(x) => typed::<f16>(backend, x),
        GradSlice::Bf16(x) => typed::<bf16>(backend, x),
    }
}

/// Gradients with an optional per-tensor output.
struct WithNorms<'a, 'b> {
    grads: &'a [GradSlice<'b>],
    out: Option<&'a mut [f32]>,
}

impl<'a, 'b> Tensors for WithNorms<'a, 'b> {
    type Piece = GradSlice<'b>;
    type Slot = Option<&'a mut f32>;
    fn count(&self) -> usize {
        self.grads.len()
    }
    fn len_of(&self, i: usize) -> usize {
        self.grads[i].len()
    }
    fn split_at(self, i: usize) -> (Self, Self) {
        let (ga, gb) = self.grads.split_at(i);
        let (oa, ob) = match self.out {
            Some(out) => {
                let (a, b) = out.split_at_mut(i);
                (Some(a), Some(b))
            }
            None => (None, None),
        };
        (WithNorms { grads: ga, out: oa }, WithNorms { grads: gb, out: ob })
    }
    fn into_single(self) -> (GradSlice<'b>, Option<&'a mut f32>) {
        (self.grads[0], self.out.map(|o| &mut o[0]))
    }
}

struct SumSquares {
    backend: Backend,
    inv_scale: f32,
}

impl<'a, 'b> Kernel<WithNorms<'a, 'b>> for SumSquares {
    type Acc = f64;
    type Out = f64;

    fn leaf(&self, piece: GradSlice<'b>) -> f64 {
        sum_squares(self.backend, piece)
    }
    fn merge(&self, left: f64, right: f64) -> f64 {
        left + right
    }
    fn finish(&self, _index: usize, sum: f64, slot: Option<&'a mut f32>) -> f64 {
        if let Some(slot) = slot {
            *slot = scale_root(sum, self.inv_scale);
        }
        sum
    }
    fn join(&self, left: f64, right: f64) -> f64 {
        left + right
    }
    fn empty(&self) -> f64 {
        0.0
    }
}
