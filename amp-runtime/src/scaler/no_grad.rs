//! The first step's check that every trainable parameter received a gradient.
//!
//! candle drops gradients without a word where an op has no backward: candle-nn's fused `layer_norm`
//! and `rms_norm` (which `candle_nn::LayerNorm` with a bias and `candle_nn::RmsNorm` run on contiguous
//! inputs), `softmax_last_dim` and the `rotary_emb::rope*` kernels. A model using them trains on, with
//! the parameters at and before such an op never changing. The scaler looks once, on its first step,
//! and names each parameter without a gradient with the likely cause.

use std::fmt;

use candle_core::backprop::GradStore;

use crate::error::{Error, Result};

/// What a scaler's first step does about trainable parameters that received no gradient.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MissingGradients {
    /// Fail with [`Error::NoGradient`], changing nothing (the default): the model is silently not
    /// training those parameters.
    #[default]
    Error,
    /// Log a warning naming them and train the rest: for parameters frozen on purpose.
    Warn,
}

/// Why a parameter probably received no gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LikelyCause {
    /// No parameter received one: the loss does not depend on the optimizer's parameters.
    LossDetached,
    /// A norm's parameter in a model of candle-nn layers: its fused kernel has no backward.
    CandleFusedNorm,
    /// No path from the loss: unused in forward, behind an op without backward, or detached.
    NoPathFromLoss,
}

impl fmt::Display for LikelyCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LikelyCause::LossDetached => {
                "no parameter got a gradient: the loss does not depend on the optimizer's parameters (a \
                 `.detach()`, or a forward pass over other variables than these)"
            }
            LikelyCause::CandleFusedNorm => {
                "a norm's parameter: candle-nn's `LayerNorm` (with a bias) and `RmsNorm` run fused kernels \
                 on contiguous inputs that have no backward, so neither this parameter nor anything before \
                 the norm gets a gradient (candle issue #3011); amp::nn's norms are differentiable"
            }
            LikelyCause::NoPathFromLoss => {
                "no path from the loss to it: unused in forward, detached, or behind an op without \
                 backward (candle-nn's fused layer_norm, rms_norm, softmax_last_dim, rotary_emb::rope; \
                 amp::nn's norms, amp::ops::softmax and amp::ops::rope are differentiable)"
            }
        })
    }
}

/// One parameter without a gradient.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NoGradient {
    /// The parameter's path.
    pub path: String,
    /// Why, probably.
    pub cause: LikelyCause,
}

/// Every parameter that received no gradient, one per line when displayed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NoGradients(pub Vec<NoGradient>);

impl NoGradients {
    /// The parameters' paths.
    pub fn paths(&self) -> Vec<&str> {
        self.0.iter().map(|p| p.path.as_str()).collect()
    }
}

impl fmt::Display for NoGradients {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for missing in &self.0 {
            write!(f, "\n  - `{}`: {}", missing.path, missing.cause)?;
        }
        Ok(())
    }
}

/// A parameter as the check sees it: path, layer kind, the variables backward should have reached
/// (either: the trainable variable, or its master when a product on amp's GEMM read that).
pub(crate) struct Checked<'a> {
    pub path: &'a str,
    pub kind: &'a str,
    pub trainable: &'a candle_core::Tensor,
    pub master: &'a candle_core::Tensor,
}

impl Checked<'_> {
    /// Whether backward reached the parameter.
    pub(crate) fn reached(&self, grads: &GradStore) -> bool {
        grads.get(self.trainable).is_some() || grads.get(self.master).is_some()
    }
}

/// Parameters of `params` without a gradient in `grads`, each with its likely cause.
pub(crate) fn find<'a>(params: impl IntoIterator<Item = Checked<'a>>, grads: &GradStore) -> NoGradients {
    let mut total = 0;
    let mut missing: Vec<(&str, &str)> = Vec::new();
    for param in params {
        total += 1;
        if !param.reached(grads) {
            missing.push((param.path, param.kind));
        }
    }
    let all = total > 0 && missing.len() == total;
    NoGradients(
        missing
            .into_iter()
            .map(|(path, kind)| NoGradient { path: path.to_string(), cause: cause(path, kind, all) })
            .collect(),
    )
}

fn cause(path: &str, kind: &str, all_missing: bool) -> LikelyCause {
    // Tensors from a candle-nn model ("Tensor" from an AmpVarMap, "Var" from a VarMap) named like a norm.
    let candle_layer = kind == "Tensor" || kind == "Var";
    let lower = path.to_ascii_lowercase();
    let norm_named =
        lower.contains("norm") || lower.split('.').any(|s| s.starts_with("ln") || s.ends_with("_ln"));
    if all_missing {
        LikelyCause::LossDetached
    } else if candle_layer && norm_named {
        LikelyCause::CandleFusedNorm
    } else {
        LikelyCause::NoPathFromLoss
    }
}

/// Applies `policy` to what [`find`] found: an error, or a warning and `Ok`.
pub(crate) fn enforce(found: NoGradients, policy: MissingGradients) -> Result<()> {
    if found.0.is_empty() {
        return Ok(());
    }
    match policy {
        MissingGradients::Error => Err(Error::NoGradient { params: found }),
        MissingGradients::Warn => {
            tracing::warn!(
                "{} trainable parameter(s) received no gradient and will not train:{found}",
                found.0.len()
            );
            Ok(())
        }
    }
}

/// A model's parameter, owned, for [`find`].
pub(crate) struct ModelParam {
    path: String,
    kind: &'static str,
    trainable: candle_core::Var,
    master: candle_core::Var,
}

impl ModelParam {
    pub fn checked(&self) -> Checked<'_> {
        Checked {
            path: &self.path,
            kind: self.kind,
            trainable: self.trainable.as_tensor(),
            master: self.master.as_tensor(),
        }
    }
}

/// Every parameter of `model` with its layer's kind.
pub(crate) fn model_params<M: crate::AmpModule + ?Sized>(model: &M) -> Vec<ModelParam> {
    let mut out = Vec::new();
    model.visit(&mut crate::Cursor::new(), &mut |site: crate::LayerSite<'_>, layer: &dyn crate::Layer| {
        for (name, param) in layer.params() {
            let (trainable, master) = (param.trainable().clone(), param.master().clone());
            out.push(ModelParam { path: site.param_path(name), kind: layer.kind(), trainable, master });
        }
    });
    out
}
