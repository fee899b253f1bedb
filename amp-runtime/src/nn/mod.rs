//! Precision-aware layers with candle-nn's names, shapes and initialisation, so existing candle code and
//! safetensors checkpoints carry over.
//!
//! Each layer casts its input and weights to its compute precision and its output to the policy's output
//! precision; `amp::initialize` sets both from the model's attributes and the optimisation level.
//! Matmul-class layers ([`Linear`], [`Embedding`]) are [`crate::HalfSafe`]; norms ([`LayerNorm`],
//! [`RmsNorm`]) compute their statistics in fp32 and are pinned there.
//!
//! Also: [`Conv1d`] and [`Conv2d`] (half-safe; bf16 works on CPU, where candle's own conv2d refuses it),
//! [`BatchNorm`] and [`GroupNorm`] (pinned fp32; BatchNorm's running statistics are f32 buffers),
//! [`Dropout`] (half-safe, no parameters), and the composite [`MultiHeadAttention`] (half-safe; its
//! softmax runs in f32).

mod attention;
mod batch_norm;
mod conv;
mod dropout;
mod embedding;
mod group_norm;
mod layer_norm;
mod linear;
mod loss;
mod rms_norm;

pub use attention::{multi_head_attention, MultiHeadAttention};
pub use batch_norm::{batch_norm, BatchNorm};
pub use candle_nn::{BatchNormConfig, Conv1dConfig, Conv2dConfig};
pub use conv::{conv1d, conv1d_no_bias, conv2d, conv2d_no_bias, Conv1d, Conv2d};
pub use dropout::Dropout;
pub use embedding::{embedding, Embedding};
pub use group_norm::{group_norm, GroupNorm};
pub use layer_norm::{layer_norm, LayerNorm};
pub use linear::{linear, linear_no_bias, Linear};
pub use loss::{BceWithLogitsLoss, BinaryCrossEntropyLoss, CrossEntropyLoss, MseLoss};
pub use rms_norm::{rms_norm, RmsNorm};

use candle_core::{DType, Result, Tensor};

use crate::LayerPrecision;

/// Casts a layer's result to its output precision, or back to `input` when none is set.
fn cast_output(result: Tensor, precision: LayerPrecision, input: DType) -> Result<Tensor> {
    let dtype = precision.output.map_or(input, |p| p.dtype());
    result.to_dtype(dtype)
}
