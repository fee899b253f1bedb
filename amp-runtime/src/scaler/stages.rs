//! What a step does between the fixed stages of its protocol: nothing on one process; on the ranks of a
//! data-parallel group, the gradient all-reduce after backward and one agreed verdict.
//!
//! [`GradScaler::step_fused`](super::GradScaler::step_fused) runs the protocol with [`OneProcess`];
//! [`DataParallel::step_fused`](crate::distributed::DataParallel::step_fused) runs the same protocol
//! with its own stages, so there is one implementation of the step, not one per setting.

use candle_core::backprop::GradStore;
use candle_core::Tensor;

use super::SkipReason;
use crate::error::Result;

/// What this rank found during a step, for the verdict.
#[derive(Debug)]
pub(crate) struct Findings {
    /// The loss was finite here.
    pub loss_finite: bool,
    /// The first parameter whose gradient held inf/NaN here before any reduction (data-parallel only).
    pub own: Option<String>,
    /// The first parameter whose gradient, as the optimizer would read it, holds inf/NaN (or a note
    /// that the global norm overflows).
    pub reduced: Option<String>,
}

/// The stages a step protocol calls.
pub(crate) trait StepStages {
    /// True when a rank must not leave the protocol on its own (its peers wait for its gradients), so a
    /// non-finite loss still runs backward and goes to [`verdict`](Self::verdict).
    fn collective(&self) -> bool;

    /// Right after backward: adds the two gradients of each parameter read both as its working copy
    /// and as its master, for the parameters this stage reads beyond the optimizer's own (which the
    /// protocol folds itself).
    fn fold_split_gradients(&self, _grads: &mut GradStore) -> Result<()> {
        Ok(())
    }

    /// Called with the gradients after backward, before they are checked (`grads`: every gradient of
    /// the backward pass; `present`: those of the optimizer's parameters, `path(i)` naming
    /// `present[i]`'s parameter): returns the parameter whose gradient held inf/NaN as computed here
    /// (if this stage looks), then reduces the gradients the optimizer reads, in place.
    fn reduce<'p>(
        &mut self,
        grads: &GradStore,
        present: &[&Tensor],
        path: &dyn Fn(usize) -> &'p str,
    ) -> Result<Option<String>>;

    /// The global gradient norm from this rank's norm of `present` (the identity unless the optimizer
    /// holds only a shard of the parameters).
    fn global_norm(&mut self, local: f32) -> Result<f32> {
        Ok(local)
    }

    /// The skip reason every rank takes, from this rank's findings (`None`: apply the step).
    fn verdict(&mut self, findings: Findings) -> Result<Option<SkipReason>>;

    /// Called after the optimizer stepped (not after a skipped step): where each rank stepped only its
    /// shard, the updated parameters are exchanged here.
    fn after_step(&mut self) -> Result<()> {
        Ok(())
    }
}

/// One process alone: no reduction, its own verdict.
#[derive(Debug)]
pub(crate) struct OneProcess;

impl StepStages for OneProcess {
    fn collective(&self) -> bool {
        false
    }

    fn reduce<'p>(
        &mut self,
        _: &GradStore,
        _: &[&Tensor],
        _: &dyn Fn(usize) -> &'p str,
    ) -> Result<Option<String>> {
        Ok(None)
    }

    fn verdict(&mut self, findings: Findings) -> Result<Option<SkipReason>> {
        if !findings.loss_finite {
            return Ok(Some(SkipReason::NonFiniteLoss));
        }
        Ok(findings.reduced.map(|param| SkipReason::GradientOverflow { param }))
    }
}
