//! Transposed convolutions over one and two spatial dimensions: the upsampling layers of decoders,
//! U-Nets, vocoders and GAN generators.
//!
//! Shapes and configuration are candle-nn's: [`ConvTranspose1d`] takes `x` `(batch, in, length)` and
//! `W` `(in, out / groups, k)` ([`ConvTranspose1dConfig`]: padding, output padding, stride,
//! dilation, groups); [`ConvTranspose2d`] takes `x` `(batch, in, height, width)` and `W`
//! `(in, out, k, k)` ([`ConvTranspose2dConfig`], which has no groups); `bias` is `(out)`. Per spatial
//! dimension the output has `(in - 1) stride - 2 padding + dilation (k - 1) + output_padding + 1`
//! elements.
//!
//! Why amp has them: candle 0.11.1's `conv_transpose1d` has no backward (training through
//! `candle_nn::ConvTranspose1d` fails with "backward is not supported for conv-transpose1d"), and the
//! backward of its `conv_transpose2d` fails in bf16 on the CPU and when the output padding reaches the
//! stride. Here, on the CPU, both run on amp's GEMM with a backward through the same GEMM
//! ([`crate::ops`]'s transposed convolution: the adjoint of a convolution), in every precision:
//! operands rounded to the compute precision, products summed in f32, the bias added in f32 and the
//! result rounded once. Elsewhere (CUDA) or with candle's kernel forced ([`crate::dispatch`]),
//! candle's `conv_transpose2d` runs without padding, one group at a time, and the result is cropped
//! by the padding and extended by the output padding here, so that its backward serves the 1-d layer,
//! the groups and any output padding; bf16 on the CPU through an exact f32 path, as [`super::Conv2d`].

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{init, ConvTranspose1dConfig, ConvTranspose2dConfig, VarBuilder};

use super::conv::{add_bias, output_dtypes};
use crate::ops::input::Input;
use crate::ops::{self, ConvParams};
use crate::{LayerPrecision, Param};

/// A 1-d transposed convolution with candle-nn's parameter names (`weight`, `bias`), shapes and
/// initialisation.
#[derive(Clone, Debug)]
pub struct ConvTranspose1d {
    weight: Param,
    bias: Option<Param>,
    config: ConvTranspose1dConfig,
    precision: LayerPrecision,
}

/// A 2-d transposed convolution (square kernel) with candle-nn's parameter names (`weight`, `bias`),
/// shapes and initialisation.
#[derive(Clone, Debug)]
pub struct ConvTranspose2d {
    weight: Param,
    bias: Option<Param>,
    config: ConvTranspose2dConfig,
    precision: LayerPrecision,
}

/// A 1-d transposed convolution with bias, created or loaded through `vb` like
/// `candle_nn::conv_transpose1d`.
pub fn conv_transpose1d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    config: ConvTranspose1dConfig,
    vb: VarBuilder<'_>,
) -> Result<ConvTranspose1d> {
    let mut layer = conv_transpose1d_no_bias(in_channels, out_channels, kernel_size, config, vb.clone())?;
    layer.bias = Some(bias(out_channels, bound_1d(out_channels, kernel_size), &vb)?);
    Ok(layer)
}

/// A 1-d transposed convolution without bias, like `candle_nn::conv_transpose1d_no_bias`.
pub fn conv_transpose1d_no_bias(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    config: ConvTranspose1dConfig,
    vb: VarBuilder<'_>,
) -> Result<ConvTranspose1d> {
    let groups = config.groups;
    if groups == 0 || !out_channels.is_multiple_of(groups) || !in_channels.is_multiple_of(groups) {
        candle_core::bail!(
            "ConvTranspose1d: {in_channels} input and {out_channels} output channels in {groups} groups: both \
             must divide by the groups (at least 1)"
        );
    }
    let shape = (in_channels, out_channels / groups, kernel_size);
    let weight = vb.get_with_hints(shape, "weight", uniform(bound_1d(out_channels, kernel_size)))?;
    Ok(ConvTranspose1d::new(Param::from_tensor(&weight)?, None, config))
}

/// A 2-d transposed convolution with bias, created or loaded through `vb` like
/// `candle_nn::conv_transpose2d`.
pub fn conv_transpose2d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    config: ConvTranspose2dConfig,
    vb: VarBuilder<'_>,
) -> Result<ConvTranspose2d> {
    let mut layer = conv_transpose2d_no_bias(in_channels, out_channels, kernel_size, config, vb.clone())?;
    layer.bias = Some(bias(out_channels, bound_2d(out_channels, kernel_size), &vb)?);
    Ok(layer)
}

/// A 2-d transposed convolution without bias, like `candle_nn::conv_transpose2d_no_bias`.
pub fn conv_transpose2d_no_bias(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    config: ConvTranspose2dConfig,
    vb: VarBuilder<'_>,
) -> Result<ConvTranspose2d> {
    let shape = (in_channels, out_channels, kernel_size, kernel_size);
    let weight = vb.get_with_hints(shape, "weight", uniform(bound_2d(out_channels, kernel_size)))?;
    Ok(ConvTranspose2d::new(Param::from_tensor(&weight)?, None, config))
}

/// candle-nn's initialisation bound of a 1-d transposed convolution: `1 / sqrt(out k)`.
fn bound_1d(out_channels: usize, kernel_size: usize) -> f64 {
    1.0 / (out_channels as f64 * kernel_size as f64).sqrt()
}

/// candle-nn's initialisation bound of a 2-d transposed convolution: `1 / (sqrt(out) k)`.
fn bound_2d(out_channels: usize, kernel_size: usize) -> f64 {
    1.0 / (out_channels as f64).sqrt() / kernel_size as f64
}

fn uniform(bound: f64) -> init::Init {
    init::Init::Uniform { lo: -bound, up: bound }
}

/// The `(out)` bias, uniform in `+-bound` like the weight (candle-nn's).
fn bias(out_channels: usize, bound: f64, vb: &VarBuilder<'_>) -> Result<Param> {
    Ok(Param::from_tensor(&vb.get_with_hints(out_channels, "bias", uniform(bound))?)?)
}

impl ConvTranspose1d {
    /// A layer from existing parameters: `weight` `(in, out / groups, k)`, `bias` `(out)`.
    pub fn new(weight: Param, bias: Option<Param>, config: ConvTranspose1dConfig) -> Self {
        ConvTranspose1d { weight, bias, config, precision: LayerPrecision::FP32 }
    }

    /// The kernel, `(in, out / groups, k)`.
    pub fn weight(&self) -> &Param {
        &self.weight
    }

    /// The bias, `(out)`.
    pub fn bias(&self) -> Option<&Param> {
        self.bias.as_ref()
    }

    /// Padding, output padding, stride, dilation and groups.
    pub fn config(&self) -> &ConvTranspose1dConfig {
        &self.config
    }
}

impl ConvTranspose2d {
    /// A layer from existing parameters: `weight` `(in, out, k, k)`, `bias` `(out)`.
    pub fn new(weight: Param, bias: Option<Param>, config: ConvTranspose2dConfig) -> Self {
        ConvTranspose2d { weight, bias, config, precision: LayerPrecision::FP32 }
    }

    /// The kernel, `(in, out, k, k)`.
    pub fn weight(&self) -> &Param {
        &self.weight
    }

    /// The bias, `(out)`.
    pub fn bias(&self) -> Option<&Param> {
        self.bias.as_ref()
    }

    /// Padding, output padding, stride and dilation.
    pub fn config(&self) -> &ConvTranspose2dConfig {
        &self.config
    }
}

impl Module for ConvTranspose1d {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        Input::Sequence.check("ConvTranspose1d", xs.dims(), self.weight.trainable().dim(0)?)?;
        let c = &self.config;
        // A 1-d transposed convolution is a 2-d one of height 1.
        let params = ConvParams {
            padding: [0, c.padding],
            stride: [1, c.stride],
            dilation: [1, c.dilation],
            groups: c.groups,
        };
        let layer = Transposed::of(&self.weight, self.bias.as_ref(), self.precision, true);
        layer.forward(&xs.unsqueeze(2)?, params, [0, c.output_padding])?.squeeze(2)
    }
}

impl Module for ConvTranspose2d {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        Input::Image.check("ConvTranspose2d", xs.dims(), self.weight.trainable().dim(0)?)?;
        let c = &self.config;
        let params = ConvParams {
            padding: [c.padding; 2],
            stride: [c.stride; 2],
            dilation: [c.dilation; 2],
            groups: 1,
        };
        let layer = Transposed::of(&self.weight, self.bias.as_ref(), self.precision, false);
        layer.forward(xs, params, [c.output_padding; 2])
    }
}

/// What both layers share: a 2-d transposed convolution of `(batch, in, h, w)`, of height 1 for the
/// 1-d layer.
struct Transposed<'a> {
    weight: &'a Param,
    bias: Option<&'a Param>,
    precision: LayerPrecision,
    /// The 1-d layer's: its weight `(in, out / groups, k)` read as `(in, out / groups, 1, k)`.
    height_one: bool,
}

impl<'a> Transposed<'a> {
    fn of(weight: &'a Param, bias: Option<&'a Param>, precision: LayerPrecision, height_one: bool) -> Self {
        Transposed { weight, bias, precision, height_one }
    }

    fn forward(&self, xs: &Tensor, params: ConvParams, output_padding: [usize; 2]) -> Result<Tensor> {
        let compute = self.precision.compute;
        let (out, sums) = output_dtypes(self.precision, xs, self.bias.is_some());
        let w = self.weight.for_product(compute, xs.device())?;
        let w = if self.height_one { w.unsqueeze(2)? } else { w };
        let y = match ops::conv_transpose2d(xs, &w, params, output_padding, compute, sums)? {
            Some(y) => y,
            None => {
                let w = self.weight.in_precision(compute)?;
                let w = if self.height_one { w.unsqueeze(2)? } else { w };
                through_candle(&xs.to_dtype(compute.dtype())?, &w, params, output_padding)?
            }
        };
        add_bias(y, self.bias, 4, compute)?.to_dtype(out)
    }
}

/// candle's transposed convolution of `x (batch, in, h, w)` by `w (in, out / groups, kh, kw)`: run
/// without padding and one group at a time (candle's kernel has no groups, pads both dimensions alike
/// and has a backward that breaks once the output padding reaches the stride), then cropped by the
/// padding and extended with zeros by the output padding. candle takes one stride and dilation for
/// both dimensions: the width's, which is also right for a height of 1 with a kernel of height 1 (the
/// 1-d layer's). bf16 on the CPU, which candle lacks, through an exact f32 path (see
/// [`super::Conv2d`]).
fn through_candle(x: &Tensor, w: &Tensor, params: ConvParams, output_padding: [usize; 2]) -> Result<Tensor> {
    if x.dtype() == DType::BF16 && x.device().is_cpu() {
        let y = through_candle(&x.to_dtype(DType::F32)?, &w.to_dtype(DType::F32)?, params, output_padding)?;
        return y.to_dtype(DType::BF16);
    }
    let (stride, dilation) = (params.stride[1], params.dilation[1]);
    let per_group = x
        .chunk(params.groups, 1)?
        .iter()
        .zip(w.chunk(params.groups, 0)?)
        .map(|(x, w)| x.conv_transpose2d(&w, 0, 0, stride, dilation))
        .collect::<Result<Vec<_>>>()?;
    let mut y = Tensor::cat(&per_group, 1)?;
    for (d, (padding, extra)) in params.padding.into_iter().zip(output_padding).enumerate() {
        let full = y.dim(2 + d)?;
        let Some(wanted) = (full + extra).checked_sub(2 * padding).filter(|&n| n > 0) else {
            candle_core::bail!(
                "transposed convolution of {:?} by {:?}: a padding of {padding} crops all {full} elements \
                 of dimension {}",
                x.dims(),
                w.dims(),
                2 + d
            );
        };
        let kept = wanted.min(full.saturating_sub(padding));
        y = y.narrow(2 + d, padding.min(full), kept)?;
        if wanted > kept {
            y = y.pad_with_zeros(2 + d, 0, wanted - kept)?;
        }
    }
    Ok(y)
}

leaf_layer!(ConvTranspose1d, "ConvTranspose1d", params [weight; bias]);
leaf_layer!(ConvTranspose2d, "ConvTranspose2d", params [weight; bias]);
