//! The promote class: ops on several inputs that cast every input to the widest float dtype among them
//! and then apply (autocast's "promote" list: add, mul, cat, stack, comparisons...).
//!
//! Widest: f64 > f32 > f16, bf16. f16 and bf16 together promote to f32, since neither holds the other
//! (fp16 lacks bf16's range, bf16 lacks fp16's precision). Non-float inputs take the float dtype.
//! Binary ops broadcast their operands.

use candle_core::shape::Dim;
use candle_core::{DType, Result, Tensor};

/// The dtype that `dtypes` promote to: the widest float dtype among them (f16 with bf16 gives f32), or
/// `None` when none is a float.
pub fn widest_dtype(dtypes: impl IntoIterator<Item = DType>) -> Option<DType> {
    let mut widest: Option<DType> = None;
    for dtype in dtypes.into_iter().filter(DType::is_float) {
        widest = Some(match widest {
            None => dtype,
            Some(w) if w == dtype => w,
            Some(w) if w == DType::F64 || dtype == DType::F64 => DType::F64,
            // Two distinct floats, neither f64: f32 with a half, or two different halves.
            Some(_) => DType::F32,
        });
    }
    widest
}

/// Every tensor cast to the widest float dtype among them (no-op casts cost nothing).
fn promoted(tensors: &[&Tensor]) -> Result<Vec<Tensor>> {
    match widest_dtype(tensors.iter().map(|t| t.dtype())) {
        Some(dtype) => tensors.iter().map(|t| t.to_dtype(dtype)).collect(),
        None => Ok(tensors.iter().map(|t| (*t).clone()).collect()),
    }
}

fn promoted2(a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    match widest_dtype([a.dtype(), b.dtype()]) {
        Some(dtype) => Ok((a.to_dtype(dtype)?, b.to_dtype(dtype)?)),
        None => Ok((a.clone(), b.clone())),
    }
}

/// `a + b`, broadcast, in the wider of the two dtypes.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (a, b) = promoted2(a, b)?;
    a.broadcast_add(&b)
}

/// `a - b`, broadcast, in the wider of the two dtypes.
pub fn sub(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (a, b) = promoted2(a, b)?;
    a.broadcast_sub(&b)
}

/// `a * b`, broadcast, in the wider of the two dtypes.
pub fn mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (a, b) = promoted2(a, b)?;
    a.broadcast_mul(&b)
}

/// `a / b`, broadcast, in the wider of the two dtypes.
pub fn div(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (a, b) = promoted2(a, b)?;
    a.broadcast_div(&b)
}

/// Elementwise maximum, broadcast, in the wider of the two dtypes.
pub fn maximum(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (a, b) = promoted2(a, b)?;
    a.broadcast_maximum(&b)
}

/// Elementwise minimum, broadcast, in the wider of the two dtypes.
pub fn minimum(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (a, b) = promoted2(a, b)?;
    a.broadcast_minimum(&b)
}

/// Concatenation along an existing `dim`, in the widest dtype of the inputs.
pub fn cat<D: Dim>(tensors: &[&Tensor], dim: D) -> Result<Tensor> {
    Tensor::cat(&promoted(tensors)?, dim)
}

/// Stacking along a new `dim`, in the widest dtype of the inputs.
pub fn stack<D: Dim>(tensors: &[&Tensor], dim: D) -> Result<Tensor> {
    Tensor::stack(&promoted(tensors)?, dim)
}
