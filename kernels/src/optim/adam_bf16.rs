//! Fused Adam / AdamW with the moments stored in bf16: half the state's memory and 8 fewer bytes of
//! traffic per element (20 instead of 28 with f32 gradients).
//!
//! Per element the step is [`adam_step`](super::adam_step)'s, in f32, on the moments widened from bf16
//! (exact); the updated moments are then rounded back to bf16 stochastically ([`crate::stochastic`]),
//! with a stream per tensor, step and moment, so that the small per-step changes of a running average
//! survive in expectation (round-to-nearest would drop any change below half a bf16 step: `v` would
//! stop decaying). The master stays f32. AMSGrad is not offered (a running maximum rounded at random
//! is no maximum).
//!
//! The code paths, thread counts and ways of splitting the work all write the same bits:
//! [`crate::reference::adam_step_bf16_state`] is the element-by-element oracle.

use half::{bf16, f16};

use super::adam::{typed, AdamConsts, AdamParams, AdamSlices};
use super::check_len;
use crate::backend::{Backend, Element};
use crate::par::{self, Kernel, Piece, Tensors};
use crate::stochastic::{narrow_block, stream_key};
use crate::{convert, GradSlice, HalfSliceMut, Isa};

/// Elements per block: the moments are widened into two stack buffers of this many f32s.
const BLOCK: usize = 1024;

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

/// The two stream keys of one tensor and step: the first moment's and the second's.
pub fn moment_keys(stream: u64, step: u64) -> [u32; 2] {
    [stream_key(&[stream, step, 0]), stream_key(&[stream, step, 1])]
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

/// A piece of a tensor and where it starts in it (the index the random bits are drawn for).
pub(crate) struct Part<'a> {
    tensor: AdamBf16Tensor<'a>,
    offset: u64,
}

impl Piece for Part<'_> {
    fn len(&self) -> usize {
        self.tensor.master.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let AdamBf16Tensor { master, grad, exp_avg, exp_avg_sq, working, stream } = self.tensor;
        let (p0, p1) = master.split_at_mut(mid);
        let (g0, g1) = grad.split_at(mid);
        let (m0, m1) = exp_avg.split_at_mut(mid);
        let (v0, v1) = exp_avg_sq.split_at_mut(mid);
        let (w0, w1) = match working.map(|w| w.split_at(mid)) {
            Some((a, b)) => (Some(a), Some(b)),
            None => (None, None),
        };
        let first = AdamBf16Tensor { master: p0, grad: g0, exp_avg: m0, exp_avg_sq: v0, working: w0, stream };
        let second =
            AdamBf16Tensor { master: p1, grad: g1, exp_avg: m1, exp_avg_sq: v1, working: w1, stream };
        (
            Part { tensor: first, offset: self.offset },
            Part { tensor: second, offset: self.offset + mid as u64 },
        )
    }
}

impl<'a> Tensors for &'a mut [AdamBf16Tensor<'_>] {
    type Piece = Part<'a>;
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
    fn into_single(self) -> (Part<'a>, ()) {
        let t = &mut self[0];
        let tensor = AdamBf16Tensor {
            master: &mut *t.master,
            grad: t.grad,
            exp_avg: &mut *t.exp_avg,
            exp_avg_sq: &mut *t.exp_avg_sq,
            working: t.working.as_mut().map(HalfSliceMut::reborrow),
            stream: t.stream,
        };
        (Part { tensor, offset: 0 }, ())
    }
}

struct Step {
    backend: Backend,
    consts: AdamConsts,
    step: u64,
}

/// A piece's slices, typed, with its random streams.
struct Typed<'a, G, W> {
    p: &'a mut [f32],
    g: &'a [G],
    m: &'a mut [bf16],
    v: &'a mut [bf16],
    w: Option<&'a mut [W]>,
    keys: [u32; 2],
    offset: u64,
}

impl Step {
    /// Block by block: the moments widened, the f32 step, the moments rounded back.
    fn blocks<G: Element, W: Element>(&self, x: Typed<'_, G, W>) {
        let Typed { p, g, m, v, mut w, keys, offset } = x;
        let (mut m32, mut v32) = ([0f32; BLOCK], [0f32; BLOCK]);
        for s in (0..p.len()).step_by(BLOCK) {
            let e = (s + BLOCK).min(p.len());
            let (mb, vb) = (&mut m32[..e - s], &mut v32[..e - s]);
            convert::widen_piece(self.backend, &m[s..e], mb);
            convert::widen_piece(self.backend, &v[s..e], vb);
            let w = w.as_deref_mut().map(|w| &mut w[s..e]);
            let slices = AdamSlices { p: &mut p[s..e], g: &g[s..e], m: &mut *mb, v: &mut *vb, vmax: None, w };
            typed::<G, W>(self.backend, slices, &self.consts);
            narrow_block(self.backend, mb, &mut m[s..e], keys[0], offset + s as u64);
            narrow_block(self.backend, vb, &mut v[s..e], keys[1], offset + s as u64);
        }
    }

    fn with_grad<W: Element>(&self, t: AdamBf16Tensor<'_>, w: Option<&mut [W]>, offset: u64) {
        let keys = moment_keys(t.stream, self.step);
        let (p, m, v) = (t.master, t.exp_avg, t.exp_avg_sq);
        match t.grad {
            GradSlice::F32(g) => self.blocks::<f32, W>(Typed { p, g, m, v, w, keys, offset }),
            GradSlice::F16(g) => self.blocks::<f16, W>(Typed { p, g, m, v, w, keys, offset }),
            GradSlice::Bf16(g) => self.blocks::<bf16, W>(Typed { p, g, m, v, w, keys, offset }),
        }
    }
}

impl<'a> Kernel<&'a mut [AdamBf16Tensor<'_>]> for Step {
    type Acc = ();
    type Out = ();

    fn leaf(&self, part: Part<'a>) {
        let Part { tensor: mut t, offset } = part;
        match t.working.take() {
            None => self.with_grad::<f32>(t, None, offset),
            Some(HalfSliceMut::F16(w)) => self.with_grad::<f16>(t, Some(w), offset),
            Some(HalfSliceMut::Bf16(w)) => self.with_grad::<bf16>(t, Some(w), offset),
        }
    }
    fn merge(&self, (): (), (): ()) {}
    fn finish(&self, _index: usize, (): (), (): ()) {}
    fn join(&self, (): (), (): ()) {}
    fn empty(&self) {}
}
