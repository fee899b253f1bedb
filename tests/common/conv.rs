//! What the convolution tests share: a layer's output and gradients held to direct sums in f64.
//!
//! Tolerances (normwise relative): the forward rounds input and weight to the compute format, then
//! the f32 sums plus the f32 bias once (with candle's kernel: the result, then its sum with the bias):
//! at most 4 roundings of `u`; each gradient passes 3 rounded operands (the upstream gradient, the
//! other operand, the result). Safety factor 4: a sum of products with cancelling terms amplifies
//! relative operand errors by `|W||x| / |W x|`, measured 1-2 on the tests' random data.

use amp::Precision;
use candle_core::{Result, Tensor};

/// The layer's output and its gradients for `x`, the weight and the bias (`common::value_and_grads`)
/// against the direct sums, in `precision`; a half precision must show its rounding.
pub fn assert_matches_direct(
    what: &str,
    (y, grads): (Tensor, Vec<Tensor>),
    (y_ref, grads_ref): &(Tensor, [Tensor; 3]),
    precision: Precision,
) -> Result<()> {
    let y_ref = y_ref.reshape(y.dims())?;
    let dtype = precision.dtype();
    let err = super::assert_close(&format!("{what} forward"), &y, &y_ref, super::tolerance(dtype, 4, 4.0))?;
    if precision != Precision::Fp32 {
        assert!(err > super::unit_roundoff(dtype) / 8.0, "{what}: no sign of half rounding");
    }
    for (name, (grad, expected)) in ["x", "weight", "bias"].iter().zip(grads.iter().zip(grads_ref)) {
        let expected = expected.reshape(grad.dims())?;
        super::assert_close(
            &format!("{what} grad {name}"),
            grad,
            &expected,
            super::tolerance(dtype, 3, 4.0),
        )?;
    }
    Ok(())
}
