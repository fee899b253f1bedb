//! Convolutions over one and two spatial dimensions: `y[b, o] = sum_c W[o, c] * x[b, c] + bias[o]`.
//!
//! Shapes: [`Conv1d`] takes `x` `(batch, in, length)` and `W` `(out, in / groups, k)`; [`Conv2d`] takes
//! `x` `(batch, in, height, width)` and `W` `(out, in / groups, k, k)`; `bias` is `(out)`. Configuration
//! (padding, stride, dilation, groups) is candle-nn's [`Conv1dConfig`] / [`Conv2dConfig`].
//!
//! Convolutions are matmul-class: input and weight are rounded to the compute precision and the
//! products accumulate in f32; the bias is added in f32 (so the bias gradient also sums in f32).
//!
//! On the CPU both run on amp's GEMM ([`crate::dispatch`]): per image, the input's patches unfolded into
//! a matrix (im2col; an f32 input rounded on the way, no cast pass) and one product per group, with a
//! backward through the same GEMM; bf16 included, which candle's own CPU conv2d refuses. The f32 sums
//! plus the bias are rounded once, to the output dtype. Elsewhere, or with candle's kernel forced,
//! candle's convolution runs in the compute precision and its result is rounded to it before the bias
//! (bf16 on the CPU through an exact f32 path: see [`Conv2d`]; a 1-d convolution as a 2-d one of
//! height 1, since candle's CPU `conv1d` has a wrong backward).

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{init, Conv1dConfig, Conv2dConfig, VarBuilder};

use crate::ops::input::Input;
use crate::ops::{self, ConvParams};
use crate::{LayerPrecision, Param, Precision};

/// A 1-d convolution with candle-nn's parameter names (`weight`, `bias`), shapes and initialisation.
#[derive(Clone, Debug)]
pub struct Conv1d {
    weight: Param,
    bias: Option<Param>,
    config: Conv1dConfig,
    precision: LayerPrecision,
}

/// A 2-d convolution (square kernel) with candle-nn's parameter names (`weight`, `bias`), shapes and
/// initialisation.
///
/// **bf16 on CPU.** amp's GEMM computes it like any other precision. candle 0.11's CPU `conv2d`
/// refuses bf16 ("unsupported dtype BF16 for op matmul"): when candle's kernel is forced
/// ([`crate::dispatch::set_override`]), this layer rounds both operands to bf16 as usual, widens them
/// to f32 (exact), convolves in f32 and rounds the result to bf16. A product of two bf16 values (8-bit
/// significands) is exact in f32's 24 bits, so this is what a bf16 kernel with f32 accumulation
/// computes: same operand roundings, same accumulation precision, one rounding of the result. The
/// backward runs through the same f32 convolution and the gradient is rounded to bf16 on its way back
/// to the bf16 operand, again as a bf16 kernel would return it. The cost is an f32 copy of input and
/// kernel.
#[derive(Clone, Debug)]
pub struct Conv2d {
    weight: Param,
    bias: Option<Param>,
    config: Conv2dConfig,
    precision: LayerPrecision,
}

/// A 1-d convolution with bias, created or loaded through `vb` like `candle_nn::conv1d`.
pub fn conv1d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    config: Conv1dConfig,
    vb: VarBuilder<'_>,
) -> Result<Conv1d> {
    let mut layer = conv1d_no_bias(in_channels, out_channels, kernel_size, config, vb.clone())?;
    layer.bias = Some(conv_bias(in_channels, out_channels, &vb)?);
    Ok(layer)
}

/// A 1-d convolution without bias, like `candle_nn::conv1d_no_bias`.
pub fn conv1d_no_bias(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    config: Conv1dConfig,
    vb: VarBuilder<'_>,
) -> Result<Conv1d> {
    let shape = (out_channels, in_channels / config.groups, kernel_size);
    let weight = vb.get_with_hints(shape, "weight", init::DEFAULT_KAIMING_NORMAL)?;
    Ok(Conv1d::new(Param::from_tensor(&weight)?, None, config))
}

/// A 2-d convolution with bias, created or loaded through `vb` like `candle_nn::conv2d`.
pub fn conv2d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    config: Conv2dConfig,
    vb: VarBuilder<'_>,
) -> Result<Conv2d> {
    let mut layer = conv2d_no_bias(in_channels, out_channels, kernel_size, config, vb.clone())?;
    layer.bias = Some(conv_bias(in_channels, out_channels, &vb)?);
    Ok(layer)
}

/// A 2-d convolution without bias, like `candle_nn::conv2d_no_bias`.
pub fn conv2d_no_bias(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    config: Conv2dConfig,
    vb: VarBuilder<'_>,
) -> Result<Conv2d> {
    let shape = (out_channels, in_channels / config.groups, kernel_size, kernel_size);
    let weight = vb.get_with_hints(shape, "weight", init::DEFAULT_KAIMING_NORMAL)?;
    Ok(Conv2d::new(Param::from_tensor(&weight)?, None, config))
}

/// candle-nn's convolution bias: uniform in `+-1/sqrt(in_channels)`.
fn conv_bias(in_channels: usize, out_channels: usize, vb: &VarBuilder<'_>) -> Result<Param> {
    let bound = 1.0 / (in_channels as f64).sqrt();
    let bias = vb.get_with_hints(out_channels, "bias", init::Init::Uniform { lo: -bound, up: bound })?;
    Ok(Param::from_tensor(&bias)?)
}

impl Conv1d {
    /// A layer from existing parameters: `weight` `(out, in / groups, k)`, `bias` `(out)`.
    pub fn new(weight: Param, bias: Option<Param>, config: Conv1dConfig) -> Self {
        Conv1d { weight, bias, config, precision: LayerPrecision::FP32 }
    }

    /// The kernel, `(out, in / groups, k)`.
    pub fn weight(&self) -> &Param {
        &self.weight
    }

    /// The bias, `(out)`.
    pub fn bias(&self) -> Option<&Param> {
        self.bias.as_ref()
    }

    /// Padding, stride, dilation and groups.
    pub fn config(&self) -> &Conv1dConfig {
        &self.config
    }
}

impl Conv2d {
    /// A layer from existing parameters: `weight` `(out, in / groups, k, k)`, `bias` `(out)`.
    pub fn new(weight: Param, bias: Option<Param>, config: Conv2dConfig) -> Self {
        Conv2d { weight, bias, config, precision: LayerPrecision::FP32 }
    }

    /// The kernel, `(out, in / groups, k, k)`.
    pub fn weight(&self) -> &Param {
        &self.weight
    }

    /// The bias, `(out)`.
    pub fn bias(&self) -> Option<&Param> {
        self.bias.as_ref()
    }

    /// Padding, stride, dilation and groups.
    pub fn config(&self) -> &Conv2dConfig {
        &self.config
    }
}

impl Module for Conv1d {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let channels = self.weight.trainable().dim(1)? * self.config.groups;
        Input::Sequence.check("Conv1d", xs.dims(), channels)?;
        let compute = self.precision.compute;
        let w = self.weight.for_product(compute, xs.device())?;
        let (out, sums) = output_dtypes(self.precision, xs, self.bias.is_some());
        let c = &self.config;
        // A 1-d convolution is a 2-d one of height 1.
        let params = ConvParams {
            padding: [0, c.padding],
            stride: [1, c.stride],
            dilation: [1, c.dilation],
            groups: c.groups,
        };
        let y = match ops::conv2d(&xs.unsqueeze(2)?, &w.unsqueeze(2)?, params, compute, sums)? {
            Some(y) => y.squeeze(2)?,
            None => {
                conv1d_through_2d(&xs.to_dtype(compute.dtype())?, &self.weight.in_precision(compute)?, c)?
            }
        };
        add_bias(y, self.bias.as_ref(), 3, compute)?.to_dtype(out)
    }
}

impl Module for Conv2d {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let channels = self.weight.trainable().dim(1)? * self.config.groups;
        Input::Image.check("Conv2d", xs.dims(), channels)?;
        let compute = self.precision.compute;
        let w = self.weight.for_product(compute, xs.device())?;
        let (out, sums) = output_dtypes(self.precision, xs, self.bias.is_some());
        let c = &self.config;
        let params = ConvParams {
            padding: [c.padding; 2],
            stride: [c.stride; 2],
            dilation: [c.dilation; 2],
            groups: c.groups,
        };
        let y = match ops::conv2d(xs, &w, params, compute, sums)? {
            Some(y) => y,
            None => conv2d_any_dtype(&xs.to_dtype(compute.dtype())?, &self.weight.in_precision(compute)?, c)?,
        };
        add_bias(y, self.bias.as_ref(), 4, compute)?.to_dtype(out)
    }
}

/// The layer's output dtype, and the dtype amp's GEMM writes the products in: the output's, or f32
/// when a bias follows, so that the bias is added to the f32 sums and the result rounded once (a GEMM
/// epilogue's order, as [`super::Linear`]'s).
pub(super) fn output_dtypes(precision: LayerPrecision, xs: &Tensor, has_bias: bool) -> (DType, DType) {
    let out = precision.output.map_or(xs.dtype(), |p| p.dtype());
    (out, if has_bias { DType::F32 } else { out })
}

/// candle's `conv2d`, except for bf16 on CPU, which it lacks: there the bf16 operands are widened to
/// f32 exactly, convolved with f32 accumulation, and the result rounded to bf16 (see [`Conv2d`]).
fn conv2d_any_dtype(x: &Tensor, w: &Tensor, c: &Conv2dConfig) -> Result<Tensor> {
    if x.dtype() == DType::BF16 && x.device().is_cpu() {
        let (x, w) = (x.to_dtype(DType::F32)?, w.to_dtype(DType::F32)?);
        let y = x.conv2d_with_algo(&w, c.padding, c.stride, c.dilation, c.groups, c.cudnn_fwd_algo)?;
        return y.to_dtype(DType::BF16);
    }
    x.conv2d_with_algo(w, c.padding, c.stride, c.dilation, c.groups, c.cudnn_fwd_algo)
}

/// candle's convolution for a 1-d one, as a 2-d one of height 1, the padding added explicitly (candle's
/// conv2d pads both dimensions alike). candle 0.11.1's CPU `conv1d` computes wrong gradients for a batch
/// of more than one image (the kernel's and the input's, against direct sums: `tests/nn_conv.rs`); its
/// `conv2d`'s are right.
fn conv1d_through_2d(x: &Tensor, w: &Tensor, c: &Conv1dConfig) -> Result<Tensor> {
    let x = x.pad_with_zeros(2, c.padding, c.padding)?.unsqueeze(2)?;
    let config = Conv2dConfig {
        padding: 0,
        stride: c.stride,
        dilation: c.dilation,
        groups: c.groups,
        cudnn_fwd_algo: c.cudnn_fwd_algo,
    };
    conv2d_any_dtype(&x, &w.unsqueeze(2)?, &config)?.squeeze(2)
}

/// Adds the `(out)` bias along dim 1 of a rank-`rank` result in f32 and rounds the sum once to the
/// result's dtype (a GEMM epilogue's order). Adding in f32 also makes the bias gradient, a sum over
/// batch and positions, accumulate in f32 rather than in the half dtype; under O2 on amp's GEMM it
/// reaches the fp32 master in f32 ([`Param::as_f32_addend`]).
pub(super) fn add_bias(y: Tensor, bias: Option<&Param>, rank: usize, compute: Precision) -> Result<Tensor> {
    let Some(bias) = bias else { return Ok(y) };
    let bias = bias.as_f32_addend(compute, y.device())?;
    let mut shape = vec![1; rank];
    shape[1] = bias.dims1()?;
    y.to_dtype(DType::F32)?.broadcast_add(&bias.reshape(shape)?)?.to_dtype(y.dtype())
}

leaf_layer!(Conv1d, "Conv1d", params [weight; bias]);
leaf_layer!(Conv2d, "Conv2d", params [weight; bias]);
