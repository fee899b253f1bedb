//! Fused Adam / AdamW with the moments stored in bf16: half the state's memory and 8 fewer bytes of
//! traffic per element (20 instead of 28 with f32 gradients).
//!
//! Per element the step is [`adam_step`](super::adam_step)'s, in f32, on the moments widened from bf16
//! (exact); the updated moments are then rounded back to bf16 stochastically ([`crate::stochastic`]:
//! one 32-bit hash per element of a stream per tensor and step, its low half for `m`, its high half
//! for `v`), so that the small per-step changes of a running average survive in expectation (round-to-nearest would drop any change below half a bf16 step: `v` would
//! stop decaying). The master stays f32. AMSGrad is not offered (a running maximum rounded at random
//! is no maximum).
//!
//! The AVX2 path does it all in registers in the step's one pass; the portable path widens blocks of
//! moments into stack buffers, runs the f32 step on them and rounds them back. The code paths, thread
//! counts and ways of splitting the work all write the same bits:
//! [`crate::reference::adam_step_bf16_state`] is the element-by-element oracle.
//!
//! Per element the AVX2 path adds a hash (two 32-bit multiplies) and two roundings to the f32 step:
//! where the step was bound by memory it gets faster; where it was not (a CPU with much bandwidth per
//! core) it stays about as fast.

use half::{bf16, f16};

use super::adam::{AdamConsts, AdamParams};
use super::check_len;
use super::offset::Offset;
use crate::backend::{dispatch, Backend, Element};
use crate::par::{self, Kernel, Piece, Tensors};
use crate::stochastic::{block_key, stream_key};
use crate::{GradSlice, HalfSliceMut, Isa};

/// One parameter tensor of an Adam step with bf16 moments. All slices must have the master's length.
#[derive(Debug)]
pub struct AdamBf16Tensor<'a> {
    /// fp32 master weights, updated in place.
    pub master: &'a mut [f32],
    /// Gradient (still scaled by the loss scale; `inv_grad_scale` is applied inline).
    pub grad: GradSlice<'a>,
    /// First moment `m`, in bf16.
    pub exp_avg: &'a mut [bf16],
    /// Second moment `v`, in bf16.
    pub exp_avg_sq: &'a mut [bf16],
    /// Half working copy, overwritten with the updated master.
    pub working: Option<HalfSliceMut<'a>>,
    /// The tensor's random stream: a number of its own, the same in every run (amp hashes the
    /// parameter's path), so that a run is reproducible and a resumed one draws what it would have.
    pub stream: u64,
}

/// The stream key of one tensor's Adam or LAMB step: element `i`'s random bits are
/// [`random_bits(key, i)`](crate::stochastic::random_bits), the low 16 rounding `m`, the high 16 `v`.
pub fn step_key(stream: u64, step: u64) -> u32 {
    stream_key(&[stream, step])
}

/// Runs one fused Adam / AdamW step with bf16 moments over all `tensors`. Runs on [`Isa::detect`].
///
/// # Panics
/// If a tensor's slices differ in length, if `params.amsgrad`, or if `params.step == 0`.
pub fn adam_step_bf16_state(tensors: &mut [AdamBf16Tensor<'_>], params: &AdamParams, inv_grad_scale: f32) {
    adam_step_bf16_state_with(Isa::detect(), tensors, params, inv_grad_scale);
}

/// [`adam_step_bf16_state`] on an explicit code path.
///
/// # Panics
/// As [`adam_step_bf16_state`].
pub fn adam_step_bf16_state_with(
    isa: Isa,
    tensors: &mut [AdamBf16Tensor<'_>],
    params: &AdamParams,
    inv_grad_scale: f32,
) {
    assert!(params.step >= 1, "adam_step_bf16_state: step numbers start at 1");
    assert!(!params.amsgrad, "adam_step_bf16_state: AMSGrad needs f32 state (a running maximum)");
    for (i, t) in tensors.iter().enumerate() {
        let n = t.master.len();
        check_len("grad", i, t.grad.len(), n);
        check_len("exp_avg", i, t.exp_avg.len(), n);
        check_len("exp_avg_sq", i, t.exp_avg_sq.len(), n);
        if let Some(w) = &t.working {
            check_len("working", i, w.len(), n);
        }
    }
    let kernel = Step {
        backend: Backend::new(isa),
        consts: AdamConsts::new(params, inv_grad_scale),
        step: params.step,
    };
    par::run(tensors, &kernel);
}

impl Piece for AdamBf16Tensor<'_> {
    fn len(&self) -> usize {
        self.master.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let AdamBf16Tensor { master, grad, exp_avg, exp_avg_sq, working, stream } = self;
        let (p0, p1) = master.split_at_mut(mid);
        let (g0, g1) = grad.split_at(mid);
        let (m0, m1) = exp_avg.split_at_mut(mid);
        let (v0, v1) = exp_avg_sq.split_at_mut(mid);
        let (w0, w1) = match working.map(|w| w.split_at(mid)) {
            Some((a, b)) => (Some(a), Some(b)),
            None => (None, None),
        };
        let first = AdamBf16Tensor { master: p0, grad: g0, exp_avg: m0, exp_avg_sq: v0, working: w0, stream };
        (first, AdamBf16Tensor { master: p1, grad: g1, exp_avg: m1, exp_avg_sq: v1, working: w1, stream })
    }
}

impl<'a> Tensors for &'a mut [AdamBf16Tensor<'_>] {
    type Piece = Offset<AdamBf16Tensor<'a>>;
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
    fn into_single(self) -> (Offset<AdamBf16Tensor<'a>>, ()) {
        let t = &mut self[0];
        let tensor = AdamBf16Tensor {
            master: &mut *t.master,
            grad: t.grad,
            exp_avg: &mut *t.exp_avg,
            exp_avg_sq: &mut *t.exp_avg_sq,
            working: t.working.as_mut().map(HalfSliceMut::reborrow),
            stream: t.stream,
        };
        (Offset { piece: tensor, offset: 0 }, ())
    }
}

struct Step {
    backend: Backend,
    consts: AdamConsts,
    step: u64,
}

/// One piece of one tensor, typed: what the backends' `adam_bf16_state` kernels take. Equal lengths.
#[derive(Debug)]
pub(crate) struct AdamBf16Slices<'a, G, W> {
    pub(crate) p: &'a mut [f32],
    pub(crate) g: &'a [G],
    pub(crate) m: &'a mut [bf16],
    pub(crate) v: &'a mut [bf16],
    pub(crate) w: Option<&'a mut [W]>,
}

impl Step {
    /// A piece whose indices share their high 32 bits: one key, the low 32 bits of the first index.
    fn run(&self, t: AdamBf16Tensor<'_>, offset: u64) {
        let at = (block_key(step_key(t.stream, self.step), (offset >> 32) as u32), offset as u32);
        let AdamBf16Tensor { master: p, grad, exp_avg: m, exp_avg_sq: v, working, .. } = t;
        match working {
            None => self.with_grad::<f32>(p, grad, (m, v), None, at),
            Some(HalfSliceMut::F16(w)) => self.with_grad(p, grad, (m, v), Some(w), at),
            Some(HalfSliceMut::Bf16(w)) => self.with_grad(p, grad, (m, v), Some(w), at),
        }
    }

    fn with_grad<W: Element>(
        &self,
        p: &mut [f32],
        grad: GradSlice<'_>,
        (m, v): (&mut [bf16], &mut [bf16]),
        w: Option<&mut [W]>,
        (key, first): (u32, u32),
    ) {
        let (b, c) = (self.backend, &self.consts);
        match grad {
            GradSlice::F32(g) => {
                let s = AdamBf16Slices { p, g, m, v, w };
                dispatch!(b, optim::adam_bf16_state::<f32, W>(s, c, key, first));
            }
            GradSlice::F16(g) => {
                let s = AdamBf16Slices { p, g, m, v, w };
                dispatch!(b, optim::adam_bf16_state::<f16, W>(s, c, key, first));
            }
            GradSlice::Bf16(g) => {
                let s = AdamBf16Slices { p, g, m, v, w };
                dispatch!(b, optim::adam_bf16_state::<bf16, W>(s, c, key, first));
            }
        }
    }
}

impl<'a> Kernel<&'a mut [AdamBf16Tensor<'_>]> for Step {
    type Acc = ();
    type Out = ();

    fn leaf(&self, part: Offset<AdamBf16Tensor<'a>>) {
        part.for_each_key_run(|tensor, offset| self.run(tensor, offset));
    }
    fn merge(&self, (): (), (): ()) {}
    fn finish(&self, _index: usize, (): (), (): ()) {}
    fn join(&self, (): (), (): ()) {}
    fn empty(&self) {}
}
