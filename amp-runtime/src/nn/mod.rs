//! Precision-aware layers with candle-nn's names, shapes and initialisation, so existing candle code and
//! safetensors checkpoints carry over.
//!
//! Each layer casts its input and weights to its compute precision and its output to the policy's output
//! precision; `amp::initialize` sets both from the model's attributes and the optimisation level.
//! Matmul-class layers ([`Linear`], [`Embedding`]) are [`crate::HalfSafe`]; norms ([`LayerNorm`],
//! [`RmsNorm`]) compute their statistics in fp32 and are pinned there.

mod embedding;
mod layer_norm;
mod linear;
mod rms_norm;

pub use embedding::{embedding, Embedding};
pub use layer_norm::{layer_norm, LayerNorm};
pub use linear::{linear, linear_no_bias, Linear};
pub use rms_norm::{rms_norm, RmsNorm};

use candle_core::{DType, Result, Tensor};

use crate::LayerPrecision;

/// Casts a layer's result to its output precision, or back to `input` when none is set.
fn cast_output(result: Tensor, precision: LayerPrecision, input: DType) -> Result<Tensor> {
    let dtype = precision.output.map_or(input, |p| p.dtype());
    result.to_dtype(dtype)
}
