//! Fully connected layer: `y = x W^T + b`.
//!
//! Shapes: `x` is `(.., in)`, `W` is `(out, in)`, `b` is `(out)`, `y` is `(.., out)`. The product runs in
//! the compute precision with f32 accumulation ([`crate::ops::matmul_to`]: amp's GEMM on the CPU, the
//! weight read transposed in place and rounded while packed, from its fp32 master under O2:
//! [`crate::GradientRoute`]), the bias is added in f32 (its gradient, under O2, to the master in f32),
//! and the result is rounded once to the layer's output precision. On CUDA candle's matmul returns a
//! half product in the compute dtype, so there the sum is rounded to it first and once more after the
//! bias.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{init, VarBuilder};

use crate::ops::{Epilogue, Operand};
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

    /// `relu(x W^T + b)`: the same values as `forward` followed by [`crate::ops::relu`], with the clamp
    /// applied to the fresh product and, in the backward pass, the gradient masked by the output inside
    /// the op that runs the two backward products (amp's CPU GEMM with a bias). That saves the separate
    /// ReLU's graph node: a pass over the activations each way and the zero-filled sum of its gradient
    /// (on the CPU a Linear without bias takes it too, from an untracked zero bias row).
    /// Measured on the MLP bench (`cargo bench --bench mlp_step`, the same binary but for the fused
    /// call): bf16 O2 step 13.7 -> 12.0 ms, fp32 30.1 -> 28.3 ms.
    /// Elsewhere (CUDA, or candle's kernel forced) `forward` then [`crate::ops::relu`].
    pub fn forward_relu(&self, xs: &Tensor) -> Result<Tensor> {
        self.forward_with(xs, Epilogue::Relu)
    }

    /// `gelu(x W^T + b)` (tanh approximation): the same values as `forward` followed by
    /// [`crate::ops::gelu`], with GELU computed from the fresh product and, in the backward pass, the
    /// gradient taken back through it inside the op that runs the two backward products (amp's CPU
    /// GEMM). The op keeps the product for that, as the separate GELU's graph node keeps its input;
    /// what goes is that node's gradient: a zero-filled tensor of its size and an add, each step.
    /// Elsewhere (CUDA, or candle's kernel forced) `forward` then [`crate::ops::gelu`].
    pub fn forward_gelu(&self, xs: &Tensor) -> Result<Tensor> {
        self.forward_with(xs, Epilogue::Gelu)
    }

    fn forward_with(&self, xs: &Tensor, epilogue: Epilogue) -> Result<Tensor> {
        let (w, bias) = self.product_operands(xs.device())?;
        let (compute, out) = (self.precision.compute, self.output_dtype(xs.dtype()));
        crate::ops::linear_to(xs, &w, bias.as_ref(), compute, out, epilogue)
    }

    /// The dtype of the layer's output for an input of dtype `input`.
    pub(crate) fn output_dtype(&self, input: DType) -> DType {
        self.precision.output.map_or(input, |p| p.dtype())
    }

    /// The weight and the bias as the layer's product reads them on `device`.
    pub(crate) fn product_operands(&self, device: &Device) -> Result<(Operand, Option<Tensor>)> {
        let compute = self.precision.compute;
        // On amp's CPU GEMM the weight is read as its fp32 master and rounded while packing, so its
        // gradient comes out of the GEMM in f32 (`GradientRoute`); elsewhere the working copy.
        let w = self.weight.for_product(compute, device)?;
        // The bias in f32: its gradient sums the upstream gradient over the batch, and that sum must not
        // accumulate in half precision, nor (under O2, on amp's GEMM) be rounded to the half working
        // copy. The product is summed in f32 and rounded once, to the output dtype.
        let bias = self.bias.as_ref().map(|b| b.as_f32_addend(compute, device)).transpose()?;
        Ok((w, bias))
    }
}

impl Module for Linear {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.forward_with(xs, Epilogue::Identity)
    }
}

leaf_layer!(Linear, "Linear", params [weight; bias]);
