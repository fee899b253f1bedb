//! AVX2 LAMB kernels over one piece of one tensor (formulas in [`crate::optim`]'s LAMB module). Same
//! f32 operations, in the same order, as `crate::portable::lamb`. Tails run the 8-lane code on
//! zero-padded stack copies; padding lanes are masked out of the norms. The moments are f32 or bf16
//! ([`Moment`]); bf16 ones are widened when loaded and rounded stochastically when stored, and the
//! update is computed from the values stored, so that pass 2 recomputes the very `u` pass 1 measured.

use std::arch::x86_64::{
    __m256, __m256d, __m256i, _mm256_add_ps, _mm256_and_ps, _mm256_castsi256_ps, _mm256_cmpgt_epi32,
    _mm256_div_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_epi32, _mm256_set1_ps, _mm256_setr_epi32,
    _mm256_setzero_pd, _mm256_setzero_si256, _mm256_sqrt_ps, _mm256_storeu_ps, _mm256_sub_ps,
};
use std::ptr::null_mut;

use half::bf16;

use super::kernels::lanes_sum;
use super::{add_squares, offset, opt_ptr, pad, stochastic, unpad, Elem, W};
use crate::optim::LambConsts;

/// How pass 1 keeps a moment it computed: f32 as it is, bf16 rounded stochastically
/// (`crate::stochastic`).
pub(crate) trait Moment: Elem {
    /// Whether [`Moment::keep8`] uses its random bits (the caller draws them only then).
    const ROUNDS: bool;

    /// Stores `x` at `dst` (with the low half of `random`'s lanes, or the high half when `high`, if it
    /// rounds) and returns the values stored, as f32.
    ///
    /// # Safety
    /// AVX2 available; `dst` valid for writing 8 elements.
    unsafe fn keep8(dst: *mut Self, x: __m256, random: __m256i, high: bool) -> __m256;
}

impl Moment for f32 {
    const ROUNDS: bool = false;

    #[inline(always)]
    unsafe fn keep8(dst: *mut f32, x: __m256, _: __m256i, _: bool) -> __m256 {
        // SAFETY: caller guarantees AVX and 8 writable floats.
        unsafe { _mm256_storeu_ps(dst, x) };
        x
    }
}

impl Moment for bf16 {
    const ROUNDS: bool = true;

    #[inline(always)]
    unsafe fn keep8(dst: *mut bf16, x: __m256, random: __m256i, high: bool) -> __m256 {
        // SAFETY: caller guarantees AVX2 and 8 writable elements.
        unsafe { stochastic::store8(dst, x, random, high) }
    }
}

/// The random bits of indices `first + 0..8` of stream `key`, when `M` rounds.
#[inline(always)]
unsafe fn random8<M: Moment>(key: u32, first: u32) -> __m256i {
    // SAFETY: caller guarantees AVX2.
    unsafe {
        if M::ROUNDS {
            stochastic::random8(_mm256_set1_epi32(key as i32), first)
        } else {
            _mm256_setzero_si256()
        }
    }
}

struct LambV {
    inv_scale: __m256,
    weight_decay: __m256,
    beta1: __m256,
    beta3: __m256,
    beta2: __m256,
    one_minus_beta2: __m256,
    bias_correction1: __m256,
    bias_correction2: __m256,
    eps: __m256,
    l2: bool,
    decoupled: bool,
}

impl LambV {
    #[inline(always)]
    unsafe fn new(c: &LambConsts) -> LambV {
        // SAFETY: caller guarantees AVX.
        unsafe {
            LambV {
                inv_scale: _mm256_set1_ps(c.inv_scale),
                weight_decay: _mm256_set1_ps(c.weight_decay),
                beta1: _mm256_set1_ps(c.beta1),
                beta3: _mm256_set1_ps(c.beta3),
                beta2: _mm256_set1_ps(c.beta2),
                one_minus_beta2: _mm256_set1_ps(c.one_minus_beta2),
                bias_correction1: _mm256_set1_ps(c.bias_correction1),
                bias_correction2: _mm256_set1_ps(c.bias_correction2),
                eps: _mm256_set1_ps(c.eps),
                l2: c.l2,
                decoupled: c.decoupled,
            }
        }
    }

    /// The update `u` from the new moments and the pre-step master.
    #[inline(always)]
    unsafe fn update(&self, p: __m256, m: __m256, v: __m256) -> __m256 {
        // SAFETY: caller guarantees AVX.
        unsafe {
            let denom = _mm256_add_ps(_mm256_sqrt_ps(_mm256_div_ps(v, self.bias_correction2)), self.eps);
            let u = _mm256_div_ps(_mm256_div_ps(m, self.bias_correction1), denom);
            if self.decoupled {
                _mm256_add_ps(u, _mm256_mul_ps(self.weight_decay, p))
            } else {
                u
            }
        }
    }
}

/// Pass 1 on 8 elements; `valid` masks the lanes whose `u²` counts; `random` rounds bf16 moments (`m`
/// with its low half, `v` with its high half).
#[inline(always)]
unsafe fn moments8<G: Elem, M: Moment>(
    k: &LambV,
    (p, g, m, v): (*const f32, *const G, *mut M, *mut M),
    (valid, random): (__m256, __m256i),
    acc: (&mut [__m256d; 2], &mut [__m256d; 2]),
) {
    // SAFETY: caller guarantees AVX2/FMA/F16C and 8 valid elements behind every pointer.
    unsafe {
        let pv = _mm256_loadu_ps(p);
        let mut gv = _mm256_mul_ps(G::load8(g), k.inv_scale);
        if k.l2 {
            gv = _mm256_add_ps(gv, _mm256_mul_ps(k.weight_decay, pv));
        }
        let mv = _mm256_add_ps(_mm256_mul_ps(M::load8(m), k.beta1), _mm256_mul_ps(k.beta3, gv));
        let vv = _mm256_mul_ps(M::load8(v), k.beta2);
        let vv = _mm256_add_ps(vv, _mm256_mul_ps(_mm256_mul_ps(k.one_minus_beta2, gv), gv));
        let mv = M::keep8(m, mv, random, false);
        let vv = M::keep8(v, vv, random, true);
        add_squares(acc.0, pv);
        add_squares(acc.1, _mm256_and_ps(k.update(pv, mv, vv), valid));
    }
}

/// LAMB pass 1 on one piece: updates `m`, `v`; returns the f64 sums of `p²` and `u²` (16 lanes each).
/// bf16 moments of element `i` round with the random bits of index `first + i` of stream `key`.
///
/// # Safety
/// AVX2, FMA and F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn lamb_moments<G: Elem, M: Moment>(
    p: &[f32],
    g: &[G],
    m: &mut [M],
    v: &mut [M],
    c: &LambConsts,
    (key, first): (u32, u32),
) -> [f64; 2] {
    // SAFETY: features checked by the caller.
    let k = unsafe { LambV::new(c) };
    let mut acc_p = [[_mm256_setzero_pd(); 2]; 2];
    let mut acc_u = [[_mm256_setzero_pd(); 2]; 2];
    let all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    let n = p.len();
    let body = n - n % (2 * W);
    let base = (p.as_ptr(), g.as_ptr(), m.as_mut_ptr(), v.as_mut_ptr());
    for i in (0..body).step_by(2 * W) {
        for h in 0..2 {
            let j = i + h * W;
            // SAFETY: j + 8 <= body <= n, the length of every slice.
            unsafe {
                let at = (base.0.add(j), base.1.add(j), base.2.add(j), base.3.add(j));
                let random = random8::<M>(key, first.wrapping_add(j as u32));
                moments8(&k, at, (all, random), (&mut acc_p[h], &mut acc_u[h]));
            }
        }
    }
    let r = n - body;
    for h in 0..2 {
        let (lo, hi) = (body + (h * W).min(r), body + ((h + 1) * W).min(r));
        let (tp, tg, mut tm, mut tv) = (pad(&p[lo..hi]), pad(&g[lo..hi]), pad(&m[lo..hi]), pad(&v[lo..hi]));
        let valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_set1_epi32((hi - lo) as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        ));
        // SAFETY: stack buffers of 8.
        unsafe {
            let at = (tp.as_ptr(), tg.as_ptr(), tm.as_mut_ptr(), tv.as_mut_ptr());
            let random = random8::<M>(key, first.wrapping_add(lo as u32));
            moments8(&k, at, (valid, random), (&mut acc_p[h], &mut acc_u[h]));
        }
        m[lo..hi].copy_from_slice(&tm[..hi - lo]);
        v[lo..hi].copy_from_slice(&tv[..hi - lo]);
    }
    // SAFETY: features checked by the caller.
    unsafe { [lanes_sum(&acc_p), lanes_sum(&acc_u)] }
}

/// LAMB pass 2 on one piece: `p -= ratio * u`, working copy from `p`.
///
/// # Safety
/// AVX2, FMA and F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn lamb_apply<Wk: Elem, M: Elem>(
    p: &mut [f32],
    m: &[M],
    v: &[M],
    mut w: Option<&mut [Wk]>,
    ratio: f32,
    c: &LambConsts,
) {
    // SAFETY: features checked by the caller.
    let k = unsafe { LambV::new(c) };
    let rv = _mm256_set1_ps(ratio);
    let step = |p: *mut f32, m: *const M, v: *const M, w: *mut Wk| {
        // SAFETY: 8 valid elements behind every non-null pointer (checked at each call site).
        unsafe {
            let pv = _mm256_loadu_ps(p);
            let pn = _mm256_sub_ps(pv, _mm256_mul_ps(rv, k.update(pv, M::load8(m), M::load8(v))));
            _mm256_storeu_ps(p, pn);
            if !w.is_null() {
                Wk::store8(w, pn);
            }
        }
    };
    let n = p.len();
    let body = n - n % W;
    let (pp, mp, vp) = (p.as_mut_ptr(), m.as_ptr(), v.as_ptr());
    let wp = w.as_deref_mut().map_or(null_mut(), <[Wk]>::as_mut_ptr);
    for i in (0..body).step_by(W) {
        // SAFETY: i + 8 <= body <= n, the length of every slice.
        step(unsafe { pp.add(i) }, unsafe { mp.add(i) }, unsafe { vp.add(i) }, offset(wp, i));
    }
    if body < n {
        let (mut tp, tm, tv) = (pad(&p[body..]), pad(&m[body..]), pad(&v[body..]));
        let mut tw = w.as_deref().map(|x| pad(&x[body..]));
        step(tp.as_mut_ptr(), tm.as_ptr(), tv.as_ptr(), opt_ptr(&mut tw));
        p[body..].copy_from_slice(&tp[..n - body]);
        unpad(w.map(|x| &mut x[body..]), tw);
    }
}
