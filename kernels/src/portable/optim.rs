//! Portable optimizer kernels over one piece of one tensor: the same f32 operations, in the same order,
//! as `crate::simd::optim`, as plain loops LLVM vectorises.
//!
//! Each piece runs in blocks of [`BLOCK`] elements: the gradient is widened into a stack buffer (read
//! in place when it is f32), a monomorphic f32 core updates master and state, and the working copy is
//! narrowed from the freshly written (L1-resident) master. The core is picked once per piece, from the
//! hyper-parameter switches, as a function pointer, so each core is a branch-free loop.

use half::bf16;

use super::{stochastic, Elem, BLOCK};
use crate::optim::{AdamBf16Slices, AdamConsts, AdamSlices, SgdBf16Slices, SgdConsts, SgdSlices};

/// `[start, end)` of each block of a piece of `n` elements.
pub(crate) fn blocks(n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n).step_by(BLOCK).map(move |s| (s, (s + BLOCK).min(n)))
}

// ---- Adam ----------------------------------------------------------------------------------------

type AdamCore = fn(&mut [f32], &[f32], &mut [f32], &mut [f32], &mut [f32], &AdamConsts);

fn adam_core<const L2: bool, const AMS: bool>(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    vmax: &mut [f32],
    c: &AdamConsts,
) {
    let c = *c;
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    let vmax = if AMS { &mut vmax[..n] } else { vmax };
    for i in 0..n {
        let mut gi = g[i] * c.inv_scale;
        let mut pi = p[i];
        if L2 {
            gi += c.weight_decay * pi;
        }
        pi *= c.decay;
        let mi = m[i] + c.one_minus_beta1 * (gi - m[i]);
        let vi = v[i] * c.beta2 + (c.one_minus_beta2 * gi) * gi;
        m[i] = mi;
        v[i] = vi;
        let veff = if AMS {
            let x = if vmax[i] > vi { vmax[i] } else { vi };
            vmax[i] = x;
            x
        } else {
            vi
        };
        let denom = veff.sqrt() / c.bias_correction2_sqrt + c.eps;
        p[i] = pi - (c.step_size * mi) / denom;
    }
}

/// One Adam / AdamW step on one piece.
pub(crate) fn adam<G: Elem, Wk: Elem>(s: AdamSlices<'_, G, Wk>, c: &AdamConsts) {
    let core: AdamCore = match (c.l2, s.vmax.is_some()) {
        (false, false) => adam_core::<false, false>,
        (false, true) => adam_core::<false, true>,
        (true, false) => adam_core::<true, false>,
        (true, true) => adam_core::<true, true>,
    };
    let AdamSlices { p, g, m, v, mut vmax, mut w } = s;
    let mut gbuf = [0f32; BLOCK];
    for (s, e) in blocks(p.len()) {
        let pb = &mut p[s..e];
        let xb = vmax.as_deref_mut().map_or(&mut [][..], |x| &mut x[s..e]);
        G::read(&g[s..e], &mut gbuf, |gb| core(pb, gb, &mut m[s..e], &mut v[s..e], xb, c));
        if let Some(w) = w.as_deref_mut() {
            Wk::narrow(pb, &mut w[s..e]);
        }
    }
}

/// One Adam / AdamW step with bf16 moments on one piece: block by block, the moments widened, [`adam`]'s
/// f32 step, the moments rounded back stochastically (`m` with the low half of element `i`'s random
/// bits of index `first + i` of stream `key`, `v` with the high half), as the AVX2 kernel does in
/// registers.
pub(crate) fn adam_bf16_state<G: Elem, Wk: Elem>(
    s: AdamBf16Slices<'_, G, Wk>,
    c: &AdamConsts,
    key: u32,
    first: u32,
) {
    let AdamBf16Slices { p, g, m, v, mut w } = s;
    let (mut m32, mut v32) = ([0f32; BLOCK], [0f32; BLOCK]);
    for (s, e) in blocks(p.len()) {
        let (mb, vb) = (&mut m32[..e - s], &mut v32[..e - s]);
        bf16::widen(&m[s..e], mb);
        bf16::widen(&v[s..e], vb);
        let w = w.as_deref_mut().map(|w| &mut w[s..e]);
        adam::<G, Wk>(
            AdamSlices { p: &mut p[s..e], g: &g[s..e], m: &mut *mb, v: &mut *vb, vmax: None, w },
            c,
        );
        let at = first.wrapping_add(s as u32);
        stochastic::narrow_bf16(mb, &mut m[s..e], key, at, 0);
        stochastic::narrow_bf16(vb, &mut v[s..e], key, at, 16);
    }
}

// ---- SGD -----------------------------------------------------------------------------------------

type SgdCore = fn(&mut [f32], &[f32], &mut [f32], &SgdConsts);

/// Momentum modes of [`sgd_core`].
const NO_MOMENTUM: u8 = 0;
const FIRST: u8 = 1;
const BLEND: u8 = 2;

fn sgd_core<const L2: bool, const MODE: u8, const NESTEROV: bool>(
    p: &mut [f32],
    g: &[f32],
    buf: &mut [f32],
    c: &SgdConsts,
) {
    let c = *c;
    let n = p.len();
    let g = &g[..n];
    let buf = if MODE == NO_MOMENTUM { buf } else { &mut buf[..n] };
    for i in 0..n {
        let mut d = g[i] * c.inv_scale;
        if L2 {
            d += c.weight_decay * p[i];
        }
        if MODE != NO_MOMENTUM {
            let b = if MODE == FIRST { d } else { buf[i] * c.momentum + c.one_minus_dampening * d };
            buf[i] = b;
            d = if NESTEROV { d + c.momentum * b } else { b };
        }
        p[i] -= c.lr * d;
    }
}

fn pick_sgd_core<const L2: bool>(c: &SgdConsts) -> SgdCore {
    match (c.has_momentum, c.first, c.nesterov) {
        (false, _, _) => sgd_core::<L2, NO_MOMENTUM, false>,
        (true, true, false) => sgd_core::<L2, FIRST, false>,
        (true, true, true) => sgd_core::<L2, FIRST, true>,
        (true, false, false) => sgd_core::<L2, BLEND, false>,
        (true, false, true) => sgd_core::<L2, BLEND, true>,
    }
}

/// One SGD step on one piece.
pub(crate) fn sgd<G: Elem, Wk: Elem>(s: SgdSlices<'_, G, Wk>, c: &SgdConsts) {
    let core = if c.l2 { pick_sgd_core::<true>(c) } else { pick_sgd_core::<false>(c) };
    let SgdSlices { p, g, mut buf, mut w } = s;
    let mut gbuf = [0f32; BLOCK];
    for (s, e) in blocks(p.len()) {
        let pb = &mut p[s..e];
        let bb = buf.as_deref_mut().map_or(&mut [][..], |x| &mut x[s..e]);
        G::read(&g[s..e], &mut gbuf, |gb| core(pb, gb, bb, c));
        if let Some(w) = w.as_deref_mut() {
            Wk::narrow(pb, &mut w[s..e]);
        }
    }
}

/// One SGD step with a bf16 momentum buffer on one piece: block by block, the buffer widened, [`sgd`]'s
/// f32 step, the buffer rounded back stochastically (element `i` with the low half of the random bits
/// of index `first + i` of stream `key`), as the AVX2 kernel does in registers.
pub(crate) fn sgd_bf16_state<G: Elem, Wk: Elem>(
    s: SgdBf16Slices<'_, G, Wk>,
    c: &SgdConsts,
    key: u32,
    first: u32,
) {
    let SgdBf16Slices { p, g, buf, mut w } = s;
    let mut b32 = [0f32; BLOCK];
    for (s, e) in blocks(p.len()) {
        let bb = &mut b32[..e - s];
        bf16::widen(&buf[s..e], bb);
        let w = w.as_deref_mut().map(|w| &mut w[s..e]);
        sgd::<G, Wk>(SgdSlices { p: &mut p[s..e], g: &g[s..e], buf: Some(&mut *bb), w }, c);
        stochastic::narrow_bf16(bb, &mut buf[s..e], key, first.wrapping_add(s as u32), 0);
    }
}
