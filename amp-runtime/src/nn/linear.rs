//! Fully connected layer: `y = x W^T + b`.
//!
//! Shapes: `x` is `(.., in)`, `W` is `(out, in)`, `b` is `(out)`, `y` is `(.., out)`. The product runs in
//! the compute precision with f32 accumulation (candle's kernels accumulate half products in f32).

use candle_core::{Module, Result, Tensor};
use candle_nn::{init, VarBuilder};

use crate::{LayerPrecision, Param};

/// A linear layer with candle-nn's parameter names (`weight`, `bias`) and initialisation.
#[derive(Clone, Debug)]
pub struct Linear {
    weight: Param,
    bias: Option<Param>,
    precision: LayerPrecision,
}

/// A linear layer with bias, created or loaded through `vb` like `candle_nn::linear`.
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder<'_>) -> Result<Linear> {
    let bound = 1.0 / (in_dim as f64).sqrt();
    let bias = vb.get_with_hints(out_dim, "bias", init::Init::Uniform { lo: -bound, up: bound })?;
    let mut layer = linear_no_bias(in_dim, out_dim, vb)?;
    layer.bias = Some(Param::from_tensor(&bias)?);
    Ok(layer)
}

/// A linear layer without bias, like `candle_nn::linear_no_bias`.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder<'_>) -> Result<Linear> {
    let weight = vb.get_with_hints((out_dim, in_dim), "weight", init::DEFAULT_KAIMING_NORMAL)?;
    Ok(Linear::new(Param::from_tensor(&weight)?, None))
}

impl Linear {
    /// A layer from existing parameters: `weight` of shape `(out, in)`, `bias` of shape `(out)`.
    pub fn new(weight: Param, bias: Option<Param>) -> Self {
        Linear { weight, bias, precision: LayerPrecision::FP32 }
    }

    /// The weight, `(out, in)`.
    pub fn weight(&self) -> &Param {
        &self.weight
    }

    /// The bias, `(out)`.
    pub fn bias(&self) -> Option<&Param> {
        self.bias.as_ref()
    }
}

impl Module for Linear {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let compute = self.precision.compute;
        let x = xs.to_dtype(compute.dtype())?;
        let w = self.weight.in_precision(compute)?;
        let w = match *x.dims() {
            [b1, b2, _, _] => w.broadcast_left((b1, b2))?.t()?,
            [b, _, _] => w.broadcast_left(b)?.t()?,
            _ => w.t()?,
        };
        let mut y = x.matmul(&w)?;
        if let Some(bias) = &self.bias {
            // In f32: the bias gradient sums the upstream gradient over the batch, and that sum must not
            // accumulate in half precision. The result is rounded once, by the output cast.
            y = y
                .to_dtype(candle_core::DType::F32)?
                .broadcast_add(&bias.in_precision(crate::Precision::Fp32)?)?;
        }
        super::cast_output(y, self.precision, xs.dtype())
    }
}

leaf_layer!(Linear, "Linear", params [weight; bias]);
