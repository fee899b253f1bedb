//! Portable LAMB kernels over one piece of one tensor: the same f32 operations, in the same order, as
//! `crate::simd::lamb`. Pass 1 writes each block's update into a stack buffer to sum its squares in the
//! shared 16-lane layout. bf16 moments ([`Moment`]) are widened a block at a time, rounded back
//! stochastically, and the update is computed from the values stored.

use half::bf16;

use super::kernels::add_squares;
use super::optim::blocks;
use super::{reduce_lanes, stochastic, Elem, BLOCK, LANES};
use crate::optim::LambConsts;

/// How pass 1 keeps a block of moments it computed: f32 in place, bf16 rounded stochastically.
pub(crate) trait Moment: Elem {
    /// Calls `advance` on the block's moments `m`, `v` as f32 to update them, keeps the results (bf16:
    /// `m` rounded with the low half of the random bits of index `first + i` of stream `key`, `v` with
    /// the high half), then calls `read` with the values kept, as f32.
    fn keep(
        moments: (&mut [Self], &mut [Self]),
        bufs: &mut [[f32; BLOCK]; 2],
        draw: (u32, u32),
        advance: impl FnOnce(&mut [f32], &mut [f32]),
        read: impl FnOnce(&[f32], &[f32]),
    );
}

impl Moment for f32 {
    #[inline(always)]
    fn keep(
        (m, v): (&mut [f32], &mut [f32]),
        _: &mut [[f32; BLOCK]; 2],
        _: (u32, u32),
        advance: impl FnOnce(&mut [f32], &mut [f32]),
        read: impl FnOnce(&[f32], &[f32]),
    ) {
        advance(m, v);
        read(m, v);
    }
}

impl Moment for bf16 {
    #[inline(always)]
    fn keep(
        (m, v): (&mut [bf16], &mut [bf16]),
        [mbuf, vbuf]: &mut [[f32; BLOCK]; 2],
        (key, first): (u32, u32),
        advance: impl FnOnce(&mut [f32], &mut [f32]),
        read: impl FnOnce(&[f32], &[f32]),
    ) {
        let (mb, vb) = (&mut mbuf[..m.len()], &mut vbuf[..v.len()]);
        bf16::widen(m, mb);
        bf16::widen(v, vb);
        advance(mb, vb);
        stochastic::narrow_bf16(mb, m, key, first, 0);
        stochastic::narrow_bf16(vb, v, key, first, 16);
        bf16::widen(m, mb);
        bf16::widen(v, vb);
        read(mb, vb);
    }
}

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

/// Updates the moments `m`, `v` from the master `p` and the unscaled gradient `g`.
fn advance_core<const L2: bool>(p: &[f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: &LambConsts) {
    let c = *c;
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let mut gi = g[i] * c.inv_scale;
        if L2 {
            gi += c.weight_decay * p[i];
        }
        m[i] = m[i] * c.beta1 + c.beta3 * gi;
        v[i] = v[i] * c.beta2 + (c.one_minus_beta2 * gi) * gi;
    }
}

/// Writes the update of each element into `u`.
fn update_core<const DECOUPLED: bool>(p: &[f32], m: &[f32], v: &[f32], u: &mut [f32], c: &LambConsts) {
    let c = *c;
    let n = p.len();
    let (m, v, u) = (&m[..n], &v[..n], &mut u[..n]);
    for i in 0..n {
        u[i] = lamb_update::<DECOUPLED>(&c, p[i], m[i], v[i]);
    }
}

/// LAMB pass 1 on one piece: updates `m`, `v`; returns the f64 sums of `p²` and `u²` (16 lanes each).
/// bf16 moments of element `i` round with the random bits of index `first + i` of stream `key`.
pub(crate) fn lamb_moments<G: Elem, M: Moment>(
    p: &[f32],
    g: &[G],
    m: &mut [M],
    v: &mut [M],
    c: &LambConsts,
    (key, first): (u32, u32),
) -> [f64; 2] {
    let advance = if c.l2 { advance_core::<true> } else { advance_core::<false> };
    let update = if c.decoupled { update_core::<true> } else { update_core::<false> };
    let (mut gbuf, mut ubuf, mut bufs) = ([0f32; BLOCK], [0f32; BLOCK], [[0f32; BLOCK]; 2]);
    let (mut lanes_p, mut lanes_u) = ([0f64; LANES], [0f64; LANES]);
    for (s, e) in blocks(p.len()) {
        let (pb, ub) = (&p[s..e], &mut ubuf[..e - s]);
        G::read(&g[s..e], &mut gbuf, |gb| {
            M::keep(
                (&mut m[s..e], &mut v[s..e]),
                &mut bufs,
                (key, first.wrapping_add(s as u32)),
                |mb, vb| advance(pb, gb, mb, vb, c),
                |mb, vb| update(pb, mb, vb, &mut *ub, c),
            );
        });
        add_squares(&mut lanes_p, pb);
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
pub(crate) fn lamb_apply<Wk: Elem, M: Elem>(
    p: &mut [f32],
    m: &[M],
    v: &[M],
    mut w: Option<&mut [Wk]>,
    ratio: f32,
    c: &LambConsts,
) {
    let core = if c.decoupled { apply_core::<true> } else { apply_core::<false> };
    let (mut mbuf, mut vbuf) = ([0f32; BLOCK], [0f32; BLOCK]);
    for (s, e) in blocks(p.len()) {
        let pb = &mut p[s..e];
        M::read(&m[s..e], &mut mbuf, |mb| M::read(&v[s..e], &mut vbuf, |vb| core(pb, mb, vb, ratio, c)));
        if let Some(w) = w.as_deref_mut() {
            Wk::narrow(pb, &mut w[s..e]);
        }
    }
}
