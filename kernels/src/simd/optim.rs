//! AVX2 optimizer kernels over one piece of one tensor. Same f32 operations, in the same order, as the
//! portable kernels in `crate::portable::optim`; see the formulas in [`crate::optim`]'s modules.
//!
//! Optional arrays (amsgrad maximum, momentum buffer, working copy) travel as possibly-null pointers,
//! tested once per 8 elements (a perfectly predicted branch). Tails run the same 8-lane code on
//! zero-padded stack copies; padding lanes are discarded. LAMB is in `super::lamb`.

use std::arch::x86_64::{
    __m256, __m256i, _mm256_add_ps, _mm256_div_ps, _mm256_loadu_ps, _mm256_max_ps, _mm256_mul_ps,
    _mm256_set1_epi32, _mm256_set1_ps, _mm256_sqrt_ps, _mm256_storeu_ps, _mm256_sub_ps,
};
use std::ptr::null_mut;

use half::bf16;

use super::{offset, opt_ptr, pad, stochastic, unpad, Elem, W};
use crate::optim::{AdamBf16Slices, AdamConsts, AdamSlices, SgdBf16Slices, SgdConsts, SgdSlices};

// ---- Adam ----------------------------------------------------------------------------------------

struct AdamV {
    inv_scale: __m256,
    weight_decay: __m256,
    decay: __m256,
    one_minus_beta1: __m256,
    beta2: __m256,
    one_minus_beta2: __m256,
    bias_correction2_sqrt: __m256,
    eps: __m256,
    step_size: __m256,
    l2: bool,
}

impl AdamV {
    /// The constants broadcast to 8 lanes.
    ///
    /// # Safety
    /// AVX available.
    #[inline(always)]
    unsafe fn new(c: &AdamConsts) -> AdamV {
        // SAFETY: caller guarantees AVX.
        unsafe {
            AdamV {
                inv_scale: _mm256_set1_ps(c.inv_scale),
                weight_decay: _mm256_set1_ps(c.weight_decay),
                decay: _mm256_set1_ps(c.decay),
                one_minus_beta1: _mm256_set1_ps(c.one_minus_beta1),
                beta2: _mm256_set1_ps(c.beta2),
                one_minus_beta2: _mm256_set1_ps(c.one_minus_beta2),
                bias_correction2_sqrt: _mm256_set1_ps(c.bias_correction2_sqrt),
                eps: _mm256_set1_ps(c.eps),
                step_size: _mm256_set1_ps(c.step_size),
                l2: c.l2,
            }
        }
    }
}

/// The moments' update on 8 lanes: from the gradient (still scaled) and the loaded master and moments,
/// the decayed master and the new moments.
#[inline(always)]
unsafe fn moments8(k: &AdamV, g: __m256, p: __m256, m: __m256, v: __m256) -> (__m256, __m256, __m256) {
    // SAFETY: caller guarantees AVX2.
    unsafe {
        let mut g = _mm256_mul_ps(g, k.inv_scale);
        if k.l2 {
            g = _mm256_add_ps(g, _mm256_mul_ps(k.weight_decay, p));
        }
        let p = _mm256_mul_ps(p, k.decay);
        let m = _mm256_add_ps(m, _mm256_mul_ps(k.one_minus_beta1, _mm256_sub_ps(g, m)));
        let v = _mm256_mul_ps(v, k.beta2);
        let v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_mul_ps(k.one_minus_beta2, g), g));
        (p, m, v)
    }
}

/// The master's update on 8 lanes from the decayed master, `m` and the second moment in use.
#[inline(always)]
unsafe fn apply8(k: &AdamV, p: __m256, m: __m256, v: __m256) -> __m256 {
    // SAFETY: caller guarantees AVX2.
    unsafe {
        let denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), k.bias_correction2_sqrt), k.eps);
        _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(k.step_size, m), denom))
    }
}

#[inline(always)]
unsafe fn adam8<G: Elem, Wk: Elem>(
    k: &AdamV,
    (p, g, m, v): (*mut f32, *const G, *mut f32, *mut f32),
    vmax: *mut f32,
    w: *mut Wk,
) {
    // SAFETY: caller guarantees AVX2/FMA/F16C and 8 valid elements behind every non-null pointer.
    unsafe {
        let (pv, mv, vv) =
            moments8(k, G::load8(g), _mm256_loadu_ps(p), _mm256_loadu_ps(m), _mm256_loadu_ps(v));
        _mm256_storeu_ps(m, mv);
        _mm256_storeu_ps(v, vv);
        let veff = if vmax.is_null() {
            vv
        } else {
            // max(vmax, v): vmax if vmax > v, else v (so a NaN v propagates).
            let x = _mm256_max_ps(_mm256_loadu_ps(vmax), vv);
            _mm256_storeu_ps(vmax, x);
            x
        };
        let pv = apply8(k, pv, mv, veff);
        _mm256_storeu_ps(p, pv);
        if !w.is_null() {
            Wk::store8(w, pv);
        }
    }
}

/// One Adam / AdamW step on one piece.
///
/// # Safety
/// AVX2, FMA and F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn adam<G: Elem, Wk: Elem>(s: AdamSlices<'_, G, Wk>, c: &AdamConsts) {
    // SAFETY: AVX2 enabled here.
    let k = unsafe { AdamV::new(c) };
    let AdamSlices { p, g, m, v, mut vmax, mut w } = s;
    let n = p.len();
    let body = n - n % W;
    let base = (p.as_mut_ptr(), g.as_ptr(), m.as_mut_ptr(), v.as_mut_ptr());
    let xp = vmax.as_deref_mut().map_or(null_mut(), <[f32]>::as_mut_ptr);
    let wp = w.as_deref_mut().map_or(null_mut(), <[Wk]>::as_mut_ptr);
    for i in (0..body).step_by(W) {
        // SAFETY: i + 8 <= body <= n, the length of every slice.
        unsafe {
            let at = (base.0.add(i), base.1.add(i), base.2.add(i), base.3.add(i));
            adam8(&k, at, offset(xp, i), offset(wp, i));
        }
    }
    if body < n {
        let (mut tp, tg, mut tm, mut tv) =
            (pad(&p[body..]), pad(&g[body..]), pad(&m[body..]), pad(&v[body..]));
        let mut tx = vmax.as_deref().map(|x| pad(&x[body..]));
        let mut tw = w.as_deref().map(|x| pad(&x[body..]));
        let at = (tp.as_mut_ptr(), tg.as_ptr(), tm.as_mut_ptr(), tv.as_mut_ptr());
        // SAFETY: stack buffers of 8.
        unsafe { adam8(&k, at, opt_ptr(&mut tx), opt_ptr(&mut tw)) };
        let r = n - body;
        p[body..].copy_from_slice(&tp[..r]);
        m[body..].copy_from_slice(&tm[..r]);
        v[body..].copy_from_slice(&tv[..r]);
        unpad(vmax.map(|x| &mut x[body..]), tx);
        unpad(w.map(|x| &mut x[body..]), tw);
    }
}

/// [`adam8`] with bf16 moments, widened when loaded and rounded stochastically when stored: `m` with
/// the low half of `random`, `v` with the high half. The master's update reads the unrounded moments.
#[inline(always)]
unsafe fn adam8_bf16_state<G: Elem, Wk: Elem>(
    k: &AdamV,
    (p, g, m, v): (*mut f32, *const G, *mut bf16, *mut bf16),
    w: *mut Wk,
    random: __m256i,
) {
    // SAFETY: caller guarantees AVX2/FMA/F16C and 8 valid elements behind every non-null pointer.
    unsafe {
        let (pv, mv, vv) = moments8(k, G::load8(g), _mm256_loadu_ps(p), bf16::load8(m), bf16::load8(v));
        stochastic::store8(m, mv, random, false);
        stochastic::store8(v, vv, random, true);
        let pv = apply8(k, pv, mv, vv);
        _mm256_storeu_ps(p, pv);
        if !w.is_null() {
            Wk::store8(w, pv);
        }
    }
}

/// One Adam / AdamW step with bf16 moments on one piece, element `i` rounded with the random bits of
/// index `first + i` of stream `key` (`crate::stochastic`).
///
/// # Safety
/// AVX2, FMA and F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn adam_bf16_state<G: Elem, Wk: Elem>(
    s: AdamBf16Slices<'_, G, Wk>,
    c: &AdamConsts,
    key: u32,
    first: u32,
) {
    // SAFETY: AVX2 enabled here.
    let k = unsafe { AdamV::new(c) };
    let keys = _mm256_set1_epi32(key as i32);
    let AdamBf16Slices { p, g, m, v, mut w } = s;
    let n = p.len();
    let body = n - n % W;
    let base = (p.as_mut_ptr(), g.as_ptr(), m.as_mut_ptr(), v.as_mut_ptr());
    let wp = w.as_deref_mut().map_or(null_mut(), <[Wk]>::as_mut_ptr);
    for i in (0..body).step_by(W) {
        // SAFETY: i + 8 <= body <= n, the length of every slice.
        unsafe {
            let random = stochastic::random8(keys, first.wrapping_add(i as u32));
            let at = (base.0.add(i), base.1.add(i), base.2.add(i), base.3.add(i));
            adam8_bf16_state(&k, at, offset(wp, i), random);
        }
    }
    if body < n {
        let (mut tp, tg, mut tm, mut tv) =
            (pad(&p[body..]), pad(&g[body..]), pad(&m[body..]), pad(&v[body..]));
        let mut tw = w.as_deref().map(|x| pad(&x[body..]));
        let at = (tp.as_mut_ptr(), tg.as_ptr(), tm.as_mut_ptr(), tv.as_mut_ptr());
        // SAFETY: stack buffers of 8; the padding lanes' results are dropped.
        unsafe {
            let random = stochastic::random8(keys, first.wrapping_add(body as u32));
            adam8_bf16_state(&k, at, opt_ptr(&mut tw), random);
        }
        let r = n - body;
        p[body..].copy_from_slice(&tp[..r]);
        m[body..].copy_from_slice(&tm[..r]);
        v[body..].copy_from_slice(&tv[..r]);
        unpad(w.map(|x| &mut x[body..]), tw);
    }
}

// ---- SGD -----------------------------------------------------------------------------------------

struct SgdV {
    inv_scale: __m256,
    weight_decay: __m256,
    momentum: __m256,
    one_minus_dampening: __m256,
    lr: __m256,
    l2: bool,
    first: bool,
    nesterov: bool,
}

impl SgdV {
    /// The constants broadcast to 8 lanes.
    ///
    /// # Safety
    /// AVX available.
    #[inline(always)]
    unsafe fn new(c: &SgdConsts) -> SgdV {
        // SAFETY: caller guarantees AVX.
        unsafe {
            SgdV {
                inv_scale: _mm256_set1_ps(c.inv_scale),
                weight_decay: _mm256_set1_ps(c.weight_decay),
                momentum: _mm256_set1_ps(c.momentum),
                one_minus_dampening: _mm256_set1_ps(c.one_minus_dampening),
                lr: _mm256_set1_ps(c.lr),
                l2: c.l2,
                first: c.first,
                nesterov: c.nesterov,
            }
        }
    }
}

/// SGD's step direction on 8 lanes: the gradient (still scaled) unscaled, plus the L2 term.
#[inline(always)]
unsafe fn direction8(k: &SgdV, g: __m256, p: __m256) -> __m256 {
    // SAFETY: caller guarantees AVX2.
    unsafe {
        let d = _mm256_mul_ps(g, k.inv_scale);
        if k.l2 {
            _mm256_add_ps(d, _mm256_mul_ps(k.weight_decay, p))
        } else {
            d
        }
    }
}

/// The momentum on 8 lanes: from the direction and the buffer (read only when it blends: `load_buf`),
/// the new buffer and the direction the master moves in.
#[inline(always)]
unsafe fn momentum8(k: &SgdV, d: __m256, load_buf: impl FnOnce() -> __m256) -> (__m256, __m256) {
    // SAFETY: caller guarantees AVX2.
    unsafe {
        let b = if k.first {
            d
        } else {
            let kept = _mm256_mul_ps(load_buf(), k.momentum);
            _mm256_add_ps(kept, _mm256_mul_ps(k.one_minus_dampening, d))
        };
        (b, if k.nesterov { _mm256_add_ps(d, _mm256_mul_ps(k.momentum, b)) } else { b })
    }
}

#[inline(always)]
unsafe fn sgd8<G: Elem, Wk: Elem>(k: &SgdV, p: *mut f32, g: *const G, buf: *mut f32, w: *mut Wk) {
    // SAFETY: caller guarantees AVX2/FMA/F16C and 8 valid elements behind every non-null pointer.
    unsafe {
        let pv = _mm256_loadu_ps(p);
        let mut d = direction8(k, G::load8(g), pv);
        if !buf.is_null() {
            let b;
            (b, d) = momentum8(k, d, || _mm256_loadu_ps(buf));
            _mm256_storeu_ps(buf, b);
        }
        let pv = _mm256_sub_ps(pv, _mm256_mul_ps(k.lr, d));
        _mm256_storeu_ps(p, pv);
        if !w.is_null() {
            Wk::store8(w, pv);
        }
    }
}

/// [`sgd8`] with a bf16 buffer, widened when loaded and rounded stochastically (the low half of
/// `random`) when stored. The master's update reads the unrounded buffer.
#[inline(always)]
unsafe fn sgd8_bf16_state<G: Elem, Wk: Elem>(
    k: &SgdV,
    (p, g, buf): (*mut f32, *const G, *mut bf16),
    w: *mut Wk,
    random: __m256i,
) {
    // SAFETY: caller guarantees AVX2/FMA/F16C and 8 valid elements behind every non-null pointer.
    unsafe {
        let pv = _mm256_loadu_ps(p);
        let (b, d) = momentum8(k, direction8(k, G::load8(g), pv), || bf16::load8(buf));
        stochastic::store8(buf, b, random, false);
        let pv = _mm256_sub_ps(pv, _mm256_mul_ps(k.lr, d));
        _mm256_storeu_ps(p, pv);
        if !w.is_null() {
            Wk::store8(w, pv);
        }
    }
}

/// One SGD step on one piece.
///
/// # Safety
/// AVX2, FMA and F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn sgd<G: Elem, Wk: Elem>(s: SgdSlices<'_, G, Wk>, c: &SgdConsts) {
    // SAFETY: AVX2 enabled here.
    let k = unsafe { SgdV::new(c) };
    let SgdSlices { p, g, mut buf, mut w } = s;
    let n = p.len();
    let body = n - n % W;
    let (pp, gp) = (p.as_mut_ptr(), g.as_ptr());
    let bp = buf.as_deref_mut().map_or(null_mut(), <[f32]>::as_mut_ptr);
    let wp = w.as_deref_mut().map_or(null_mut(), <[Wk]>::as_mut_ptr);
    for i in (0..body).step_by(W) {
        // SAFETY: i + 8 <= body <= n, the length of every slice.
        unsafe { sgd8(&k, pp.add(i), gp.add(i), offset(bp, i), offset(wp, i)) };
    }
    if body < n {
        let (mut tp, tg) = (pad(&p[body..]), pad(&g[body..]));
        let mut tb = buf.as_deref().map(|x| pad(&x[body..]));
        let mut tw = w.as_deref().map(|x| pad(&x[body..]));
        // SAFETY: stack buffers of 8.
        unsafe { sgd8(&k, tp.as_mut_ptr(), tg.as_ptr(), opt_ptr(&mut tb), opt_ptr(&mut tw)) };
        p[body..].copy_from_slice(&tp[..n - body]);
        unpad(buf.map(|x| &mut x[body..]), tb);
        unpad(w.map(|x| &mut x[body..]), tw);
    }
}

/// One SGD step with a bf16 momentum buffer on one piece, element `i` rounded with the random bits of
/// index `first + i` of stream `key` (`crate::stochastic`).
///
/// # Safety
/// AVX2, FMA and F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn sgd_bf16_state<G: Elem, Wk: Elem>(
    s: SgdBf16Slices<'_, G, Wk>,
    c: &SgdConsts,
    key: u32,
    first: u32,
) {
    // SAFETY: AVX2 enabled here.
    let k = unsafe { SgdV::new(c) };
    let keys = _mm256_set1_epi32(key as i32);
    let SgdBf16Slices { p, g, buf, mut w } = s;
    let n = p.len();
    let body = n - n % W;
    let base = (p.as_mut_ptr(), g.as_ptr(), buf.as_mut_ptr());
    let wp = w.as_deref_mut().map_or(null_mut(), <[Wk]>::as_mut_ptr);
    for i in (0..body).step_by(W) {
        // SAFETY: i + 8 <= body <= n, the length of every slice.
        unsafe {
            let random = stochastic::random8(keys, first.wrapping_add(i as u32));
            sgd8_bf16_state(&k, (base.0.add(i), base.1.add(i), base.2.add(i)), offset(wp, i), random);
        }
    }
    if body < n {
        let (mut tp, tg, mut tb) = (pad(&p[body..]), pad(&g[body..]), pad(&buf[body..]));
        let mut tw = w.as_deref().map(|x| pad(&x[body..]));
        // SAFETY: stack buffers of 8; the padding lanes' results are dropped.
        unsafe {
            let random = stochastic::random8(keys, first.wrapping_add(body as u32));
            sgd8_bf16_state(&k, (tp.as_mut_ptr(), tg.as_ptr(), tb.as_mut_ptr()), opt_ptr(&mut tw), random);
        }
        p[body..].copy_from_slice(&tp[..n - body]);
        buf[body..].copy_from_slice(&tb[..n - body]);
        unpad(w.map(|x| &mut x[body..]), tw);
    }
}
