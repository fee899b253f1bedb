//! Scalar reference optimizer steps, written from the formulas in [`crate::optim`]'s modules: f32
//! arithmetic with one rounding per operation (bit-exact oracle), and Adam in f64 (formula check).

use super::{get, set_half};
use crate::optim::{
    sgd_step_key, step_key, AdamBf16Tensor, AdamParams, AdamTensor, LambBf16Tensor, LambParams, LambTensor,
    SgdBf16Tensor, SgdParams, SgdTensor, TensorNorms,
};
use crate::stochastic::{random_bits, round_bf16};
use crate::{GradSlice, HalfSliceMut};

/// `(1 - beta1^t, 1 - beta2^t)` in f64, or `(1, 1)` without bias correction.
fn bias_corrections(beta1: f64, beta2: f64, step: u64, on: bool) -> (f64, f64) {
    if on {
        let t = step as f64;
        (1.0 - beta1.powf(t), 1.0 - beta2.powf(t))
    } else {
        (1.0, 1.0)
    }
}

/// Reference [`crate::optim::adam_step`], element by element in f32.
pub fn adam_step(tensors: &mut [AdamTensor<'_>], hp: &AdamParams, inv_grad_scale: f32) {
    let (bc1, bc2) = bias_corrections(hp.beta1, hp.beta2, hp.step, hp.bias_correction);
    let step_size = (hp.lr / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    let (beta2, eps, wd) = (hp.beta2 as f32, hp.eps as f32, hp.weight_decay as f32);
    let (one_minus_beta1, one_minus_beta2) = ((1.0 - hp.beta1) as f32, (1.0 - hp.beta2) as f32);
    let decay = (1.0 - hp.lr * hp.weight_decay) as f32;
    for t in tensors {
        for i in 0..t.master.len() {
            let mut g = get(t.grad, i) * inv_grad_scale;
            let mut p = t.master[i];
            if hp.weight_decay != 0.0 {
                if hp.decoupled_weight_decay {
                    p *= decay;
                } else {
                    g += wd * p;
                }
            }
            let m = t.exp_avg[i];
            let m = m + one_minus_beta1 * (g - m);
            let v = t.exp_avg_sq[i] * beta2 + (one_minus_beta2 * g) * g;
            t.exp_avg[i] = m;
            t.exp_avg_sq[i] = v;
            let v_eff = match t.max_exp_avg_sq.as_deref_mut() {
                Some(vmax) => {
                    vmax[i] = if vmax[i] > v { vmax[i] } else { v };
                    vmax[i]
                }
                None => v,
            };
            let denom = v_eff.sqrt() / bc2_sqrt + eps;
            p -= (step_size * m) / denom;
            t.master[i] = p;
            if let Some(w) = t.working.as_mut() {
                set_half(w, i, p);
            }
        }
    }
}

/// Reference [`crate::optim::adam_step_bf16_state`]: element by element, the moments widened, the f32
/// formula of [`adam_step`], the moments rounded back with the random bits of the element's index in
/// its tensor ([`crate::stochastic::round_bf16`], [`crate::stochastic::random_bits`]): their low half
/// for `m`, their high half for `v`.
pub fn adam_step_bf16_state(tensors: &mut [AdamBf16Tensor<'_>], hp: &AdamParams, inv_grad_scale: f32) {
    assert!(!hp.amsgrad, "bf16 moments: no AMSGrad");
    for t in tensors {
        let key = step_key(t.stream, hp.step);
        for i in 0..t.master.len() {
            let (mut m, mut v) = ([t.exp_avg[i].to_f32()], [t.exp_avg_sq[i].to_f32()]);
            let one = AdamTensor {
                master: &mut t.master[i..=i],
                grad: t.grad.split_at(i).1.split_at(1).0,
                exp_avg: &mut m,
                exp_avg_sq: &mut v,
                max_exp_avg_sq: None,
                working: t.working.as_mut().map(|w| w.reborrow().split_at(i).1.split_at(1).0),
            };
            adam_step(&mut [one], hp, inv_grad_scale);
            let random = random_bits(key, i as u64);
            t.exp_avg[i] = round_bf16(m[0], random);
            t.exp_avg_sq[i] = round_bf16(v[0], random >> 16);
        }
    }
}

/// Adam / AdamW on one tensor entirely in f64 (state in f64 too), to check the f32 kernels' formulas
/// within a rounding tolerance. `vmax` is used exactly when `hp.amsgrad`.
pub fn adam_step_f64(
    p: &mut [f64],
    g: &[f64],
    m: &mut [f64],
    v: &mut [f64],
    mut vmax: Option<&mut [f64]>,
    hp: &AdamParams,
    inv_grad_scale: f64,
) {
    let (bc1, bc2) = bias_corrections(hp.beta1, hp.beta2, hp.step, hp.bias_correction);
    for i in 0..p.len() {
        let mut gi = g[i] * inv_grad_scale;
        if hp.decoupled_weight_decay {
            p[i] *= 1.0 - hp.lr * hp.weight_decay;
        } else {
            gi += hp.weight_decay * p[i];
        }
        m[i] = hp.beta1 * m[i] + (1.0 - hp.beta1) * gi;
        v[i] = hp.beta2 * v[i] + (1.0 - hp.beta2) * gi * gi;
        let v_eff = match vmax.as_deref_mut() {
            Some(x) if hp.amsgrad => {
                x[i] = x[i].max(v[i]);
                x[i]
            }
            _ => v[i],
        };
        p[i] -= hp.lr / bc1 * m[i] / (v_eff.sqrt() / bc2.sqrt() + hp.eps);
    }
}

/// Reference [`crate::optim::sgd_step`], element by element in f32.
pub fn sgd_step(tensors: &mut [SgdTensor<'_>], hp: &SgdParams, inv_grad_scale: f32) {
    let (lr, wd, mom) = (hp.lr as f32, hp.weight_decay as f32, hp.momentum as f32);
    let one_minus_dampening = (1.0 - hp.dampening) as f32;
    for t in tensors {
        for i in 0..t.master.len() {
            let mut d = get(t.grad, i) * inv_grad_scale;
            if hp.weight_decay != 0.0 {
                d += wd * t.master[i];
            }
            if let Some(buf) = t.momentum_buffer.as_deref_mut() {
                buf[i] = if hp.first_step { d } else { buf[i] * mom + one_minus_dampening * d };
                d = if hp.nesterov { d + mom * buf[i] } else { buf[i] };
            }
            t.master[i] -= lr * d;
            if let Some(w) = t.working.as_mut() {
                set_half(w, i, t.master[i]);
            }
        }
    }
}

/// Reference [`crate::optim::sgd_step_bf16_state`]: element by element, the buffer widened, the f32
/// formula of [`sgd_step`], the buffer rounded back with the low half of the random bits of the
/// element's index in its tensor.
pub fn sgd_step_bf16_state(
    tensors: &mut [SgdBf16Tensor<'_>],
    hp: &SgdParams,
    step: u64,
    inv_grad_scale: f32,
) {
    assert!(hp.momentum != 0.0, "a bf16 momentum buffer needs momentum");
    for t in tensors {
        let key = sgd_step_key(t.stream, step);
        for i in 0..t.master.len() {
            let mut b = [t.momentum_buffer[i].to_f32()];
            let one = SgdTensor {
                master: &mut t.master[i..=i],
                grad: t.grad.split_at(i).1.split_at(1).0,
                momentum_buffer: Some(&mut b),
                working: t.working.as_mut().map(|w| w.reborrow().split_at(i).1.split_at(1).0),
            };
            sgd_step(&mut [one], hp, inv_grad_scale);
            t.momentum_buffer[i] = round_bf16(b[0], random_bits(key, i as u64));
        }
    }
}

/// Reference [`crate::optim::lamb_step`]: moments and norms (sequential f64 sums), then the update with
/// the trust ratio, element by element in f32.
pub fn lamb_step(
    tensors: &mut [LambTensor<'_>],
    hp: &LambParams,
    inv_grad_scale: f32,
    norms: &mut [TensorNorms],
) {
    let lamb = Lamb::new(hp, inv_grad_scale);
    for (t, norm) in tensors.iter_mut().zip(norms) {
        let (m, v) = (&mut *t.exp_avg, &mut *t.exp_avg_sq);
        let moments = |i: usize, advance: Advance<'_>| {
            (m[i], v[i]) = advance((m[i], v[i]));
            (m[i], v[i])
        };
        *norm = lamb.moments(t.master, t.grad, moments);
        let moments = |i: usize| (t.exp_avg[i], t.exp_avg_sq[i]);
        lamb.apply(*norm, t.master, t.working.as_mut(), moments);
    }
}

/// Reference [`crate::optim::lamb_step_bf16_state`]: [`lamb_step`] with each updated moment rounded
/// stochastically (element `i` with [`random_bits`] of its index in the tensor's stream,
/// [`step_key`]: the low half for `m`, the high half for `v`) before `u` is computed from it.
pub fn lamb_step_bf16_state(
    tensors: &mut [LambBf16Tensor<'_>],
    hp: &LambParams,
    inv_grad_scale: f32,
    norms: &mut [TensorNorms],
) {
    let lamb = Lamb::new(hp, inv_grad_scale);
    for (t, norm) in tensors.iter_mut().zip(norms) {
        let key = step_key(t.stream, hp.step);
        let (m, v) = (&mut *t.exp_avg, &mut *t.exp_avg_sq);
        let moments = |i: usize, advance: Advance<'_>| {
            let (mi, vi) = advance((m[i].to_f32(), v[i].to_f32()));
            let random = random_bits(key, i as u64);
            (m[i], v[i]) = (round_bf16(mi, random), round_bf16(vi, random >> 16));
            (m[i].to_f32(), v[i].to_f32())
        };
        *norm = lamb.moments(t.master, t.grad, moments);
        let moments = |i: usize| (t.exp_avg[i].to_f32(), t.exp_avg_sq[i].to_f32());
        lamb.apply(*norm, t.master, t.working.as_mut(), moments);
    }
}

/// Element `(m, v)` to its new values, in f32. The moments' stores take one, apply it to element `i`,
/// keep the result and return what they kept.
type Advance<'a> = &'a dyn Fn((f32, f32)) -> (f32, f32);

/// LAMB's constants in f32 and its two passes over one tensor.
struct Lamb {
    bc1: f32,
    bc2: f32,
    beta1: f32,
    beta2: f32,
    beta3: f32,
    one_minus_beta2: f32,
    eps: f32,
    wd: f32,
    /// Weight decay added to the gradient (L2 mode).
    l2: bool,
    /// Weight decay added to the update (decoupled mode).
    decoupled: bool,
    adapt: bool,
    lr: f32,
    inv_grad_scale: f32,
}

impl Lamb {
    fn new(hp: &LambParams, inv_grad_scale: f32) -> Lamb {
        let (bc1, bc2) = bias_corrections(hp.beta1, hp.beta2, hp.step, hp.bias_correction);
        let has_wd = hp.weight_decay != 0.0;
        Lamb {
            bc1: bc1 as f32,
            bc2: bc2 as f32,
            beta1: hp.beta1 as f32,
            beta2: hp.beta2 as f32,
            beta3: if hp.grad_averaging { (1.0 - hp.beta1) as f32 } else { 1.0 },
            one_minus_beta2: (1.0 - hp.beta2) as f32,
            eps: hp.eps as f32,
            wd: hp.weight_decay as f32,
            l2: !hp.decoupled_weight_decay && has_wd,
            decoupled: hp.decoupled_weight_decay && has_wd,
            adapt: hp.always_adapt || has_wd,
            lr: hp.lr as f32,
            inv_grad_scale,
        }
    }

    /// The update `u` of an element.
    fn update(&self, p: f32, (m, v): (f32, f32)) -> f32 {
        let u = (m / self.bc1) / ((v / self.bc2).sqrt() + self.eps);
        if self.decoupled {
            u + self.wd * p
        } else {
            u
        }
    }

    /// Pass 1: the new moments and the norms of `p` and of `u` (from the moments kept).
    fn moments(
        &self,
        master: &[f32],
        grad: GradSlice<'_>,
        mut moments: impl FnMut(usize, Advance<'_>) -> (f32, f32),
    ) -> TensorNorms {
        let (mut sum_p, mut sum_u) = (0f64, 0f64);
        for (i, &p) in master.iter().enumerate() {
            let mut g = get(grad, i) * self.inv_grad_scale;
            if self.l2 {
                g += self.wd * p;
            }
            let advance = |(m, v): (f32, f32)| {
                (m * self.beta1 + self.beta3 * g, v * self.beta2 + (self.one_minus_beta2 * g) * g)
            };
            let kept = moments(i, &advance);
            sum_p += f64::from(p) * f64::from(p);
            sum_u += f64::from(self.update(p, kept)).powi(2);
        }
        TensorNorms { param: sum_p.sqrt() as f32, update: sum_u.sqrt() as f32 }
    }

    /// Pass 2: `p -= ratio * u`, the working copy from `p`.
    fn apply(
        &self,
        norm: TensorNorms,
        master: &mut [f32],
        mut working: Option<&mut HalfSliceMut<'_>>,
        moments: impl Fn(usize) -> (f32, f32),
    ) {
        let adapt = self.adapt && norm.param != 0.0 && norm.update != 0.0;
        let ratio = if adapt { self.lr * (norm.param / norm.update) } else { self.lr };
        for (i, p) in master.iter_mut().enumerate() {
            *p -= ratio * self.update(*p, moments(i));
            if let Some(w) = working.as_mut() {
                set_half(w, i, *p);
            }
        }
    }
}
