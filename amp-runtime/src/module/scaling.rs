//! Loss-scaling need as a trait, so that the compiler refuses an unscaled training step on a model with
//! layers fixed to fp16, through any depth of nesting.
//!
//! `M: NoFp16Under<R>` holds when, with the request `R` arriving from outside, no layer inside `M` ends
//! up fixed to fp16 (or `half`, fp16 on CUDA). Half-capable leaves implement it for [`Inherit`] and
//! [`AskWide`] but not [`AskFp16`]; fp32-pinned leaves for every request; containers pass the request
//! to their elements; a derived struct requires it of each field under the field's own request (its
//! attribute or the struct's default), or under the struct's request for fields without one.
//! (The same rule, as a `const fn` over the plan, gives `AmpModule::NEEDS_LOSS_SCALING`.)

/// A precision request as a type.
pub trait Request {
    /// `X`, whatever `Self` is. Generated bounds write a field's fixed request as
    /// `<R as Request>::Keep<AskFp16>` so that they mention `R` and are checked where the model is used
    /// (a bound without generic parameters would be checked, and fail, at the struct's definition).
    type Keep<X: Request>: Request;
}

/// No precision requested: the optimisation level decides at run time.
#[derive(Debug)]
pub enum Inherit {}

/// `fp16` or `half` requested.
#[derive(Debug)]
pub enum AskFp16 {}

/// `fp32` or `bf16` requested.
#[derive(Debug)]
pub enum AskWide {}

impl Request for Inherit {
    type Keep<X: Request> = X;
}
impl Request for AskFp16 {
    type Keep<X: Request> = X;
}
impl Request for AskWide {
    type Keep<X: Request> = X;
}

/// No layer of this module is fixed to fp16 when the module is asked for `R`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is fixed to fp16 here, so this model must be trained with a loss scaler",
    label = "this model has layers fixed to fp16 by `#[amp(fp16)]` or `#[amp(half)]`",
    note = "fp16 gradients smaller than 6e-8 flush to zero and larger than 65504 overflow; a loss scaler \
            keeps them in range and skips steps that overflow",
    note = "use `GradScaler::step` or `GradScaler::step_fused` (PyTorch users meet this mistake at run time \
            as \"Attempting to unscale FP16 gradients\")",
    note = "in a function generic over a model `M`, the bound `M: amp::module::NoFp16Under<amp::module::Inherit>` \
            admits only models without fp16 layers to `step_unscaled`; or use a `GradScaler`, which takes any"
)]
pub trait NoFp16Under<R: Request> {}
