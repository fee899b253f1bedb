//! The [`AmpModule`] trait that `#[derive(AmpModule)]` implements, and the machinery around it:
//! the static [`Plan`] and traversal with [`Visitor`]s.

mod containers;
mod plan;
mod report;
mod scaling;
mod visit;

pub use plan::{Plan, PlanField, PlanNode};
pub use report::{PlanRow, PrecisionPlan};
pub use scaling::{AskFp16, AskWide, Inherit, NoFp16Under, Request};
pub use visit::{Cursor, LayerSite, Visitor, VisitorMut};

/// A model, or part of one, whose layers carry precisions.
///
/// Implemented by `#[derive(AmpModule)]` for your structs, by the layers of [`crate::nn`], and by
/// `Vec`, `Option`, `Box` and arrays of modules. A leaf layer of your own implements [`crate::Layer`]
/// and this trait with [`crate::layer_module!`].
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an amp module",
    label = "not an `AmpModule`",
    note = "a field of a `#[derive(AmpModule)]` struct must be a module: a layer of `amp::nn`, a struct that \
            derives `AmpModule`, or a Vec/Option/Box/array of them",
    note = "if this field holds no parameters, mark it `#[amp(skip)]`; if it is a layer of your own, \
            implement `amp::Layer` and `amp::layer_module!` for it"
)]
pub trait AmpModule {
    /// The static precision plan of this type: its fields, their requested precisions and types.
    const PLAN: Plan;

    /// `Self`, named through this trait: `#[derive(AmpModule)]` checks a field's type `T` as
    /// `<T as AmpModule>::Module`, so that a type which is no module (or a container of one) gets that
    /// one error, and not a second one from the check (a half attribute's "pinned to fp32"). A leaf
    /// or a struct sets it to `Self`, a container to itself of its items' `Module`.
    #[doc(hidden)]
    type Module;

    /// True when some layer of this model is fixed to fp16 (or `half`, which is fp16 on CUDA) by its
    /// attributes, through any depth of nesting: training it needs a loss scaler. Computed at compile time.
    const NEEDS_LOSS_SCALING: bool = Self::PLAN.needs_loss_scaling();

    /// Visits every layer with its dotted path and requested precision.
    fn visit(&self, cursor: &mut Cursor, visitor: &mut dyn Visitor);

    /// Visits every layer mutably with its dotted path and requested precision.
    fn visit_mut(&mut self, cursor: &mut Cursor, visitor: &mut dyn VisitorMut);
}

/// Marker for modules whose computation is accurate in half precision (matmul-class layers, embeddings,
/// composite modules). Norms, softmax and losses do not implement it: they reduce, and reductions in half
/// lose precision, so `#[amp(fp16)]`, `#[amp(bf16)]` or `#[amp(half)]` on them is a compile error.
#[diagnostic::on_unimplemented(
    message = "`{Self}` must compute in fp32 and cannot take a half precision",
    label = "this layer is pinned to fp32",
    note = "norms, softmax and losses reduce over many values; in fp16 or bf16 those sums lose precision \
            or overflow, so amp keeps them in fp32 (as Apex and torch.autocast do)",
    note = "write `#[amp(fp32)]` on this field, or remove the attribute: the layer then stays fp32 \
            whatever its parent's default is (for binary cross-entropy on half outputs, use the logits \
            form, `BceWithLogitsLoss`)"
)]
pub trait HalfSafe {}

/// Walks every layer of `module` with a closure.
pub(crate) fn for_each_layer<M: AmpModule + ?Sized>(
    module: &M,
    mut f: impl FnMut(LayerSite<'_>, &dyn crate::Layer),
) {
    module.visit(&mut Cursor::new(), &mut |site: LayerSite<'_>, layer: &dyn crate::Layer| f(site, layer));
}

/// Calls `f(site, layer, name, param)` for every parameter of `module` once, where it is found first:
/// a parameter that several layers share (tied weights, one master) is visited at its first site only.
/// Builds no path: steps call it per parameter.
pub(crate) fn for_each_unique_param<M: AmpModule + ?Sized>(
    module: &M,
    mut f: impl FnMut(LayerSite<'_>, &dyn crate::Layer, &'static str, &crate::Param),
) {
    let mut seen = std::collections::HashSet::new();
    for_each_layer(module, |site, layer| {
        for (name, param) in layer.params() {
            if seen.insert(param.master().as_tensor().id()) {
                f(site, layer, name, param);
            }
        }
    });
}

/// Operations every [`AmpModule`] gets: its precision plan and its parameters by path.
pub trait AmpModuleExt: AmpModule {
    /// The plan of this instance: every layer's path, type, compute precision, parameter count and
    /// bytes at fp32 vs as stored. Print it to see it as a table.
    fn precision_plan(&self) -> PrecisionPlan {
        let mut plan = PrecisionPlan::default();
        for_each_layer(self, |site, layer| plan.rows.push(PlanRow::of(site, layer)));
        plan
    }

    /// Every parameter with its dotted path (`blocks.0.fc.weight`), in declaration order.
    fn named_params(&self) -> Vec<(String, crate::Param)> {
        let mut out = Vec::new();
        for_each_layer(self, |site, layer| {
            for (name, param) in layer.params() {
                out.push((site.param_path(name), param.clone()));
            }
        });
        out
    }

    /// Every parameter once, at the first path it is found at: a parameter that several layers share
    /// (tied weights) appears once, where [`named_params`](Self::named_params) lists it under each
    /// path. What steps and collectives iterate over, so that a shared parameter is unscaled, reduced
    /// and updated once.
    fn unique_params(&self) -> Vec<(String, crate::Param)> {
        let mut out = Vec::new();
        for_each_unique_param(self, |site, _, name, param| out.push((site.param_path(name), param.clone())));
        out
    }

    /// Every non-trainable buffer (BatchNorm running statistics) with its dotted path.
    fn named_buffers(&self) -> Vec<(String, candle_core::Var)> {
        let mut out = Vec::new();
        for_each_layer(self, |site, layer| {
            for (name, buffer) in layer.buffers() {
                out.push((site.param_path(name), buffer.clone()));
            }
        });
        out
    }

    /// The trainable variables (half working copies under O2). `backward` produces gradients for them,
    /// except for products on amp's CPU GEMM under `GradientRoute::Master`, whose weight gradients go
    /// to the masters: read a parameter's gradient with `Param::grad`.
    /// A shared parameter (tied weights) is listed once.
    fn trainable_vars(&self) -> Vec<candle_core::Var> {
        self.unique_params().into_iter().map(|(_, p)| p.trainable().clone()).collect()
    }

    /// The fp32 source-of-truth variables (the masters under O2), a shared parameter once: what a
    /// candle optimizer steps.
    fn master_vars(&self) -> Vec<candle_core::Var> {
        self.unique_params().into_iter().map(|(_, p)| p.master().clone()).collect()
    }
}

impl<M: AmpModule + ?Sized> AmpModuleExt for M {}
