//! The fp32 class: elementwise functions that overflow or lose precision in half, and every reduction.
//!
//! Each function widens an f16/bf16 input to f32 with a differentiable cast (the gradient returns to a
//! half input rounded once, in its own dtype) and returns f32. f32 and f64 inputs are used as they are.

use candle_core::shape::{Dim, Dims};
use candle_core::{Result, Tensor};

use super::widen;

/// `e^x`, in f32. fp16 overflows for x > 11.09; f32 for x > 88.7.
pub fn exp(x: &Tensor) -> Result<Tensor> {
    widen(x)?.exp()
}

/// Natural logarithm, in f32 (fp16 has no normal numbers below 6.1e-5, so `log` of small values is
/// coarse there).
pub fn log(x: &Tensor) -> Result<Tensor> {
    widen(x)?.log()
}

/// `x^exponent` elementwise, in f32. As with `powf` everywhere, negative `x` with a non-integer
/// exponent gives NaN.
pub fn pow(x: &Tensor, exponent: f64) -> Result<Tensor> {
    widen(x)?.powf(exponent)
}

/// `softmax(x)_i = e^(x_i - m) / sum_j e^(x_j - m)` along `dim`, with `m` the maximum along `dim`
/// (which leaves the result unchanged and keeps every `e^..` in (0, 1]). Computed and returned in f32.
///
/// Differentiable. Over the last dimension on the CPU one op each way ([`amp_kernels::softmax`], sums
/// in f64); otherwise built from candle ops with a backward (the shift `m` is detached: the softmax
/// does not depend on it).
pub fn softmax<D: Dim>(x: &Tensor, dim: D) -> Result<Tensor> {
    let x = widen(x)?;
    let dim = dim.to_index(x.shape(), "softmax")?;
    if dim + 1 == x.rank() {
        if let Some(y) = super::fused_softmax::last_dim(&x)? {
            return Ok(y);
        }
    }
    let e = shifted(&x, dim)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(dim)?)
}

/// `log_softmax(x)_i = (x_i - m) - log(sum_j e^(x_j - m))` along `dim`, in f32; the stable form that
/// never takes the log of a softmax that underflowed to 0.
pub fn log_softmax<D: Dim>(x: &Tensor, dim: D) -> Result<Tensor> {
    let x = widen(x)?;
    let dim = dim.to_index(x.shape(), "log_softmax")?;
    let shifted = shifted(&x, dim)?;
    shifted.broadcast_sub(&shifted.exp()?.sum_keepdim(dim)?.log()?)
}

/// `x - max(x)` along `dim`, the maximum detached.
fn shifted(x: &Tensor, dim: usize) -> Result<Tensor> {
    x.broadcast_sub(&x.max_keepdim(dim)?.detach())
}

/// Sum over `dims` (removed from the shape), accumulated in f32.
pub fn sum<D: Dims>(x: &Tensor, dims: D) -> Result<Tensor> {
    widen(x)?.sum(dims)
}

/// Sum over `dims` (kept with size 1), accumulated in f32.
pub fn sum_keepdim<D: Dims>(x: &Tensor, dims: D) -> Result<Tensor> {
    widen(x)?.sum_keepdim(dims)
}

/// Sum of every element, a scalar accumulated in f32.
pub fn sum_all(x: &Tensor) -> Result<Tensor> {
    widen(x)?.sum_all()
}

/// Mean over `dims` (removed from the shape), accumulated in f32.
pub fn mean<D: Dims>(x: &Tensor, dims: D) -> Result<Tensor> {
    widen(x)?.mean(dims)
}

/// Mean over `dims` (kept with size 1), accumulated in f32.
pub fn mean_keepdim<D: Dims>(x: &Tensor, dims: D) -> Result<Tensor> {
    widen(x)?.mean_keepdim(dims)
}

/// Mean of every element, a scalar accumulated in f32.
pub fn mean_all(x: &Tensor) -> Result<Tensor> {
    widen(x)?.mean_all()
}

/// The L2 norm of all elements, `sqrt(sum x^2)`, a scalar in f32.
///
/// Squares of half values cannot overflow f32 (65504^2 = 4.3e9), where in fp16 any |x| > 256 does.
/// Like every `sqrt`, its gradient at a tensor of zeros is not finite.
pub fn norm(x: &Tensor) -> Result<Tensor> {
    widen(x)?.sqr()?.sum_all()?.sqrt()
}

/// Running sum along `dim`, in f32 (candle forms it as a product with a triangular matrix of ones, so
/// it costs `n^2` along `dim`).
pub fn cumsum<D: Dim>(x: &Tensor, dim: D) -> Result<Tensor> {
    widen(x)?.cumsum(dim)
}

/// Unbiased variance along `dim` (removed), `sum (x - mean)^2 / (n - 1)`, in f32: the two-pass form,
/// which does not cancel catastrophically as `E[x^2] - E[x]^2` does.
pub fn var<D: Dim>(x: &Tensor, dim: D) -> Result<Tensor> {
    let x = widen(x)?;
    let dim = dim.to_index(x.shape(), "var")?;
    let n = x.dim(dim)?;
    if n < 2 {
        candle_core::bail!("var: the unbiased variance needs at least 2 values along dim {dim}, got {n}");
    }
    let centered = x.broadcast_sub(&x.mean_keepdim(dim)?)?;
    centered.sqr()?.sum(dim)? / (n - 1) as f64
}

/// Unbiased standard deviation along `dim` (removed), the square root of [`var`], in f32.
pub fn std<D: Dim>(x: &Tensor, dim: D) -> Result<Tensor> {
    var(x, dim)?.sqrt()
}
