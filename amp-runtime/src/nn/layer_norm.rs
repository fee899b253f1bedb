//! Layer normalisation over the last dimension, statistics in fp32:
//! `y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias`.
//!
//! On the CPU one op computes it, forward and backward ([`crate::ops`]' fused layer norm: one pass
//! each, f64 row statistics); elsewhere it is written with differentiable candle ops, so it has a
//! backward in every dtype (candle-nn's fused `layer_norm` has none on contiguous input). The input is
//! widened to f32 first: a mean over `n` values in half precision accumulates rounding error of order
//! `n * eps_half` and overflows fp16 for large activations.

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::{init, VarBuilder};

use crate::{LayerPrecision, Param};

/// Layer normalisation with candle-nn's parameter names (`weight`, `bias`). Pinned to fp32.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    weight: Param,
    bias: Option<Param>,
    eps: f64,
    precision: LayerPrecision,
}

/// A layer norm over `size` features with `weight` (ones) and `bias` (zeros), created or loaded through
/// `vb` like `candle_nn::layer_norm`.
pub fn layer_norm(size: usize, eps: f64, vb: VarBuilder<'_>) -> Result<LayerNorm> {
    let weight = vb.get_with_hints(size, "weight", init::Init::Const(1.0))?;
    let bias = vb.get_with_hints(size, "bias", init::Init::Const(0.0))?;
    Ok(LayerNorm::new(Param::from_tensor(&weight)?, Some(Param::from_tensor(&bias)?), eps))
}

impl LayerNorm {
    /// A layer norm from existing parameters.
    pub fn new(weight: Param, bias: Option<Param>, eps: f64) -> Self {
        LayerNorm { weight, bias, eps, precision: LayerPrecision::FP32 }
    }

    /// The scale, `(size)`.
    pub fn weight(&self) -> &Param {
        &self.weight
    }

    /// The shift, `(size)`.
    pub fn bias(&self) -> Option<&Param> {
        self.bias.as_ref()
    }
}

impl LayerNorm {
    /// The weight and the bias as the norm computes with them (fp32).
    pub(crate) fn operands(&self) -> Result<(Tensor, Option<Tensor>)> {
        let weight = self.weight.in_precision(crate::Precision::Fp32)?;
        let bias = self.bias.as_ref().map(|b| b.in_precision(crate::Precision::Fp32)).transpose()?;
        Ok((weight, bias))
    }

    /// `eps`, added to the variance.
    pub(crate) fn eps(&self) -> f64 {
        self.eps
    }
}

impl Module for LayerNorm {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let (weight, bias) = self.operands()?;
        if let Some(y) = crate::ops::layer_norm(xs, &weight, bias.as_ref(), self.eps)? {
            return super::cast_output(y, self.precision, xs.dtype());
        }
        let x = xs.to_dtype(DType::F32)?;
        let centered = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
        let variance = centered.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centered.broadcast_div(&(variance + self.eps)?.sqrt()?)?;
        let mut y = normed.broadcast_mul(&weight)?;
        if let Some(bias) = &bias {
            y = y.broadcast_add(bias)?;
        }
        super::cast_output(y, self.precision, xs.dtype())
    }
}

leaf_layer!(LayerNorm, "LayerNorm", pinned_fp32, params [weight; bias]);
