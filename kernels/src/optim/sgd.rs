//! Fused SGD with momentum (PyTorch `torch.optim.SGD` semantics), one memory pass.
//!
//! Per element:
//!
//! ```text
//! d = grad * inv_grad_scale
//! d = d + weight_decay * p                         (if weight_decay != 0)
//! if momentum != 0:
//!     b = d                                        (first step: the buffer starts as the gradient)
//!     b = b * momentum + (1 - dampening) * d       (later steps)
//!     d = d + momentum * b  if nesterov, else  d = b
//! p = p - lr * d
//! working = p as f16 / bf16                        (if a working copy is given)
//! ```

use half::{bf16, f16};

use super::adam::split_opt;
use super::check_len;
use crate::backend::{Backend, Element};
use crate::par::{self, Kernel, Piece, Tensors};
use crate::{GradSlice, HalfSliceMut, Isa};

/// Hyper-parameters of one SGD step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdParams {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor; 0 disables the momentum buffer.
    pub momentum: f64,
    /// Dampening of the gradient's contribution to the momentum buffer.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`, as PyTorch).
    pub nesterov: bool,
    /// The momentum buffers hold no history yet (PyTorch's "buffer is None"): they are set to the
    /// gradient instead of blended. True for the first non-skipped step.
    pub first_step: bool,
}

impl Default for SgdParams {
    fn default() -> Self {
        SgdParams {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            first_step: true,
        }
    }
}

/// One parameter tensor of an SGD step. All slices must have the master's length.
#[derive(Debug)]
pub struct SgdTensor<'a> {
    /// fp32 master weights, updated in place.
    pub master: &'a mut [f32],
    /// Gradient (still scaled; `inv_grad_scale` is applied inline).
    pub grad: GradSlice<'a>,
    /// Momentum buffer: `Some` exactly when `momentum != 0`.
    pub momentum_buffer: Option<&'a mut [f32]>,
    /// Half working copy, overwritten with the updated master.
    pub working: Option<HalfSliceMut<'a>>,
}

/// Runs one fused SGD step over all `tensors`. Runs on [`Isa::detect`].
///
/// # Panics
/// If a tensor's slices differ in length, if `momentum_buffer` is present without momentum or missing
/// with it, or if nesterov is asked without momentum or with dampening.
pub fn sgd_step(tensors: &mut [SgdTensor<'_>], params: &SgdParams, inv_grad_scale: f32) {
    sgd_step_with(Isa::detect(), tensors, params, inv_grad_scale);
}

/// [`sgd_step`] on an explicit code path.
///
/// # Panics
/// As [`sgd_step`].
pub fn sgd_step_with(isa: Isa, tensors: &mut [SgdTensor<'_>], params: &SgdParams, inv_grad_scale: f32) {
    assert!(
        !params.nesterov || (params.momentum > 0.0 && params.dampening == 0.0),
        "sgd_step: nesterov momentum requires momentum > 0 and zero dampening"
    );
    for (i, t) in tensors.iter().enumerate() {
        let n = t.master.len();
        check_len("grad", i, t.grad.len(), n);
        assert_eq!(
            t.momentum_buffer.is_some(),
            params.momentum != 0.0,
            "tensor {i}: momentum_buffer must be given exactly when momentum != 0"
        );
        if let Some(b) = &t.momentum_buffer {
            check_len("momentum_buffer", i, b.len(), n);
        }
        if let Some(w) = &t.working {
            check_len("working", i, w.len(), n);
        }
    }
    let kernel = Step { backend: Backend::new(isa), consts: SgdConsts::new(params, inv_grad_scale) };
    par::run(tensors, &kernel);
}

/// The per-call constants of the element formula, rounded to f32.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SgdConsts {
    pub(crate) inv_scale: f32,
    /// A non-zero weight decay.
    pub(crate) l2: bool,
    pub(crate) weight_decay: f32,
    /// A non-zero momentum.
    pub(crate) has_momentum: bool,
    /// Set the buffer to `d` instead of blending.
    pub(crate) first: bool,
    pub(crate) momentum: f32,
    pub(crate) one_minus_dampening: f32,
    pub(crate) nesterov: bool,
    pub(crate) lr: f32,
}

impl SgdConsts {
    pub(crate) fn new(p: &SgdParams, inv_scale: f32) -> Self {
        SgdConsts {
            inv_scale,
            l2: p.weight_decay != 0.0,
            weight_decay: p.weight_decay as f32,
            has_momentum: p.momentum != 0.0,
            first: p.first_step,
            momentum: p.momentum as f32,
            one_minus_dampening: (1.0 - p.dampening) as f32,
            nesterov: p.nesterov,
            lr: p.lr as f32,
        }
    }
}

/// One piece of one tensor, typed. Equal lengths; `buf` is `Some` iff `has_momentum`.
#[derive(Debug)]
pub(crate) struct SgdSlices<'a, G, W> {
    pub(crate) p: &'a mut [f32],
    pub(crate) g: &'a [G],
    pub(crate) buf: Option<&'a mut [f32]>,
    pub(crate) w: Option<&'a mut [W]>,
}

impl Piece for SgdTensor<'_> {
    fn len(&self) -> usize {
        self.master.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (p0, p1) = self.master.split_at_mut(mid);
        let (g0, g1) = self.grad.split_at(mid);
        let (b0, b1) = split_opt(self.momentum_buffer, mid);
        let (w0, w1) = match self.working {
            Some(w) => {
                let (a, b) = w.split_at(mid);
                (Some(a), Some(b))
            }
            None => (None, None),
        };
        let t0 = SgdTensor { master: p0, grad: g0, momentum_buffer: b0, working: w0 };
        (t0, SgdTensor { master: p1, grad: g1, momentum_buffer: b1, working: w1 })
    }
}

impl<'a> Tensors for &'a mut [SgdTensor<'_>] {
    type Piece = SgdTensor<'a>;
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
    fn into_single(self) -> (SgdTensor<'a>, ()) {
        let t = &mut self[0];
        let piece = SgdTensor {
            master: &mut *t.master,
            grad: t.grad,
            momentum_buffer: t.momentum_buffer.as_deref_mut(),
            working: t.working.as_mut().map(HalfSliceMut::reborrow),
        };
        (piece, ())
    }
}

struct Step {
    backend: Backend,
    consts: SgdConsts,
}

fn typed<G: Element, W: Element>(backend: Backend, s: SgdSlices<'_, G, W>, c: &SgdConsts) {
    crate::backend::dispatch!(backend, optim::sgd::<G, W>(s, c));
}

fn with_grad<W: Element>(backend: Backend, t: SgdTensor<'_>, w: Option<&mut [W]>, c: &SgdConsts) {
    let (p, buf) = (t.master, t.momentum_buffer);
    match t.grad {
        GradSlice::F32(g) => typed::<f32, W>(backend, SgdSlices { p, g, buf, w }, c),
        GradSlice::F16(g) => typed::<f16, W>(backend, SgdSlices { p, g, buf, w }, c),
        GradSlice::Bf16(g) => typed::<bf16, W>(backend, SgdSlices { p, g, buf, w }, c),
    }
}

impl<'a> Kernel<&'a mut [SgdTensor<'_>]> for Step {
    type Acc = ();
    type Out = ();

    fn leaf(&self, mut t: SgdTensor<'a>) {
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
