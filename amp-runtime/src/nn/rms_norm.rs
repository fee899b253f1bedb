//! Root-mean-square normalisation over the last dimension, in fp32:
//! `y = x / sqrt(mean(x^2) + eps) * weight`.
//!
//! On the CPU one op computes it, forward and backward ([`crate::ops`]' fused row norm: one pass each,
//! the mean of squares in f64, so rows beyond 1.8e19, whose f32 squares overflow, are normalised too);
//! elsewhere differentiable candle ops in f32, so it has a backward in every dtype (candle-nn's fused
//! `rms_norm` has none). Never in half precision: the squares overflow fp16 for |x| > 256.

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::{init, VarBuilder};

use crate::{LayerPrecision, Param, Precision};

/// RMS normalisation with candle-nn's parameter name (`weight`). Pinned to fp32.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    weight: Param,
    eps: f64,
    precision: LayerPrecision,
}

/// An RMS norm over `size` features with `weight` (ones), created or loaded through `vb` like
/// `candle_nn::rms_norm`.
pub fn rms_norm(size: usize, eps: f64, vb: VarBuilder<'_>) -> Result<RmsNorm> {
    let weight = vb.get_with_hints(size, "weight", init::Init::Const(1.0))?;
    Ok(RmsNorm::new(Param::from_tensor(&weight)?, eps))
}

impl RmsNorm {
    /// An RMS norm from an existing scale.
    pub fn new(weight: Param, eps: f64) -> Self {
        RmsNorm { weight, eps, precision: LayerPrecision::FP32 }
    }

    /// The scale, `(size)`.
    pub fn weight(&self) -> &Param {
        &self.weight
    }
}

impl Module for RmsNorm {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let weight = self.weight.in_precision(Precision::Fp32)?;
        if let Some(y) = crate::ops::rms_norm(xs, &weight, self.eps)? {
            return super::cast_output(y, self.precision, xs.dtype());
        }
        let x = xs.to_dtype(DType::F32)?;
        let mean_square = x.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = x.broadcast_div(&(mean_square + self.eps)?.sqrt()?)?;
        let y = normed.broadcast_mul(&weight)?;
        super::cast_output(y, self.precision, xs.dtype())
    }
}

leaf_layer!(RmsNorm, "RmsNorm", pinned_fp32, params[weight]);
