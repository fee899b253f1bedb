//! Tensor ops with the precision rules of Apex's O1 lists and `torch.autocast`, as plain functions.
//!
//! The classes, as in the autocast op lists (the last two amp's own):
//!
//! | class | ops | rule |
//! |---|---|---|
//! | matmul-class | [`matmul`], [`linear`], [`scaled_dot_product_attention`] | operands cast to the compute precision; products accumulate in f32 |
//! | fp32 | [`exp`], [`log`], [`pow`], [`softmax`], [`log_softmax`], [`sum`], [`mean`], [`norm`], [`cumsum`], [`var`], [`std`](fn@std), every [`loss`] | f16/bf16 inputs widened to f32, result f32 |
//! | promote | [`add`], [`sub`], [`mul`], [`div`], [`cat`], [`stack`], [`maximum`], [`minimum`] | inputs cast to the widest float dtype among them |
//! | activation | [`gelu()`], [`relu()`], [`silu()`] | computed in f32 in one pass (backward too), result in the input's dtype |
//! | position | [`rope()`], [`rope_i`], [`rope_thd`] | rotated in f32 in one pass (backward too), result in the input's dtype |
//! | pooling | [`max_pool2d`], [`avg_pool2d`], [`max_pool1d`], [`avg_pool1d`] | windows of any size, stride and padding in f32 in one pass (backward too), result in the input's dtype |
//! | resize | [`upsample_bilinear2d`], [`upsample_bilinear2d_with_scale`] | blended in f32 with differentiable candle ops, result in the input's dtype |
//!
//! Why fp32 for the second class: candle reduces in the storage dtype, so on CPU the sum of 10,000 ones
//! is 2048 in f16 and 256 in bf16 (the accumulator stops growing once the increment is below half an
//! ulp), and `exp`, squares and sums overflow fp16 beyond 65504. Every op here is differentiable with
//! candle's autograd (candle-nn's fused `softmax_last_dim` has no backward). On the CPU, [`softmax`]
//! over the last dimension is one op each way (`amp_kernels::softmax`), as is GELU.
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

mod activation;
mod attention;
mod buffer;
mod channel_affine;
mod column_sums;
mod conv;
mod conv_transpose;
mod elementwise;
mod embedding;
mod fp32;
pub(crate) mod fused_softmax;
mod gelu;
mod gemm;
mod heads;
pub(crate) mod input;
mod layer_norm;
pub mod loss;
pub(crate) mod mlp;
mod norm_head;
mod padded;
mod pool;
mod projection;
mod promote;
mod relu;
mod rope;
mod self_attention;
mod silu;
mod upsample;
mod working_values;

pub(crate) use attention::attention_of_heads;
pub use attention::scaled_dot_product_attention;
pub(crate) use channel_affine::channel_affine;
pub(crate) use conv::{conv2d, ConvParams};
pub(crate) use conv_transpose::conv_transpose2d;
pub(crate) use embedding::embedding;
pub use fp32::{
    cumsum, exp, log, log_softmax, mean, mean_all, mean_keepdim, norm, pow, softmax, std, sum, sum_all,
    sum_keepdim, var,
};
pub use gelu::gelu;
pub use gemm::matmul_to;
pub(crate) use gemm::{Epilogue, Operand};
pub(crate) use layer_norm::{layer_norm, normalise_rows, rms_norm};
pub(crate) use norm_head::Norm;
pub use pool::{avg_pool1d, avg_pool2d, max_pool1d, max_pool2d};
pub(crate) use projection::Projection;
pub use promote::{add, cat, div, maximum, minimum, mul, stack, sub, widest_dtype};
pub use relu::relu;
pub use rope::{rope, rope_i, rope_tables, rope_tables_of, rope_thd};
pub use silu::silu;
pub use upsample::{upsample_bilinear2d, upsample_bilinear2d_with_scale};
pub(crate) use working_values::read_through_master;

use candle_core::{DType, Result, Tensor};

use crate::Precision;

/// `a @ b` with both operands rounded to `compute` (batch dimensions broadcast), result in `compute`.
///
/// Products accumulate in f32, so the only roundings are those of the two operands and of the result.
/// On the CPU amp's GEMM computes it and rounds the operands while packing them (no cast pass); see
/// [`crate::dispatch`] for which kernel runs and [`matmul_to`] for another output dtype.
pub fn matmul(a: &Tensor, b: &Tensor, compute: Precision) -> Result<Tensor> {
    matmul_to(a, b, compute, compute.dtype())
}

/// `x W^T + b` in `compute`, with `x` of shape `(.., in)`, `weight` `(out, in)` and `bias` `(out)`;
/// result `(.., out)` in `compute`.
///
/// The product is summed in f32, the bias added in f32 and the sum rounded once (a GEMM epilogue's
/// order); the bias gradient, a sum over every row, then accumulates in f32, not in half.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, compute: Precision) -> Result<Tensor> {
    linear_to(x, &Operand::of(weight), bias, compute, compute.dtype(), Epilogue::Identity)
}

/// [`linear`] with the result in `out`, then the epilogue: leading dimensions of `x` are folded into
/// the rows of one product (the weight is read once, transposed in place). With a bias on amp's GEMM
/// the epilogue is part of the product's op, which folds the leading dimensions itself: a reshape
/// each way would be two more graph nodes, each a zero-filled sum of its size in candle's backward
/// pass. Otherwise `x` is reshaped to a matrix and the epilogue follows as its own op.
/// Refuses a weight that is not `(out, in)` for `x`'s `in` features, or a bias that is not `(out)`: the
/// GEMM reads the weight through its strides, so a mismatch would read a part of it, or past it.
fn check_linear_shapes(features: usize, weight: &[usize], bias: Option<&[usize]>) -> Result<()> {
    let &[outputs, inputs] = weight else {
        return Err(candle_core::Error::Msg(format!(
            "linear: the weight has shape {weight:?}; it must be a matrix (out features, in features)"
        )));
    };
    if inputs != features {
        return Err(candle_core::Error::Msg(format!(
            "linear: the input has {features} features (its last dimension) but the weight \
             ({outputs}, {inputs}) takes {inputs}: give the input shape (.., {inputs}), or build the \
             layer with {features} input features"
        )));
    }
    match bias {
        Some(bias) if bias != [outputs] => Err(candle_core::Error::Msg(format!(
            "linear: the bias has shape {bias:?} but the weight ({outputs}, {inputs}) has {outputs} \
             outputs: the bias must have shape [{outputs}]"
        ))),
        _ => Ok(()),
    }
}

pub(crate) fn linear_to(
    x: &Tensor,
    weight: &Operand,
    bias: Option<&Tensor>,
    compute: Precision,
    out: DType,
    epilogue: Epilogue,
) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let features =
        *dims.last().ok_or_else(|| candle_core::Error::Msg("linear: x has no dimensions".into()))?;
    check_linear_shapes(features, weight.differentiated.dims(), bias.map(Tensor::dims))?;
    let fused = match bias {
        Some(bias) => gemm::linear_bias(x, weight, bias, compute, out, epilogue)?,
        // Without a bias, the same op from a zero row (untracked: no gradient is computed for it), so
        // that the weight is read transposed in place and its gradient deposited on the weight itself,
        // not sent back through a transpose and candle's zero-filled sum.
        // Only the CPU has amp's GEMM: elsewhere the row would be made only to be dropped.
        None if x.device().is_cpu() => {
            let zero = Tensor::zeros(weight.differentiated.dim(0)?, DType::F32, x.device())?;
            gemm::linear_bias(x, weight, &zero, compute, out, epilogue)?
        }
        None => None,
    };
    if let Some(y) = fused {
        return Ok(y);
    }
    let rows = rows_before_last(x.dims());
    let x2 = if dims.len() == 2 { x.clone() } else { x.reshape((rows, features))? };
    let y = match bias {
        _ if epilogue == Epilogue::Relu => {
            relu(&linear_to(&x2, weight, bias, compute, out, Epilogue::Identity)?)?
        }
        _ if epilogue == Epilogue::Gelu => {
            gelu(&linear_to(&x2, weight, bias, compute, out, Epilogue::Identity)?)?
        }
        Some(bias) => gemm::product_to(&x2, &weight.t()?, compute, DType::F32)?
            .broadcast_add(&bias.to_dtype(DType::F32)?)?
            .to_dtype(out)?,
        None => gemm::product_to(&x2, &weight.t()?, compute, out)?,
    };
    if dims.len() == 2 {
        return Ok(y);
    }
    let mut shape = dims;
    *shape.last_mut().expect("checked non-empty above") = y.dim(1)?;
    y.reshape(shape)
}

/// `down(gelu(x up^T + b_up) down^T + b_down)` on amp's GEMM with the hidden activation outside
/// candle's graph ([`mlp`]), of `norm(x)` where a layer norm is given (its output outside the graph
/// too: [`norm_head`]); `None` where the dispatcher picks another kernel for either product. Refuses
/// shapes that do not chain as [`check_linear_shapes`] would for each Linear.
pub(crate) fn gelu_mlp(
    x: &Tensor,
    norm: Option<&Norm<'_>>,
    up: Projection<'_>,
    down: Projection<'_>,
) -> Result<Option<Tensor>> {
    let features =
        *x.dims().last().ok_or_else(|| candle_core::Error::Msg("linear: x has no dimensions".into()))?;
    check_linear_shapes(features, up.weight.differentiated.dims(), up.bias.map(Tensor::dims))?;
    let hidden = up.weight.differentiated.dim(0)?;
    check_linear_shapes(hidden, down.weight.differentiated.dims(), down.bias.map(Tensor::dims))?;
    mlp::gelu_mlp(x, norm, up, down)
}

/// `out(attention(q(x), k(x), v(x)))` on amp's GEMM with `q`, `k`, `v` and the heads' mix outside
/// candle's graph ([`mod@self_attention`]), of `norm(x)` where a layer norm is given (its output
/// outside the graph too: [`norm_head`]), the attention's products in `compute`; `None` where it does
/// not apply (another kernel, `x` not `(batch, t, embed)`, heads that do not divide the projections).
/// Refuses shapes that do not chain as [`check_linear_shapes`] would for each Linear.
pub(crate) fn self_attention(
    x: &Tensor,
    norm: Option<&Norm<'_>>,
    [q, k, v, out]: [Projection<'_>; 4],
    heads: usize,
    causal: bool,
    compute: Precision,
) -> Result<Option<Tensor>> {
    let features =
        *x.dims().last().ok_or_else(|| candle_core::Error::Msg("linear: x has no dimensions".into()))?;
    for p in [&q, &k, &v] {
        check_linear_shapes(features, p.weight.differentiated.dims(), p.bias.map(Tensor::dims))?;
    }
    let mixed = v.weight.differentiated.dim(0)?;
    check_linear_shapes(mixed, out.weight.differentiated.dims(), out.bias.map(Tensor::dims))?;
    self_attention::self_attention(x, norm, [q, k, v, out], heads, causal, compute)
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

/// The rows of a `(.., d)` tensor: the product of its dimensions before the last (1 for a vector). Not
/// its element count over `d`, which is 0 for rows of no elements (`d` = 0), whatever their number.
pub(crate) fn rows_before_last(dims: &[usize]) -> usize {
    dims[..dims.len().saturating_sub(1)].iter().product()
}
