//! Group normalisation, statistics in fp32: channels split into `groups` groups; each sample's group is
//! normalised by its own mean and biased variance, then scaled and shifted per channel:
//! `y = (x - mean_g) / sqrt(var_g + eps) * weight[c] + bias[c]`.
//!
//! Shapes: `x` is `(batch, channels, ..)` with at least one dimension after the channels; `weight` and
//! `bias` are `(channels)`. Computed in f32 whatever the input dtype: a group's variance of fp16
//! activations of a few hundred already overflows 65504 when squared in fp16. On the CPU each group is
//! a row of the fused layer norm ([`crate::ops`]: one pass each way, f64 statistics, so groups beyond
//! 1.8e19, whose f32 squares overflow, are normalised too), then scaled and shifted per channel by one
//! more op (one pass each way); elsewhere differentiable candle ops.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{init, VarBuilder};

use crate::{LayerPrecision, Param, Precision};

/// Group normalisation with candle-nn's parameter names (`weight`, `bias`). Pinned to fp32.
#[derive(Clone, Debug)]
pub struct GroupNorm {
    weight: Param,
    bias: Param,
    groups: usize,
    eps: f64,
    precision: LayerPrecision,
}

/// A group norm of `num_channels` channels in `num_groups` groups, with `weight` (ones) and `bias`
/// (zeros), created or loaded through `vb` like `candle_nn::group_norm`.
pub fn group_norm(num_groups: usize, num_channels: usize, eps: f64, vb: VarBuilder<'_>) -> Result<GroupNorm> {
    let weight = vb.get_with_hints(num_channels, "weight", init::Init::Const(1.0))?;
    let bias = vb.get_with_hints(num_channels, "bias", init::Init::Const(0.0))?;
    GroupNorm::new(Param::from_tensor(&weight)?, Param::from_tensor(&bias)?, num_groups, eps)
}

impl GroupNorm {
    /// A group norm from existing `(channels)` parameters; `groups` must divide the channel count.
    pub fn new(weight: Param, bias: Param, groups: usize, eps: f64) -> Result<Self> {
        let channels = weight.trainable().dims1()?;
        if groups == 0 || channels % groups != 0 {
            candle_core::bail!("group-norm: {groups} groups do not divide {channels} channels");
        }
        if bias.trainable().dims() != [channels] {
            candle_core::bail!(
                "group-norm: bias has shape {:?}, expected [{channels}]",
                bias.trainable().dims()
            );
        }
        Ok(GroupNorm { weight, bias, groups, eps, precision: LayerPrecision::FP32 })
    }

    /// The scale, `(channels)`.
    pub fn weight(&self) -> &Param {
        &self.weight
    }

    /// The shift, `(channels)`.
    pub fn bias(&self) -> &Param {
        &self.bias
    }

    /// The number of groups.
    pub fn groups(&self) -> usize {
        self.groups
    }
}

impl Module for GroupNorm {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let channels = self.weight.elem_count();
        if xs.rank() < 3 || xs.dim(1)? != channels {
            candle_core::bail!("group-norm: input {:?} needs rank >= 3 and {channels} channels", xs.shape());
        }
        let normed = self.normalise_groups(xs)?.reshape(xs.shape())?;
        let weight = self.weight.in_precision(Precision::Fp32)?;
        let bias = self.bias.in_precision(Precision::Fp32)?;
        let y = match crate::ops::channel_affine(&normed, 1, &weight, &bias)? {
            Some(y) => y,
            None => {
                let mut shape = vec![1; xs.rank()];
                shape[1] = channels;
                let (weight, bias) = (weight.reshape(shape.as_slice())?, bias.reshape(shape)?);
                normed.broadcast_mul(&weight)?.broadcast_add(&bias)?
            }
        };
        super::cast_output(y, self.precision, xs.dtype())
    }
}

impl GroupNorm {
    /// Each sample's groups normalised by their own statistics, f32, in `xs`'s shape or
    /// `(batch, groups, size)`.
    fn normalise_groups(&self, xs: &Tensor) -> Result<Tensor> {
        let batch = xs.dim(0)?;
        if let Some(normed) = crate::ops::normalise_rows(xs, batch * self.groups, true, self.eps)? {
            return Ok(normed);
        }
        let x = xs.to_dtype(DType::F32)?.reshape((batch, self.groups, ()))?;
        let size = x.dim(2)? as f64;
        let centered = x.broadcast_sub(&(x.sum_keepdim(2)? / size)?)?;
        let variance = (centered.sqr()?.sum_keepdim(2)? / size)?;
        centered.broadcast_div(&(variance + self.eps)?.sqrt()?)
    }
}

leaf_layer!(GroupNorm, "GroupNorm", pinned_fp32, params [weight, bias]);
