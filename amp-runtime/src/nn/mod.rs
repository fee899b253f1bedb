//! Precision-aware layers with candle-nn's names, shapes and initialisation, so existing candle code and
//! safetensors checkpoints carry over.
//!
//! Each layer casts its input and weights to its compute precision and its output to the policy's output
//! precision; `amp::initialize` sets both from the model's attributes and the optimisation level.
//! Matmul-class layers ([`Linear`], [`Embedding`]) are [`crate::HalfSafe`]; norms ([`LayerNorm`],
//! [`RmsNorm`]) compute their statistics in fp32 and are pinned there.
//!
//! Also: [`Conv1d`] and [`Conv2d`] (half-safe; on the CPU im2col + amp's GEMM with a backward through
//! it, bf16 included, where candle's own conv2d refuses bf16), [`ConvTranspose1d`] and
//! [`ConvTranspose2d`] (half-safe; the same GEMM, as the adjoint of a convolution: candle's own have no
//! 1-d backward),
//! [`BatchNorm`] and [`GroupNorm`] (pinned fp32; BatchNorm's running statistics are f32 buffers),
//! [`Dropout`] (half-safe, no parameters), and the composite [`MultiHeadAttention`] (half-safe; its
//! softmax runs in f32).

/// Implements [`Layer`](crate::Layer) and [`AmpModule`](crate::AmpModule) for a leaf layer with a
/// `precision: LayerPrecision` field. Its parameters are the `Param` fields listed, then the
/// `Option<Param>` fields after `;`, named after the fields. A `pinned_fp32` layer computes in fp32
/// whatever it is asked; the others are [`HalfSafe`](crate::HalfSafe).
macro_rules! leaf_layer {
    ($ty:ident, $kind:literal, params [$($p:ident),* $(; $($o:ident),*)?]) => {
        leaf_layer!(@layer $ty, $kind, false, [$($p),*], [$($($o),*)?]);
        #[diagnostic::do_not_recommend]
        impl $crate::HalfSafe for $ty {}
        $crate::layer_module!($ty);
    };
    ($ty:ident, $kind:literal, pinned_fp32, params [$($p:ident),* $(; $($o:ident),*)?]) => {
        leaf_layer!(@layer $ty, $kind, true, [$($p),*], [$($($o),*)?]);
        $crate::layer_module!($ty, pinned_fp32);
    };
    (@layer $ty:ident, $kind:literal, $pinned:literal, [$($p:ident),*], [$($o:ident),*]) => {
        impl $crate::Layer for $ty {
            fn kind(&self) -> &'static str {
                $kind
            }
            fn pinned_fp32(&self) -> bool {
                $pinned
            }
            fn params(&self) -> Vec<(&'static str, &$crate::Param)> {
                #[allow(unused_mut)]
                let mut params = vec![$((stringify!($p), &self.$p)),*];
                $(params.extend(self.$o.as_ref().map(|p| (stringify!($o), p)));)*
                params
            }
            fn params_mut(&mut self) -> Vec<(&'static str, &mut $crate::Param)> {
                #[allow(unused_mut)]
                let mut params = vec![$((stringify!($p), &mut self.$p)),*];
                $(params.extend(self.$o.as_mut().map(|p| (stringify!($o), p)));)*
                params
            }
            fn precision(&self) -> $crate::LayerPrecision {
                self.precision
            }
            fn set_precision(&mut self, precision: $crate::LayerPrecision) {
                self.precision = if $pinned {
                    $crate::LayerPrecision { compute: $crate::Precision::Fp32, ..precision }
                } else {
                    precision
                };
            }
        }
    };
}

mod attention;
mod batch_norm;
mod conv;
mod conv_transpose;
mod dropout;
mod embedding;
mod group_norm;
mod layer_norm;
mod linear;
mod loss;
mod mlp;
mod rms_norm;

pub use attention::{multi_head_attention, MultiHeadAttention};
pub use batch_norm::{batch_norm, BatchNorm};
pub use candle_nn::{
    BatchNormConfig, Conv1dConfig, Conv2dConfig, ConvTranspose1dConfig, ConvTranspose2dConfig,
};
pub use conv::{conv1d, conv1d_no_bias, conv2d, conv2d_no_bias, Conv1d, Conv2d};
pub use conv_transpose::{
    conv_transpose1d, conv_transpose1d_no_bias, conv_transpose2d, conv_transpose2d_no_bias, ConvTranspose1d,
    ConvTranspose2d,
};
pub use dropout::Dropout;
pub use embedding::{embedding, Embedding};
pub use group_norm::{group_norm, GroupNorm};
pub use layer_norm::{layer_norm, LayerNorm};
pub use linear::{linear, linear_no_bias, Linear};
pub use loss::{BceWithLogitsLoss, BinaryCrossEntropyLoss, CrossEntropyLoss, MseLoss};
pub use mlp::{gelu_mlp, gelu_mlp_normed, gelu_mlp_residual};
pub use rms_norm::{rms_norm, RmsNorm};

use candle_core::{DType, Result, Tensor};

use crate::LayerPrecision;

/// Casts a layer's result to its output precision, or back to `input` when none is set.
fn cast_output(result: Tensor, precision: LayerPrecision, input: DType) -> Result<Tensor> {
    let dtype = precision.output.map_or(input, |p| p.dtype());
    result.to_dtype(dtype)
}
