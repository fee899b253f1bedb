//! Fused multi-tensor optimizer steps over fp32 master weights and fp32 state (Adam's and LAMB's
//! moments and SGD's momentum buffer also in bf16, rounded stochastically: [`adam_step_bf16_state`],
//! [`lamb_step_bf16_state`], [`sgd_step_bf16_state`]).
//!
//! Each step reads a tensor's gradient (f32, f16 or bf16), multiplies it by `inv_grad_scale` inline (so
//! no separate unscale pass is needed; fold a clip-by-norm factor from [`crate::clip::clip_coefficient`]
//! into it too), updates the fp32 master and state, and optionally writes the f16 / bf16 working copy
//! from the updated master, all in **one pass over memory** per element ([`adam_step`], [`sgd_step`]).
//! [`lamb_step`] needs per-tensor norms of the update before applying it, so it makes two passes.
//!
//! All tensors of one call share one set of hyper-parameters: call once per parameter group.
//!
//! **Skipping on overflow is the caller's decision, made before the step.** When the unscale check
//! ([`crate::unscale`]) reports a non-finite gradient, do not call these functions at all for that step:
//! they do not test for non-finite values, and a NaN gradient would be written into the master weights,
//! the moments and the step-dependent bias correction.
//!
//! Arithmetic is f32, one rounding per operation, no fused multiply-add, in the operation order of the
//! reference implementations in [`crate::reference`] (which follow PyTorch's / Apex's formulas): the AVX2
//! path, the portable path and the f32 reference agree bit for bit. Hyper-parameter-derived constants
//! (bias corrections, `1 - lr * weight_decay`, ...) are computed once per call in f64 and rounded to f32,
//! as PyTorch does with Python floats.

mod adam;
mod adam_bf16;
mod lamb;
mod lamb_bf16;
mod offset;
mod sgd;
mod sgd_bf16;

pub use adam::{adam_step, adam_step_with, AdamParams, AdamTensor};
pub use adam_bf16::{adam_step_bf16_state, adam_step_bf16_state_with, step_key, AdamBf16Tensor};
pub use lamb::{lamb_step, lamb_step_with, LambParams, LambTensor, TensorNorms};
pub use lamb_bf16::{lamb_step_bf16_state, lamb_step_bf16_state_with, LambBf16Tensor};
pub use sgd::{sgd_step, sgd_step_with, SgdParams, SgdTensor};
pub use sgd_bf16::{sgd_step_bf16_state, sgd_step_bf16_state_with, sgd_step_key, SgdBf16Tensor};

pub(crate) use adam::{AdamConsts, AdamSlices};
pub(crate) use adam_bf16::AdamBf16Slices;
pub(crate) use lamb::LambConsts;
pub(crate) use sgd::{SgdConsts, SgdSlices};
pub(crate) use sgd_bf16::SgdBf16Slices;

/// Panics unless every length equals `expect`.
#[track_caller]
fn check_len(what: &str, tensor: usize, len: usize, expect: usize) {
    assert_eq!(len, expect, "tensor {tensor}: {what} has {len} elements, the master has {expect}");
}
