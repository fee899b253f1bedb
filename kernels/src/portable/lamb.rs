//! Portable LAMB kernels over one piece of one tensor: the same f32 operations, in the same order, as
//! `crate::simd::lamb`. Pass 1 writes each block's update into a stack buffer to sum its squares in the
//! shared 16-lane layout.

use super::kernels::add_squares;
use super::optim::blocks;
use super::{reduce_lanes, Elem, BLOCK, LANES};
use crate::optim::LambConsts;

/// The update `u` from the new moments and the pre-step master.
#[inline(always)]
fn lamb_update<const DECOUPLED: bool>(c: &LambConsts, p: f32, m: f32, v: f32) -> f32 {
    let u = (m / c.bias_correction1) / ((v / c.bias_correction2).sqrt() + c.eps);
    if DECOUPLED {
        u + c.weight_decay * p
    } else {
        u
    }
}

type MomentsCore = fn(&[f32], &[f32], &mut [f32], &mut [f32], &mut [f32], &LambConsts);

/// Updates `m`, `v` and writes the update into `u`.
fn moments_core<const L2: bool, const DECOUPLED: bool>(
    p: &[f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    u: &mut [f32],
    c: &LambConsts,
) {
    let c = *c;
    let n = p.len();
    let (g, m, v, u) = (&g[..n], &mut m[..n], &mut v[..n], &mut u[..n]);
    for i in 0..n {
        let mut gi = g[i] * c.inv_scale;
        if L2 {
            gi += c.weight_decay * p[i];
        }
        let mi = m[i] * c.beta1 + c.beta3 * gi;
        let vi = v[i] * c.beta2 + (c.one_minus_beta2 * gi) * gi;
        m[i] = mi;
        v[i] = vi;
        u[i] = lamb_update::<DECOUPLED>(&c, p[i], mi, vi);
    }
}

/// LAMB pass 1 on one piece: updates `m`, `v`; returns the f64 sums of `p²` and `u²` (16 lanes each).
pub(crate) fn lamb_moments<G: Elem>(
    p: &[f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    c: &LambConsts,
) -> [f64; 2] {
    let core: MomentsCore = match (c.l2, c.decoupled) {
        (false, false) => moments_core::<false, false>,
        (false, true) => moments_core::<false, true>,
        (true, false) => moments_core::<true, false>,
        (true, true) => moments_core::<true, true>,
    };
    let (mut gbuf, mut ubuf) = ([0f32; BLOCK], [0f32; BLOCK]);
    let (mut lanes_p, mut lanes_u) = ([0f64; LANES], [0f64; LANES]);
    for (s, e) in blocks(p.len()) {
        let ub = &mut ubuf[..e - s];
        G::read(&g[s..e], &mut gbuf, |gb| core(&p[s..e], gb, &mut m[s..e], &mut v[s..e], ub, c));
        add_squares(&mut lanes_p, &p[s..e]);
        add_squares(&mut lanes_u, ub);
    }
    [reduce_lanes(&lanes_p), reduce_lanes(&lanes_u)]
}

fn apply_core<const DECOUPLED: bool>(p: &mut [f32], m: &[f32], v: &[f32], ratio: f32, c: &LambConsts) {
    let c = *c;
    let n = p.len();
    let (m, v) = (&m[..n], &v[..n]);
    for i in 0..n {
        p[i] = p[i] - ratio * lamb_update::<DECOUPLED>(&c, p[i], m[i], v[i]);
    }
}

/// LAMB pass 2 on one piece: `p -= ratio * u`, working copy from `p`.
pub(crate) fn lamb_apply<Wk: Elem>(
    p: &mut [f32],
    m: &[f32],
    v: &[f32],
    mut w: Option<&mut [Wk]>,
    ratio: f32,
    c: &LambConsts,
) {
    let core = if c.decoupled { apply_core::<true> } else { apply_core::<false> };
    for (s, e) in blocks(p.len()) {
        core(&mut p[s..e], &m[s..e], &v[s..e], ratio, c);
        if let Some(w) = w.as_deref_mut() {
            Wk::narrow(&p[s..e], &mut w[s..e]);
        }
    }
}
