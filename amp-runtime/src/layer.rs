//! The [`Layer`] trait: a leaf of the module tree, with parameters and a precision.

use crate::param::Param;
use crate::Precision;

/// The precisions a layer computes and returns in, set by `amp::initialize` from the attributes and the
/// optimisation level.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LayerPrecision {
    /// The dtype of the layer's arithmetic (its input and weights are cast to it).
    pub compute: Precision,
    /// The dtype the layer returns; `None` returns the input's dtype.
    pub output: Option<Precision>,
}

impl LayerPrecision {
    /// fp32 compute, output in the input's dtype: what every layer starts as.
    pub const FP32: LayerPrecision = LayerPrecision { compute: Precision::Fp32, output: None };
}

impl Default for LayerPrecision {
    fn default() -> Self {
        LayerPrecision::FP32
    }
}

/// A leaf layer: owns parameters and computes in one precision.
///
/// Layers of your own implement this and [`crate::AmpModule`] (with [`crate::layer_module!`]); those whose
/// arithmetic is safe in half precision also implement [`crate::HalfSafe`].
pub trait Layer {
    /// A short name of the layer type for plans and logs (`"Linear"`).
    fn kind(&self) -> &'static str;

    /// True when the layer must compute in fp32 whatever it is asked (norms, softmax, losses).
    fn pinned_fp32(&self) -> bool;

    /// The parameters, with their names under the layer (`"weight"`, `"bias"`), in a fixed order.
    fn params(&self) -> Vec<(&'static str, &Param)>;

    /// The parameters, mutably.
    fn params_mut(&mut self) -> Vec<(&'static str, &mut Param)>;

    /// The layer's precisions.
    fn precision(&self) -> LayerPrecision;

    /// Sets the layer's precisions (pinned layers keep fp32 compute whatever is passed).
    fn set_precision(&mut self, precision: LayerPrecision);

    /// Non-trainable fp32 state saved in checkpoints beside the parameters (BatchNorm's running
    /// statistics). Optimizers and `amp::initialize` never touch it.
    fn buffers(&self) -> Vec<(&'static str, &candle_core::Var)> {
        Vec::new()
    }

    /// True when the parameters' storage cannot change after construction (tensors a candle model
    /// received from [`crate::varmap::AmpVarMap`]): `amp::initialize` then refuses to convert them.
    fn storage_fixed(&self) -> bool {
        false
    }

    /// True when the parameter named `param` should not be weight-decayed: biases, and every parameter
    /// of a layer pinned to fp32 (norms). Layers with other conventions override it.
    fn no_weight_decay(&self, param: &str) -> bool {
        param == "bias" || self.pinned_fp32()
    }
}

/// Implements [`crate::AmpModule`] for a leaf [`Layer`] type.
///
/// ```ignore
/// amp::layer_module!(MyLayer);                    // half-capable leaf
/// amp::layer_module!(MyNorm, pinned_fp32);        // always fp32
/// ```
#[macro_export]
macro_rules! layer_module {
    ($ty:ty) => {
        $crate::layer_module!(@impl $ty, false);
        #[diagnostic::do_not_recommend]
        impl $crate::NoFp16Under<$crate::Inherit> for $ty {}
        #[diagnostic::do_not_recommend]
        impl $crate::NoFp16Under<$crate::AskWide> for $ty {}
    };
    ($ty:ty, pinned_fp32) => {
        $crate::layer_module!(@impl $ty, true);
        #[diagnostic::do_not_recommend]
        impl<R: $crate::Request> $crate::NoFp16Under<R> for $ty {}
    };
    (@impl $ty:ty, $pinned:literal) => {
        #[diagnostic::do_not_recommend]
        impl $crate::AmpModule for $ty {
            type Module = Self;
            const PLAN: $crate::Plan = $crate::Plan {
                type_name: ::core::stringify!($ty),
                node: $crate::PlanNode::Layer { pinned_fp32: $pinned },
            };

            fn visit(&self, cursor: &mut $crate::Cursor, visitor: &mut dyn $crate::Visitor) {
                visitor.visit_layer(cursor.site(), self);
            }

            fn visit_mut(&mut self, cursor: &mut $crate::Cursor, visitor: &mut dyn $crate::VisitorMut) {
                visitor.visit_layer_mut(cursor.site(), self);
            }
        }
    };
}
