//! Tensor ops with the precision rules of Apex's O1 lists and `torch.autocast`, as plain functions.
//!
//! Three classes, as in the autocast op lists:
//!
//! | class | ops | rule |
//! |---|---|---|
//! | matmul-class | [`matmul`], [`linear`] | operands cast to the compute precision; products accumulate in f32 |
//! | fp32 | [`exp`], [`log`], [`pow`], [`softmax`], [`log_softmax`], [`sum`], [`mean`], [`norm`], [`cumsum`], [`var`], [`std`](fn@std), every [`loss`] | f16/bf16 inputs widened to f32, result f32 |
//! | promote | [`add`], [`sub`], [`mul`], [`div`], [`cat`], [`stack`], [`maximum`], [`minimum`] | inputs cast to the widest float dtype among them |
//!
//! Why fp32 for the second class: candle reduces in the storage dtype, so on CPU the sum of 10,000 ones
//! is 2048 in f16 and 256 in bf16 (the accumulator stops growing once the increment is below half an
//! ulp), and `exp`, squares and sums overflow fp16 beyond 65504. Every op here is differentiable with
//! candle's autograd; none uses candle-nn's fused `softmax_last_dim`, which has no backward.
//!
//! f64 inputs are never narrowed: "at least f32" is the rule, so an f64 computation stays f64.
//!
//! ```
//! use amp_runtime::ops;
//! use candle_core::{DType, Device, Tensor};
//!
//! let ones = Tensor::ones(10_000, DType::F16, &Device::Cpu)?;
//! assert_eq!(ones.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?, 2048.0); // candle's f16 sum
//! assert_eq!(ops::sum_all(&ones)?.to_scalar::<f32>()?, 10_000.0); // widened to f32
//! # Ok::<(), candle_core::Error>(())
//! ```

mod fp32;
pub mod loss;
mod promote;

pub use fp32::{
    cumsum, exp, log, log_softmax, mean, mean_all, mean_keepdim, norm, pow, softmax, std, sum, sum_all,
    sum_keepdim, var,
};
pub use promote::{add, cat, div, maximum, minimum, mul, stack, sub, widest_dtype};

use candle_core::{DType, Result, Tensor};

use crate::Precision;

/// `a @ b` with both operands cast to `compute` (batch dimensions broadcast), result in `compute`.
///
/// candle's matmul kernels accumulate f16 and bf16 products in f32, so the only roundings are those of
/// the two operands and of the result.
pub fn matmul(a: &Tensor, b: &Tensor, compute: Precision) -> Result<Tensor> {
    let dtype = compute.dtype();
    a.to_dtype(dtype)?.broadcast_matmul(&b.to_dtype(dtype)?)
}

/// `x W^T + b` in `compute`, with `x` of shape `(.., in)`, `weight` `(out, in)` and `bias` `(out)`;
/// result `(.., out)` in `compute`.
///
/// The product is rounded to `compute`, the bias added in f32 and the sum rounded once more (a GEMM
/// epilogue's order); the bias gradient, a sum over every row, then accumulates in f32, not in half.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, compute: Precision) -> Result<Tensor> {
    let dtype = compute.dtype();
    let y = x.to_dtype(dtype)?.broadcast_matmul(&weight.to_dtype(dtype)?.t()?)?;
    match bias {
        Some(bias) if dtype != DType::F32 => {
            y.to_dtype(DType::F32)?.broadcast_add(&bias.to_dtype(DType::F32)?)?.to_dtype(dtype)
        }
        Some(bias) => y.broadcast_add(&bias.to_dtype(dtype)?),
        None => Ok(y),
    }
}

/// The dtype an fp32-class op computes in: f16 and bf16 widen to f32; f32, f64 and integers stay.
pub(crate) fn at_least_f32(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        other => other,
    }
}

/// `x` in the dtype an fp32-class op computes in (a differentiable cast, or `x` itself).
pub(crate) fn widen(x: &Tensor) -> Result<Tensor> {
    x.to_dtype(at_least_f32(x.dtype()))
}
