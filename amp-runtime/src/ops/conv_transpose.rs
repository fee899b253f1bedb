//! Transposed convolutions on amp's CPU GEMM, as a candle op with a backward pass.
//!
//! The transposed convolution of `x (batch, in, h, w)` with `W (in, out / groups, kh, kw)` is the
//! adjoint of a convolution: the map from the output gradient to the input gradient of the
//! convolution of a `(batch, out, oh, ow)` image by the same `W`, read as a convolution kernel
//! `(in, out / groups, kh, kw)`. Its three products are that convolution's ([`super::conv`]) with the
//! roles exchanged:
//! - forward: the convolution's input gradient, `fold(W_g^T · x_b)`, the columns in f32 folded in f32
//!   and rounded once into the output dtype;
//! - `dX`: the convolution of `dY` by `W` (im2col + GEMM);
//! - `dW`: the convolution's weight gradient, with `dY` as its input and `x` as its output gradient.
//!
//! Per dimension the output has `(in - 1) stride - 2 padding + dilation (kernel - 1) +
//! output_padding + 1` elements. With `output_padding >= stride` (PyTorch accepts it below the dilation, candle at
//! any size) a convolution of that size has more positions than `x` has elements: `x` is extended
//! with zeros to them, which adds nothing to the result, and autograd narrows its gradient back.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::conv::{conv_error, ConvOp, ConvParams, ConvWeightGradient, Geometry};
use super::gemm::{deposit, is_float, needs_gradient, read_from};
use super::Operand;
use crate::dispatch::{self, compute_of, MatmulKernel};
use crate::Precision;

/// `x (batch, in, h, w)` transposed-convolved with `W (in, out / groups, kh, kw)` on amp's GEMM:
/// operands rounded to `compute` while packed, products summed in f32, the result
/// `(batch, out, oh, ow)` rounded once into `out`; gradients in their operands' dtypes (the weight's
/// in f32 for an fp32 master read from its working copy, [`Operand::values`]). `None` when the
/// dispatcher does not pick amp's GEMM (not a CPU, candle forced) or a dtype is not a float: the
/// caller then uses candle's kernel.
///
/// # Errors
/// On shapes that make no transposed convolution (channels that do not match the kernel or divide by
/// the groups, no output element), with the reason.
pub(crate) fn conv_transpose2d(
    x: &Tensor,
    weight: &Operand,
    params: ConvParams,
    output_padding: [usize; 2],
    compute: Precision,
    out: DType,
) -> Result<Option<Tensor>> {
    let w = &weight.differentiated;
    let output = output_dims(params, output_padding, x.dims(), w.dims())?;
    let geometry = Geometry::new(params, &output, w.dims())?;
    match dispatch::explain(x.device(), compute, geometry.product()).kernel {
        MatmulKernel::Amp(path) if [x.dtype(), w.dtype(), out].into_iter().all(is_float) => {
            let values = weight.values.clone().filter(|v| v.dims() == w.dims());
            let conv = ConvOp { path, compute: compute_of(compute), params, out, values };
            let x = extended_to(x, geometry.output())?;
            let op = ConvTransposeOp { conv, output: (output[0], output[1], output[2], output[3]) };
            Ok(Some(x.contiguous()?.apply_op2(&w.contiguous()?, op)?))
        }
        _ => Ok(None),
    }
}

/// The result's dims, `(batch, out, oh, ow)`, with the operands checked.
fn output_dims(
    params: ConvParams,
    output_padding: [usize; 2],
    x: &[usize],
    w: &[usize],
) -> Result<[usize; 4]> {
    let (&[batch, channels, height, width], &[inputs, per_group, kh, kw]) = (x, w) else {
        return Err(conv_error(format!("transposed: input {x:?} and kernel {w:?} must both have rank 4")));
    };
    let groups = params.groups;
    if channels != inputs || groups == 0 || !inputs.is_multiple_of(groups) {
        return Err(conv_error(format!(
            "transposed: input {x:?} and kernel {w:?} with {groups} groups: the input's channels (dim 1) \
             must be the kernel's dim 0 and divide by the groups"
        )));
    }
    let size = |d: usize, input: usize, kernel: usize| {
        let reach =
            input.checked_sub(1)? * params.stride[d] + params.dilation[d] * kernel.checked_sub(1)? + 1;
        (reach + output_padding[d]).checked_sub(2 * params.padding[d]).filter(|&n| n > 0)
    };
    match (size(0, height, kh), size(1, width, kw)) {
        (Some(rows), Some(cols)) => Ok([batch, per_group * groups, rows, cols]),
        _ => Err(conv_error(format!(
            "transposed: input {x:?}, kernel {w:?}, {params:?}, output padding {output_padding:?}: no \
             output element (an empty input or kernel, or a padding that crops everything)"
        ))),
    }
}

/// `x` extended with zeros after its last row and column to `[rows, cols]` (itself when that is its
/// size).
fn extended_to(x: &Tensor, [rows, cols]: [usize; 2]) -> Result<Tensor> {
    let (_, _, height, width) = x.dims4()?;
    let (more_rows, more_cols) = (rows.saturating_sub(height), cols.saturating_sub(width));
    if more_rows == 0 && more_cols == 0 {
        return Ok(x.clone());
    }
    x.pad_with_zeros(2, 0, more_rows)?.pad_with_zeros(3, 0, more_cols)
}

/// The candle op: the convolution's input gradient as a forward, with its own backward.
#[derive(Clone, Debug)]
struct ConvTransposeOp {
    /// The convolution whose adjoint this is; its `out` is this op's result dtype.
    conv: ConvOp,
    /// The result's dims (the convolution's input's).
    output: (usize, usize, usize, usize),
}

impl CustomOp2 for ConvTransposeOp {
    fn name(&self) -> &'static str {
        "amp-conv-transpose"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        read_from(self.conv.values.as_ref(), s2, l2, |s2, l2| {
            self.conv.input_gradient(self.output, self.conv.out, (s1, l1), (s2, l2))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let w_read = self.conv.values.as_ref().unwrap_or(w);
        let dx = needs_gradient(x)
            .then(|| {
                let op = ConvOp { out: x.dtype(), values: None, ..self.conv.clone() };
                grad.apply_op2_no_bwd(w_read, &op)
            })
            .transpose()?;
        let dw = needs_gradient(w)
            .then(|| {
                let op = ConvWeightGradient { op: self.conv.clone(), w: w.dims4()? };
                grad.apply_op2_no_bwd(x, &op)?.to_dtype(w.dtype())
            })
            .transpose()?;
        Ok((deposit(x, dx)?, deposit(w, dw)?))
    }
}
