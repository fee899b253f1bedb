//! Losses as modules, for models that hold their loss as a field. They have no parameters, compute in
//! fp32 whatever their inputs are (see [`crate::ops::loss`]), and are pinned there: `#[amp(fp16)]` on
//! one is a compile error, like on a norm.

use candle_core::Tensor;

use crate::{Layer, LayerPrecision, Param};

macro_rules! loss_module {
    ($(#[$doc:meta])* $name:ident, $kind:literal, |$input:ident, $target:ident| $body:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Default)]
        pub struct $name {
            precision: LayerPrecision,
        }

        impl $name {
            /// The loss of `input` against `target`, an f32 scalar.
            pub fn forward(&self, $input: &Tensor, $target: &Tensor) -> crate::Result<Tensor> {
                $body
            }
        }

        impl Layer for $name {
            fn kind(&self) -> &'static str {
                $kind
            }
            fn pinned_fp32(&self) -> bool {
                true
            }
            fn params(&self) -> Vec<(&'static str, &Param)> {
                Vec::new()
            }
            fn params_mut(&mut self) -> Vec<(&'static str, &mut Param)> {
                Vec::new()
            }
            fn precision(&self) -> LayerPrecision {
                self.precision
            }
            fn set_precision(&mut self, precision: LayerPrecision) {
                self.precision = LayerPrecision { compute: crate::Precision::Fp32, ..precision };
            }
        }

        crate::layer_module!($name, pinned_fp32);
    };
}

loss_module!(
    /// Mean cross-entropy of logits `(N, C)` against class indices `(N)`.
    CrossEntropyLoss, "CrossEntropyLoss", |logits, targets| Ok(crate::ops::loss::cross_entropy(logits, targets)?)
);
loss_module!(
    /// Mean squared error.
    MseLoss, "MseLoss", |prediction, target| Ok(crate::ops::loss::mse(prediction, target)?)
);
loss_module!(
    /// Binary cross-entropy on logits, stable in every precision: the form to use with half models.
    BceWithLogitsLoss, "BceWithLogitsLoss", |logits, targets| {
        Ok(crate::ops::loss::binary_cross_entropy_with_logits(logits, targets)?)
    }
);
loss_module!(
    /// Binary cross-entropy on probabilities. Refused on half inputs at run time, and as a field with a
    /// half attribute at compile time: use [`BceWithLogitsLoss`].
    BinaryCrossEntropyLoss, "BinaryCrossEntropyLoss", |probs, targets| {
        crate::ops::loss::binary_cross_entropy(probs, targets)
    }
);
