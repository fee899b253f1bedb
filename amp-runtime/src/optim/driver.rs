//! Hands the fused kernels zero-copy slices of masters, working copies and gradients, batch by batch.

use amp_kernels::{GradSlice, GradSliceMut, HalfSliceMut};
use candle_core::backprop::GradStore;
use candle_core::Tensor;

use super::params::OptimParam;
use crate::error::{Error, Result};
use crate::storage;

/// Parameters per nested batch (two tensors each at most): bounds the nesting depth.
const PARAMS_PER_BATCH: usize = 64;

/// One parameter's memory during a step.
pub(crate) struct ParamView<'a> {
    pub master: &'a mut [f32],
    pub working: Option<HalfSliceMut<'a>>,
    pub grad: GradSlice<'a>,
}

/// The parameters of `group` (all when `None`) that have a gradient in `grads`, with their gradients.
pub(crate) fn with_grads<'g>(
    params: &[OptimParam],
    group: Option<usize>,
    grads: &'g GradStore,
) -> Result<Vec<(usize, &'g Tensor)>> {
    let mut present = Vec::new();
    for (i, p) in params.iter().enumerate().filter(|(_, p)| group.is_none_or(|g| p.group == g)) {
        if let Some(grad) = p.grad(grads)? {
            present.push((i, grad));
        }
    }
    Ok(present)
}

/// Calls `f(indices, views)` for batches of the parameters in `present` (from [`with_grads`]).
pub(crate) fn for_each_batch(
    params: &[OptimParam],
    present: &[(usize, &Tensor)],
    mut f: impl FnMut(&[usize], &mut [ParamView<'_>]),
) -> Result<()> {
    let mut all: Vec<&Tensor> = present.iter().map(|(_, g)| *g).collect();
    for (i, _) in present {
        all.push(params[*i].master.as_tensor());
        all.extend(params[*i].working.as_ref().map(|w| w.as_tensor()));
    }
    storage::check_distinct(&all)?;
    let grad_tensors: Vec<&Tensor> = present.iter().map(|(_, g)| *g).collect();
    storage::with_slices(&grad_tensors, |grad_slices| {
        for (batch, chunk) in present.chunks(PARAMS_PER_BATCH).enumerate() {
            let grad_slices = &grad_slices[batch * PARAMS_PER_BATCH..];
            let indices: Vec<usize> = chunk.iter().map(|(i, _)| *i).collect();
            let mut tensors = Vec::with_capacity(2 * chunk.len());
            for &i in &indices {
                tensors.push(params[i].master.as_tensor());
                tensors.extend(params[i].working.as_ref().map(|w| w.as_tensor()));
            }
            storage::with_all_mut(&tensors, |slices| {
                let mut slices = slices.iter_mut();
                let mut views = Vec::with_capacity(indices.len());
                for (k, &i) in indices.iter().enumerate() {
                    let master = match slices.next() {
                        Some(GradSliceMut::F32(m)) => &mut **m,
                        _ => {
                            return Err(Error::NoFp32Master {
                                path: params[i].path.clone(),
                                precision: crate::Precision::Bf16,
                            })
                        }
                    };
                    let working = if params[i].working.is_some() {
                        let working = slices.next_if_working();
                        Some(
                            working
                                .ok_or_else(|| Error::Internal { what: "working copy is not half".into() })?,
                        )
                    } else {
                        None
                    };
                    views.push(ParamView { master, working, grad: grad_slices[k] });
                }
                f(&indices, &mut views);
                Ok(())
            })??;
        }
        Ok(())
    })?
}

/// Takes the next slice as a half working copy.
trait NextWorking<'s> {
    fn next_if_working(&mut self) -> Option<HalfSliceMut<'s>>;
}

impl<'s, 'x: 's> NextWorking<'s> for std::slice::IterMut<'s, GradSliceMut<'x>> {
    fn next_if_working(&mut self) -> Option<HalfSliceMut<'s>> {
        match self.next()? {
            GradSliceMut::F16(w) => Some(HalfSliceMut::F16(w)),
            GradSliceMut::Bf16(w) => Some(HalfSliceMut::Bf16(w)),
            GradSliceMut::F32(_) => None,
        }
    }
}

/// Mutable references to the items at `sorted` indices (strictly increasing).
pub(crate) fn select_mut<'a, T>(items: &'a mut [T], sorted: &[usize]) -> Vec<&'a mut T> {
    let mut wanted = sorted.iter().copied().peekable();
    items
        .iter_mut()
        .enumerate()
        .filter_map(|(i, item)| {
            if wanted.peek() == Some(&i) {
                wanted.next();
                Some(item)
            } else {
                None
            }
        })
        .collect()
}
