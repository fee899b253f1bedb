//! Fused LAMB (Apex `FusedLAMB` semantics, the LAMB paper's layer-wise trust ratio), two passes.
//!
//! Pass 1 updates the moments and measures, per tensor, `||p||` and `||u||` of the update `u`:
//!
//! ```text
//! g = grad * inv_grad_scale
//! g = g + weight_decay * p                          (L2 mode only)
//! m = m * beta1 + beta3 * g                         (beta3 = 1 - beta1 with grad averaging, else 1)
//! v = v * beta2 + ((1 - beta2) * g) * g
//! u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
//! u = u + weight_decay * p                          (decoupled mode, the default)
//! ```
//!
//! Pass 2 recomputes `u` from the stored moments (the same f32 operations, so the same bits) and applies
//! `p = p - ratio * u` with `ratio = lr * ||p|| / ||u||`, or `lr` when either norm is 0 or when the tensor
//! is not adapted (Apex adapts only with a non-zero weight decay unless `always_adapt`, its `use_nvlamb`).
//! The working copy is written in pass 2.
//!
//! Traffic per element (f32 gradient): pass 1 reads g, p, m, v and writes m, v (24 B); pass 2 reads p, m,
//! v and writes p (16 B): 40 B against Adam's 28. Norms are f64 sums as in [`crate::norm`], rounded to
//! f32; the ratio is computed in f32, as Apex. No allocation: the caller passes the per-tensor norms.
//!
//! With the moments in bf16 ([`lamb_step_bf16_state`](super::lamb_step_bf16_state)) pass 1 rounds them stochastically when it
//! stores them and computes `u` from the values stored, so pass 2's `u` is the one measured: 16 B and
//! 12 B, 28 B per element in all.

use half::{bf16, f16};

use super::adam_bf16::step_key;
use super::check_len;
use super::offset::Offset;
use crate::backend::{dispatch, Backend, Element, Moment};
use crate::par::{self, Kernel, Piece, Tensors};
use crate::stochastic::block_key;
use crate::{GradSlice, HalfSliceMut, Isa};

/// Hyper-parameters of one LAMB step (Apex `FusedLAMB` defaults).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LambParams {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the bias-corrected root of the second moment.
    pub eps: f64,
    /// Weight decay coefficient.
    pub weight_decay: f64,
    /// `true` (Apex `adam_w_mode`): decay added to the update; `false`: L2 penalty added to the gradient.
    pub decoupled_weight_decay: bool,
    /// Divide the moments by `1 - beta^t`.
    pub bias_correction: bool,
    /// Scale the gradient's contribution to `m` by `1 - beta1` (else by 1).
    pub grad_averaging: bool,
    /// Apply the trust ratio even with zero weight decay (Apex `use_nvlamb`).
    pub always_adapt: bool,
    /// Number of this step, starting at 1.
    pub step: u64,
}

impl Default for LambParams {
    fn default() -> Self {
        LambParams {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-6,
            weight_decay: 0.01,
            decoupled_weight_decay: true,
            bias_correction: true,
            grad_averaging: true,
            always_adapt: false,
            step: 1,
        }
    }
}

/// One parameter tensor of a LAMB step. All slices must have the master's length.
#[derive(Debug)]
pub struct LambTensor<'a> {
    /// fp32 master weights, updated in place.
    pub master: &'a mut [f32],
    /// Gradient (still scaled; `inv_grad_scale` is applied inline).
    pub grad: GradSlice<'a>,
    /// First moment `m`.
    pub exp_avg: &'a mut [f32],
    /// Second moment `v`.
    pub exp_avg_sq: &'a mut [f32],
    /// Half working copy, overwritten with the updated master.
    pub working: Option<HalfSliceMut<'a>>,
}

/// Norms measured by pass 1 of [`lamb_step`] for one tensor (left in the caller's buffer for logging).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TensorNorms {
    /// `||p||` of the master before the step.
    pub param: f32,
    /// `||u||` of the update before the trust ratio.
    pub update: f32,
}

/// Runs one LAMB step over all `tensors`; `norms` (one per tensor) is scratch that ends holding the
/// norms each tensor's trust ratio used. Runs on [`Isa::detect`].
///
/// # Panics
/// If `norms.len() != tensors.len()`, if a tensor's slices differ in length, or if `params.step == 0`.
pub fn lamb_step(
    tensors: &mut [LambTensor<'_>],
    params: &LambParams,
    inv_grad_scale: f32,
    norms: &mut [TensorNorms],
) {
    lamb_step_with(Isa::detect(), tensors, params, inv_grad_scale, norms);
}

/// [`lamb_step`] on an explicit code path.
///
/// # Panics
/// As [`lamb_step`].
pub fn lamb_step_with(
    isa: Isa,
    tensors: &mut [LambTensor<'_>],
    params: &LambParams,
    inv_grad_scale: f32,
    norms: &mut [TensorNorms],
) {
    run(isa, tensors, params, inv_grad_scale, norms);
}

/// Both passes over `tensors`, whatever their moments' dtype.
pub(super) fn run<T: StepTensor>(
    isa: Isa,
    tensors: &mut [T],
    params: &LambParams,
    inv_grad_scale: f32,
    norms: &mut [TensorNorms],
) {
    assert!(params.step >= 1, "lamb_step: step numbers start at 1");
    assert_eq!(norms.len(), tensors.len(), "lamb_step: one TensorNorms per tensor");
    for (i, t) in tensors.iter().enumerate() {
        t.check_lengths(i);
    }
    let backend = Backend::new(isa);
    let consts = LambConsts::new(params, inv_grad_scale);
    let moments = Moments { backend, consts, step: params.step };
    par::run(Pass1 { tensors: &mut *tensors, norms: &mut *norms }, &moments);
    let adapt = params.always_adapt || params.weight_decay != 0.0;
    par::run(Pass2 { tensors, norms, lr: params.lr as f32, adapt }, &Apply { backend, consts });
}

/// A tensor of a LAMB step, whatever its moments' dtype: the two passes' views of it.
pub(super) trait StepTensor: Send {
    /// The moments' element type.
    type Moment: Moment;
    /// Elements.
    fn len(&self) -> usize;
    /// Panics unless its slices have the master's length (`index`: its place in the call).
    fn check_lengths(&self, index: usize);
    /// Pass 1's view of the whole tensor.
    fn moments(&mut self) -> MomentsPiece<'_, Self::Moment>;
    /// Pass 2's view of the whole tensor, with its trust ratio.
    fn apply(&mut self, ratio: f32) -> ApplyPiece<'_, Self::Moment>;
}

/// Panics unless the gradient, both moments and the working copy have the master's length `n`.
pub(super) fn check_lengths(
    index: usize,
    n: usize,
    grad: usize,
    moments: [usize; 2],
    working: Option<usize>,
) {
    check_len("grad", index, grad, n);
    check_len("exp_avg", index, moments[0], n);
    check_len("exp_avg_sq", index, moments[1], n);
    if let Some(w) = working {
        check_len("working", index, w, n);
    }
}

impl StepTensor for LambTensor<'_> {
    type Moment = f32;
    fn len(&self) -> usize {
        self.master.len()
    }
    fn check_lengths(&self, index: usize) {
        let moments = [self.exp_avg.len(), self.exp_avg_sq.len()];
        let working = self.working.as_ref().map(HalfSliceMut::len);
        check_lengths(index, self.master.len(), self.grad.len(), moments, working);
    }
    fn moments(&mut self) -> MomentsPiece<'_, f32> {
        MomentsPiece {
            p: &*self.master,
            g: self.grad,
            m: &mut *self.exp_avg,
            v: &mut *self.exp_avg_sq,
            stream: 0,
        }
    }
    fn apply(&mut self, ratio: f32) -> ApplyPiece<'_, f32> {
        let w = self.working.as_mut().map(HalfSliceMut::reborrow);
        ApplyPiece { p: &mut *self.master, m: &*self.exp_avg, v: &*self.exp_avg_sq, w, ratio }
    }
}

/// The trust ratio of one tensor (f32, as Apex).
pub(crate) fn trust_ratio(lr: f32, adapt: bool, norms: TensorNorms) -> f32 {
    if adapt && norms.param != 0.0 && norms.update != 0.0 {
        lr * (norms.param / norms.update)
    } else {
        lr
    }
}

/// The per-call constants of the element formulas, rounded to f32.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LambConsts {
    pub(crate) inv_scale: f32,
    /// L2 mode with a non-zero weight decay.
    pub(crate) l2: bool,
    /// Decoupled mode with a non-zero weight decay.
    pub(crate) decoupled: bool,
    pub(crate) weight_decay: f32,
    pub(crate) beta1: f32,
    pub(crate) beta3: f32,
    pub(crate) beta2: f32,
    pub(crate) one_minus_beta2: f32,
    pub(crate) bias_correction1: f32,
    pub(crate) bias_correction2: f32,
    pub(crate) eps: f32,
}

impl LambConsts {
    pub(crate) fn new(p: &LambParams, inv_scale: f32) -> Self {
        let t = p.step as f64;
        let (bc1, bc2) =
            if p.bias_correction { (1.0 - p.beta1.powf(t), 1.0 - p.beta2.powf(t)) } else { (1.0, 1.0) };
        LambConsts {
            inv_scale,
            l2: !p.decoupled_weight_decay && p.weight_decay != 0.0,
            decoupled: p.decoupled_weight_decay && p.weight_decay != 0.0,
            weight_decay: p.weight_decay as f32,
            beta1: p.beta1 as f32,
            beta3: if p.grad_averaging { (1.0 - p.beta1) as f32 } else { 1.0 },
            beta2: p.beta2 as f32,
            one_minus_beta2: (1.0 - p.beta2) as f32,
            bias_correction1: bc1 as f32,
            bias_correction2: bc2 as f32,
            eps: p.eps as f32,
        }
    }
}

/// Pass 1 work on one piece of one tensor.
pub(super) struct MomentsPiece<'a, M> {
    pub(super) p: &'a [f32],
    pub(super) g: GradSlice<'a>,
    pub(super) m: &'a mut [M],
    pub(super) v: &'a mut [M],
    /// The tensor's random stream (bf16 moments).
    pub(super) stream: u64,
}

/// Pass 2 work on one piece of one tensor, with the tensor's trust ratio.
pub(super) struct ApplyPiece<'a, M> {
    pub(super) p: &'a mut [f32],
    pub(super) m: &'a [M],
    pub(super) v: &'a [M],
    pub(super) w: Option<HalfSliceMut<'a>>,
    pub(super) ratio: f32,
}

impl<M: Send> Piece for MomentsPiece<'_, M> {
    fn len(&self) -> usize {
        self.p.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (p0, p1) = self.p.split_at(mid);
        let (g0, g1) = self.g.split_at(mid);
        let (m0, m1) = self.m.split_at_mut(mid);
        let (v0, v1) = self.v.split_at_mut(mid);
        let stream = self.stream;
        (
            MomentsPiece { p: p0, g: g0, m: m0, v: v0, stream },
            MomentsPiece { p: p1, g: g1, m: m1, v: v1, stream },
        )
    }
}

impl<M: Sync> Piece for ApplyPiece<'_, M> {
    fn len(&self) -> usize {
        self.p.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (p0, p1) = self.p.split_at_mut(mid);
        let (m0, m1) = self.m.split_at(mid);
        let (v0, v1) = self.v.split_at(mid);
        let (w0, w1) = match self.w {
            Some(w) => {
                let (a, b) = w.split_at(mid);
                (Some(a), Some(b))
            }
            None => (None, None),
        };
        let r = self.ratio;
        (
            ApplyPiece { p: p0, m: m0, v: v0, w: w0, ratio: r },
            ApplyPiece { p: p1, m: m1, v: v1, w: w1, ratio: r },
        )
    }
}

/// The tensors with their norms (pass 1: written).
struct Pass1<'a, T> {
    tensors: &'a mut [T],
    norms: &'a mut [TensorNorms],
}

/// The tensors with their norms (pass 2: read, turned into trust ratios).
struct Pass2<'a, T> {
    tensors: &'a mut [T],
    norms: &'a [TensorNorms],
    lr: f32,
    adapt: bool,
}

impl<'a, T: StepTensor> Tensors for Pass1<'a, T> {
    type Piece = Offset<MomentsPiece<'a, T::Moment>>;
    type Slot = &'a mut TensorNorms;
    fn count(&self) -> usize {
        self.tensors.len()
    }
    fn len_of(&self, i: usize) -> usize {
        self.tensors[i].len()
    }
    fn split_at(self, i: usize) -> (Self, Self) {
        let (t0, t1) = self.tensors.split_at_mut(i);
        let (n0, n1) = self.norms.split_at_mut(i);
        (Pass1 { tensors: t0, norms: n0 }, Pass1 { tensors: t1, norms: n1 })
    }
    fn into_single(self) -> (Self::Piece, &'a mut TensorNorms) {
        (Offset { piece: self.tensors[0].moments(), offset: 0 }, &mut self.norms[0])
    }
}

impl<'a, T: StepTensor> Tensors for Pass2<'a, T> {
    type Piece = ApplyPiece<'a, T::Moment>;
    type Slot = ();
    fn count(&self) -> usize {
        self.tensors.len()
    }
    fn len_of(&self, i: usize) -> usize {
        self.tensors[i].len()
    }
    fn split_at(self, i: usize) -> (Self, Self) {
        let (t0, t1) = self.tensors.split_at_mut(i);
        let (n0, n1) = self.norms.split_at(i);
        let (lr, adapt) = (self.lr, self.adapt);
        (Pass2 { tensors: t0, norms: n0, lr, adapt }, Pass2 { tensors: t1, norms: n1, lr, adapt })
    }
    fn into_single(self) -> (Self::Piece, ()) {
        let ratio = trust_ratio(self.lr, self.adapt, self.norms[0]);
        (self.tensors[0].apply(ratio), ())
    }
}

struct Moments {
    backend: Backend,
    consts: LambConsts,
    /// The step's number, for bf16 moments' random bits.
    step: u64,
}

struct Apply {
    backend: Backend,
    consts: LambConsts,
}

impl Moments {
    /// Pass 1 on a piece whose indices share their high 32 bits (`offset`: its first element's index).
    fn run<M: Moment>(&self, x: MomentsPiece<'_, M>, offset: u64) -> [f64; 2] {
        let (b, c) = (self.backend, &self.consts);
        // What bf16 moments round with (f32 ones ignore it).
        let draw = (block_key(step_key(x.stream, self.step), (offset >> 32) as u32), offset as u32);
        let MomentsPiece { p, g, m, v, .. } = x;
        match g {
            GradSlice::F32(g) => dispatch!(b, lamb::lamb_moments::<f32, M>(p, g, m, v, c, draw)),
            GradSlice::F16(g) => dispatch!(b, lamb::lamb_moments::<f16, M>(p, g, m, v, c, draw)),
            GradSlice::Bf16(g) => dispatch!(b, lamb::lamb_moments::<bf16, M>(p, g, m, v, c, draw)),
        }
    }
}

fn apply<W: Element, M: Moment>(b: Backend, x: ApplyPiece<'_, M>, w: Option<&mut [W]>, c: &LambConsts) {
    dispatch!(b, lamb::lamb_apply::<W, M>(x.p, x.m, x.v, w, x.ratio, c));
}

impl<'a, T: StepTensor> Kernel<Pass1<'a, T>> for Moments {
    /// Sums of squares of `p` and of `u`.
    type Acc = [f64; 2];
    type Out = ();

    fn leaf(&self, x: Offset<MomentsPiece<'a, T::Moment>>) -> [f64; 2] {
        let mut sums = [0.0; 2];
        x.for_each_key_run(|piece, offset| {
            let [p, u] = self.run(piece, offset);
            sums = [sums[0] + p, sums[1] + u];
        });
        sums
    }
    fn merge(&self, l: [f64; 2], r: [f64; 2]) -> [f64; 2] {
        [l[0] + r[0], l[1] + r[1]]
    }
    fn finish(&self, _index: usize, sums: [f64; 2], slot: &'a mut TensorNorms) {
        *slot = TensorNorms { param: sums[0].sqrt() as f32, update: sums[1].sqrt() as f32 };
    }
    fn join(&self, (): (), (): ()) {}
    fn empty(&self) {}
}

impl<'a, T: StepTensor> Kernel<Pass2<'a, T>> for Apply {
    type Acc = ();
    type Out = ();

    fn leaf(&self, mut x: ApplyPiece<'a, T::Moment>) {
        let (b, c) = (self.backend, &self.consts);
        match x.w.take() {
            None => apply::<f32, _>(b, x, None, c),
            Some(HalfSliceMut::F16(w)) => apply::<f16, _>(b, x, Some(w), c),
            Some(HalfSliceMut::Bf16(w)) => apply::<bf16, _>(b, x, Some(w), c),
        }
    }
    fn merge(&self, (): (), (): ()) {}
    fn finish(&self, _index: usize, (): (), (): ()) {}
    fn join(&self, (): (), (): ()) {}
    fn empty(&self) {}
}
