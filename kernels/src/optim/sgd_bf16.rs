//! Fused SGD with momentum, the momentum buffer stored in bf16: half its memory, 4 fewer bytes of
//! traffic per element.
//!
//! Per element the step is [`sgd_step`](super::sgd_step)'s, in f32, on the buffer widened from bf16
//! (exact); the updated buffer is rounded back stochastically ([`crate::stochastic`]: the low 16 bits of
//! one hash per element of a stream per tensor and step), so that a change smaller than half a bf16
//! step survives in expectation. The master's update reads the unrounded buffer. The AVX2 path does it
//! in registers in the step's one pass; the portable one stages blocks; both write the bits of
//! [`crate::reference::sgd_step_bf16_state`].

use half::{bf16, f16};

use super::check_len;
use super::offset::Offset;
use super::sgd::{SgdConsts, SgdParams};
use crate::backend::{dispatch, Backend, Element};
use crate::par::{self, Kernel, Piece, Tensors};
use crate::stochastic::{block_key, stream_key};
use crate::{GradSlice, HalfSliceMut, Isa};

/// One parameter tensor of an SGD step with a bf16 momentum buffer. All slices must have the master's
/// length.
#[derive(Debug)]
pub struct SgdBf16Tensor<'a> {
    /// fp32 master weights, updated in place.
    pub master: &'a mut [f32],
    /// Gradient (still scaled by the loss scale; `inv_grad_scale` is applied inline).
    pub grad: GradSlice<'a>,
    /// Momentum buffer, in bf16.
    pub momentum_buffer: &'a mut [bf16],
    /// Half working copy, overwritten with the updated master.
    pub working: Option<HalfSliceMut<'a>>,
    /// The tensor's random stream, as [`AdamBf16Tensor::stream`](super::AdamBf16Tensor::stream).
    pub stream: u64,
}

/// The stream key of one tensor's step `step` (count the steps applied, from 1): element `i` rounds
/// with the low 16 bits of [`random_bits(key, i)`](crate::stochastic::random_bits).
pub fn sgd_step_key(stream: u64, step: u64) -> u32 {
    stream_key(&[stream, step, 0x0053_4744])
}

/// Runs one fused SGD step with bf16 momentum buffers over all `tensors`; `step` numbers the step for
/// the random bits (any number that differs from step to step; amp passes the applied-step count). Runs
/// on [`Isa::detect`].
///
/// # Panics
/// If a tensor's slices differ in length, if `params.momentum == 0` (there is no buffer to store), or
/// if nesterov is asked with dampening.
pub fn sgd_step_bf16_state(
    tensors: &mut [SgdBf16Tensor<'_>],
    params: &SgdParams,
    step: u64,
    inv_grad_scale: f32,
) {
    sgd_step_bf16_state_with(Isa::detect(), tensors, params, step, inv_grad_scale);
}

/// [`sgd_step_bf16_state`] on an explicit code path.
///
/// # Panics
/// As [`sgd_step_bf16_state`].
pub fn sgd_step_bf16_state_with(
    isa: Isa,
    tensors: &mut [SgdBf16Tensor<'_>],
    params: &SgdParams,
    step: u64,
    inv_grad_scale: f32,
) {
    assert!(params.momentum != 0.0, "sgd_step_bf16_state: a momentum buffer needs momentum != 0");
    assert!(
        !params.nesterov || params.dampening == 0.0,
        "sgd_step_bf16_state: nesterov momentum requires zero dampening"
    );
    for (i, t) in tensors.iter().enumerate() {
        let n = t.master.len();
        check_len("grad", i, t.grad.len(), n);
        check_len("momentum_buffer", i, t.momentum_buffer.len(), n);
        if let Some(w) = &t.working {
            check_len("working", i, w.len(), n);
        }
    }
    let kernel = Step { backend: Backend::new(isa), consts: SgdConsts::new(params, inv_grad_scale), step };
    par::run(tensors, &kernel);
}

impl Piece for SgdBf16Tensor<'_> {
    fn len(&self) -> usize {
        self.master.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let SgdBf16Tensor { master, grad, momentum_buffer, working, stream } = self;
        let (p0, p1) = master.split_at_mut(mid);
        let (g0, g1) = grad.split_at(mid);
        let (b0, b1) = momentum_buffer.split_at_mut(mid);
        let (w0, w1) = match working.map(|w| w.split_at(mid)) {
            Some((a, b)) => (Some(a), Some(b)),
            None => (None, None),
        };
        let first = SgdBf16Tensor { master: p0, grad: g0, momentum_buffer: b0, working: w0, stream };
        (first, SgdBf16Tensor { master: p1, grad: g1, momentum_buffer: b1, working: w1, stream })
    }
}

impl<'a> Tensors for &'a mut [SgdBf16Tensor<'_>] {
    type Piece = Offset<SgdBf16Tensor<'a>>;
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
    fn into_single(self) -> (Offset<SgdBf16Tensor<'a>>, ()) {
        let t = &mut self[0];
        let piece = SgdBf16Tensor {
            master: &mut *t.master,
            grad: t.grad,
            momentum_buffer: &mut *t.momentum_buffer,
            working: t.working.as_mut().map(HalfSliceMut::reborrow),
            stream: t.stream,
        };
        (Offset { piece, offset: 0 }, ())
    }
}

struct Step {
    backend: Backend,
    consts: SgdConsts,
    step: u64,
}

/// One piece of one tensor, typed: what the backends' `sgd_bf16_state` kernels take. Equal lengths.
#[derive(Debug)]
pub(crate) struct SgdBf16Slices<'a, G, W> {
    pub(crate) p: &'a mut [f32],
    pub(crate) g: &'a [G],
    pub(crate) buf: &'a mut [bf16],
    pub(crate) w: Option<&'a mut [W]>,
}

impl Step {
    /// A piece whose indices share their high 32 bits: one key, the low 32 bits of the first index.
    fn run(&self, t: SgdBf16Tensor<'_>, offset: u64) {
        let at = (block_key(sgd_step_key(t.stream, self.step), (offset >> 32) as u32), offset as u32);
        let SgdBf16Tensor { master: p, grad, momentum_buffer: buf, working, .. } = t;
        match working {
            None => self.with_grad::<f32>(p, grad, buf, None, at),
            Some(HalfSliceMut::F16(w)) => self.with_grad(p, grad, buf, Some(w), at),
            Some(HalfSliceMut::Bf16(w)) => self.with_grad(p, grad, buf, Some(w), at),
        }
    }

    fn with_grad<W: Element>(
        &self,
        p: &mut [f32],
        grad: GradSlice<'_>,
        buf: &mut [bf16],
        w: Option<&mut [W]>,
        (key, first): (u32, u32),
    ) {
        let (b, c) = (self.backend, &self.consts);
        match grad {
            GradSlice::F32(g) => {
                let s = SgdBf16Slices { p, g, buf, w };
                dispatch!(b, optim::sgd_bf16_state::<f32, W>(s, c, key, first));
            }
            GradSlice::F16(g) => {
                let s = SgdBf16Slices { p, g, buf, w };
                dispatch!(b, optim::sgd_bf16_state::<f16, W>(s, c, key, first));
            }
            GradSlice::Bf16(g) => {
                let s = SgdBf16Slices { p, g, buf, w };
                dispatch!(b, optim::sgd_bf16_state::<bf16, W>(s, c, key, first));
            }
        }
    }
}

impl<'a> Kernel<&'a mut [SgdBf16Tensor<'_>]> for Step {
    type Acc = ();
    type Out = ();

    fn leaf(&self, part: Offset<SgdBf16Tensor<'a>>) {
        part.for_each_key_run(|tensor, offset| self.run(tensor, offset));
    }
    fn merge(&self, (): (), (): ()) {}
    fn finish(&self, _index: usize, (): (), (): ()) {}
    fn join(&self, (): (), (): ()) {}
    fn empty(&self) {}
}
