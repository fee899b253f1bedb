//! Fused Adam / AdamW (PyTorch `torch.optim.Adam` / `AdamW` semantics), one memory pass.
//!
//! Per element, with `t` the step number (starting at 1):
//!
//! ```text
//! g  = grad * inv_grad_scale
//! g  = g + weight_decay * p                       (Adam, L2 mode, if weight_decay != 0)
//! p  = p * (1 - lr * weight_decay)                (AdamW, decoupled mode)
//! m  = m + (1 - beta1) * (g - m)                  (torch's lerp_)
//! v  = v * beta2 + ((1 - beta2) * g) * g          (torch's mul_ + addcmul_)
//! v' = max(v_max, v) and v_max = v'  if amsgrad, else v' = v
//! denom = sqrt(v') / sqrt(1 - beta2^t) + eps      (eps after the bias correction, as PyTorch)
//! p  = p - ((lr / (1 - beta1^t)) * m) / denom     (torch's addcdiv_)
//! working = p as f16 / bf16                       (if a working copy is given)
//! ```
//!
//! Without bias correction both `1 - beta^t` factors are 1. Memory traffic per element: read g, p, m, v
//! (and v_max); write p, m, v (and v_max, working): 28 bytes with f32 gradients and no extras.

use half::{bf16, f16};

use super::check_len;
use crate::backend::{Backend, Element};
use crate::par::{self, Kernel, Piece, Tensors};
use crate::{GradSlice, HalfSliceMut, Isa};

/// Hyper-parameters of one Adam / AdamW step (PyTorch defaults for AdamW).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamParams {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first moment (PyTorch `betas[0]`).
    pub beta1: f64,
    /// Decay of the second moment (PyTorch `betas[1]`).
    pub beta2: f64,
    /// Added to the bias-corrected root of the second moment.
    pub eps: f64,
    /// Weight decay coefficient.
    pub weight_decay: f64,
    /// `true`: AdamW, the master is multiplied by `1 - lr * weight_decay`; `false`: Adam, L2 penalty
    /// `weight_decay * p` added to the gradient.
    pub decoupled_weight_decay: bool,
    /// Use the running maximum of the second moment (each tensor then needs `max_exp_avg_sq`).
    pub amsgrad: bool,
    /// Divide the moments by `1 - beta^t` (PyTorch always does; Apex makes it optional).
    pub bias_correction: bool,
    /// Number of this step, starting at 1 (increment it only for steps that were not skipped).
    pub step: u64,
}

impl Default for AdamParams {
    fn default() -> Self {
        AdamParams {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
            decoupled_weight_decay: true,
            amsgrad: false,
            bias_correction: true,
            step: 1,
        }
    }
}

/// One parameter tensor of an Adam step: fp32 master and state, gradient, optional working copy.
/// All slices must have the master's length.
#[derive(Debug)]
pub struct AdamTensor<'a> {
    /// fp32 master weights, updated in place.
    pub master: &'a mut [f32],
    /// Gradient (still scaled by the loss scale; `inv_grad_scale` is applied inline).
    pub grad: GradSlice<'a>,
    /// First moment `m`.
    pub exp_avg: &'a mut [f32],
    /// Second moment `v`.
    pub exp_avg_sq: &'a mut [f32],
    /// Running maximum of `v`: `Some` exactly when `amsgrad`.
    pub max_exp_avg_sq: Option<&'a mut [f32]>,
    /// Half working copy, overwritten with the updated master.
    pub working: Option<HalfSliceMut<'a>>,
}

impl<'a> AdamTensor<'a> {
    /// A tensor without amsgrad state or working copy.
    pub fn new(
        master: &'a mut [f32],
        grad: GradSlice<'a>,
        exp_avg: &'a mut [f32],
        exp_avg_sq: &'a mut [f32],
    ) -> Self {
        AdamTensor { master, grad, exp_avg, exp_avg_sq, max_exp_avg_sq: None, working: None }
    }

    /// Adds the amsgrad running maximum.
    #[must_use]
    pub fn with_max_exp_avg_sq(self, max_exp_avg_sq: &'a mut [f32]) -> Self {
        AdamTensor { max_exp_avg_sq: Some(max_exp_avg_sq), ..self }
    }

    /// Adds the half working copy to refresh.
    #[must_use]
    pub fn with_working(self, working: HalfSliceMut<'a>) -> Self {
        AdamTensor { working: Some(working), ..self }
    }
}

/// Runs one fused Adam / AdamW step over all `tensors`. Runs on [`Isa::detect`].
///
/// # Panics
/// If a tensor's slices differ in length, if `max_exp_avg_sq` is present without `amsgrad` or missing
/// with it, or if `params.step == 0`.
pub fn adam_step(tensors: &mut [AdamTensor<'_>], params: &AdamParams, inv_grad_scale: f32) {
    adam_step_with(Isa::detect(), tensors, params, inv_grad_scale);
}

/// [`adam_step`] on an explicit code path.
///
/// # Panics
/// As [`adam_step`].
pub fn adam_step_with(isa: Isa, tensors: &mut [AdamTensor<'_>], params: &AdamParams, inv_grad_scale: f32) {
    assert!(params.step >= 1, "adam_step: step numbers start at 1");
    for (i, t) in tensors.iter().enumerate() {
        let n = t.master.len();
        check_len("grad", i, t.grad.len(), n);
        check_len("exp_avg", i, t.exp_avg.len(), n);
        check_len("exp_avg_sq", i, t.exp_avg_sq.len(), n);
        assert_eq!(
            t.max_exp_avg_sq.is_some(),
            params.amsgrad,
            "tensor {i}: max_exp_avg_sq must be given exactly when amsgrad is on"
        );
        if let Some(x) = &t.max_exp_avg_sq {
            check_len("max_exp_avg_sq", i, x.len(), n);
        }
        if let Some(w) = &t.working {
            check_len("working", i, w.len(), n);
        }
    }
    let kernel = Step { backend: Backend::new(isa), consts: AdamConsts::new(params, inv_grad_scale) };
    par::run(tensors, &kernel);
}

/// The per-call constants of the element formula, rounded to f32.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamConsts {
    pub(crate) inv_scale: f32,
    /// Adam's L2 mode with a non-zero weight decay.
    pub(crate) l2: bool,
    pub(crate) weight_decay: f32,
    /// `1 - lr * weight_decay` (AdamW), else exactly 1.
    pub(crate) decay: f32,
    pub(crate) one_minus_beta1: f32,
    pub(crate) beta2: f32,
    pub(crate) one_minus_beta2: f32,
    pub(crate) bias_correction2_sqrt: f32,
    pub(crate) eps: f32,
    pub(crate) step_size: f32,
}

impl AdamConsts {
    pub(crate) fn new(p: &AdamParams, inv_scale: f32) -> Self {
        let t = p.step as f64;
        let (bc1, bc2) =
            if p.bias_correction { (1.0 - p.beta1.powf(t), 1.0 - p.beta2.powf(t)) } else { (1.0, 1.0) };
        let decoupled = p.decoupled_weight_decay && p.weight_decay != 0.0;
        AdamConsts {
            inv_scale,
            l2: !p.decoupled_weight_decay && p.weight_decay != 0.0,
            weight_decay: p.weight_decay as f32,
            decay: if decoupled { (1.0 - p.lr * p.weight_decay) as f32 } else { 1.0 },
            one_minus_beta1: (1.0 - p.beta1) as f32,
            beta2: p.beta2 as f32,
            one_minus_beta2: (1.0 - p.beta2) as f32,
            bias_correction2_sqrt: bc2.sqrt() as f32,
            eps: p.eps as f32,
            step_size: (p.lr / bc1) as f32,
        }
    }
}

/// One piece of one tensor, typed: what the backends' `adam` kernels take. Equal lengths.
#[derive(Debug)]
pub(crate) struct AdamSlices<'a, G, W> {
    pub(crate) p: &'a mut [f32],
    pub(crate) g: &'a [G],
    pub(crate) m: &'a mut [f32],
    pub(crate) v: &'a mut [f32],
    pub(crate) vmax: Option<&'a mut [f32]>,
    pub(crate) w: Option<&'a mut [W]>,
}

impl<'a> Piece for AdamTensor<'a> {
    fn len(&self) -> usize {
        self.master.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (p0, p1) = self.master.split_at_mut(mid);
        let (g0, g1) = self.grad.split_at(mid);
        let (m0, m1) = self.exp_avg.split_at_mut(mid);
        let (v0, v1) = self.exp_avg_sq.split_at_mut(mid);
        let (x0, x1) = split_opt(self.max_exp_avg_sq, mid);
        let (w0, w1) = match self.working {
            Some(w) => {
                let (a, b) = w.split_at(mid);
                (Some(a), Some(b))
            }
            None => (None, None),
        };
        let t0 =
            AdamTensor { master: p0, grad: g0, exp_avg: m0, exp_avg_sq: v0, max_exp_avg_sq: x0, working: w0 };
        let t1 =
            AdamTensor { master: p1, grad: g1, exp_avg: m1, exp_avg_sq: v1, max_exp_avg_sq: x1, working: w1 };
        (t0, t1)
    }
}

/// Splits an optional slice.
pub(crate) fn split_opt(x: Option<&mut [f32]>, mid: usize) -> (Option<&mut [f32]>, Option<&mut [f32]>) {
    match x {
        Some(x) => {
            let (a, b) = x.split_at_mut(mid);
            (Some(a), Some(b))
        }
        None => (None, None),
    }
}

impl<'a> Tensors for &'a mut [AdamTensor<'_>] {
    type Piece = AdamTensor<'a>;
    type Slot = ();
    fn count(&self) -> usize {
        self.len()
    }
    fn len_of(&self, i: usize) -> usize {
        self[i].master.len()
    }
    fn split_at(self, i: usize) -> (Self, Self) {
        self.split_at_mut(i)
    }
    fn into_single(self) -> (AdamTensor<'a>, ()) {
        let t = &mut self[0];
        let piece = AdamTensor {
            master: &mut *t.master,
            grad: t.grad,
            exp_avg: &mut *t.exp_avg,
            exp_avg_sq: &mut *t.exp_avg_sq,
            max_exp_avg_sq: t.max_exp_avg_sq.as_deref_mut(),
            working: t.working.as_mut().map(HalfSliceMut::reborrow),
        };
        (piece, ())
    }
}

struct Step {
    backend: Backend,
    consts: AdamConsts,
}

fn typed<G: Element, W: Element>(backend: Backend, s: AdamSlices<'_, G, W>, c: &AdamConsts) {
    crate::backend::dispatch!(backend, optim::adam::<G, W>(s, c));
}

fn with_grad<W: Element>(backend: Backend, t: AdamTensor<'_>, w: Option<&mut [W]>, c: &AdamConsts) {
    let (p, m, v, vmax) = (t.master, t.exp_avg, t.exp_avg_sq, t.max_exp_avg_sq);
    match t.grad {
        GradSlice::F32(g) => typed::<f32, W>(backend, AdamSlices { p, g, m, v, vmax, w }, c),
        GradSlice::F16(g) => typed::<f16, W>(backend, AdamSlices { p, g, m, v, vmax, w }, c),
        GradSlice::Bf16(g) => typed::<bf16, W>(backend, AdamSlices { p, g, m, v, vmax, w }, c),
    }
}

impl<'a> Kernel<&'a mut [AdamTensor<'_>]> for Step {
    type Acc = ();
    type Out = ();

    fn leaf(&self, mut t: AdamTensor<'a>) {
        match t.working.take() {
            None => with_grad::<f32>(self.backend, t, None, &self.consts),
            Some(HalfSliceMut::F16(w)) => with_grad::<f16>(self.backend, t, Some(w), &self.consts),
            Some(HalfSliceMut::Bf16(w)) => with_grad::<bf16>(self.backend, t, Some(w), &self.consts),
        }
    }
    fn merge(&self, (): (), (): ()) {}
    fn finish(&self, _index: usize, (): (), (): ()) {}
    fn join(&self, (): (), (): ()) {}
    fn empty(&self) {}
}
