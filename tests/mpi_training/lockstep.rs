//! One optimizer step from one state with two gradients: a shadow model that copies a run's masters and
//! optimizer state, steps on the whole batch, and a derived bound on how far apart the two steps can put
//! each master.
//!
//! AdamW and LAMB both apply Adam's normalised moment `r = (m / bc1) / (sqrt(v / bc2) + eps)` with
//! `m = b1 m0 + (1 - b1) g`, `v = b2 v0 + (1 - b2) g^2`. Between two gradients `g`, `g'` (same `m0`,
//! `v0`), by the mean value theorem `|r(g) - r(g')| <= L |g - g'|` with, over the interval,
//! `L = (1 - b1) / (bc1 D) + N sqrt(1 - b2) / (bc1 sqrt(bc2) D^2)`, `D = sqrt(b2 v0 / bc2) + eps` the
//! smallest denominator and `N = b1 |m0| + (1 - b1) max(|g|, |g'|)` the largest numerator (the second
//! term uses `sqrt(v) >= sqrt(1 - b2) |g|`). It is large exactly where Adam amplifies: `v0` tiny. Each
//! side's f32 evaluation of `r` errs by at most `10 u32 N / (bc1 D)` (the numerator's two products and
//! sum, then five operations), and writing the master rounds once more.
//!
//! - AdamW: `w' = w (1 - lr wd) - lr r` with the same `w`: the masters differ by at most
//!   `lr (L |g - g'| + 20 u32 N / (bc1 D)) + 4 u32 (|w| + lr N / (bc1 D))`.
//! - LAMB: `w' = w - lr (||w|| / ||u||) u`, `u = r + wd w`: with `e` the bound above on `|u_i - u'_i|` and
//!   `E = ||e||`, the trust ratios differ by at most `lr ||w|| E / (||u|| (||u|| - E))` (plus 4 u32 of
//!   it for the norms' rounding), so the masters differ by at most
//!   `ratio e_i + (|u_i| + e_i) d_ratio + 4 u32 (|w_i| + ratio (|u_i| + e_i))`.

use amp::optim::ParamGroups;
use amp::scaler::ScalerConfig;
use amp::{AmpModuleExt, GradScaler, Precision};
use candle_core::DType;

use super::{loss, mlp, Kind, Optimizer};

const B1: f64 = 0.9;
const B2: f64 = 0.999;
const U32: f64 = 1.0 / (1u64 << 24) as f64;

/// A model and optimizer that take, from another run's state, the step on the whole 16-row batch.
#[derive(Debug)]
pub struct Shadow {
    model: Vec<amp::nn::Linear>,
    optimizer: Optimizer,
}

impl Shadow {
    /// A shadow for runs of `kind` on an MLP in `half`.
    pub fn new(half: Precision, kind: Kind) -> amp::Result<Self> {
        let model = mlp(half, 0)?;
        let optimizer = Optimizer::new(kind, ParamGroups::from_model(&model)?)?;
        Ok(Shadow { model, optimizer })
    }

    /// Copies `net`'s masters (and so its working copies) and `optimizer`'s state, then steps on all 16
    /// rows of step `step`'s batch with the loss scale `scale` (`None`: no scaling, as for bf16).
    /// Returns whether the step was applied.
    pub fn step_from(
        &mut self,
        net: &Vec<amp::nn::Linear>,
        optimizer: &Optimizer,
        scale: Option<f32>,
        step: u64,
    ) -> amp::Result<bool> {
        for ((_, mine), (_, theirs)) in self.model.named_params().iter().zip(net.named_params()) {
            mine.master().set(&theirs.master().as_tensor().copy()?)?;
            mine.refresh_working()?;
        }
        self.optimizer.state_mut().restore_state(optimizer.state().save_state()?)?;
        let mut scaler = match scale {
            Some(scale) => GradScaler::new(ScalerConfig::fixed(scale))?,
            None => GradScaler::disabled(),
        };
        Ok(scaler.step_fused(&loss(&self.model, step, 0..16)?, self.optimizer.fused(), None)?.applied())
    }

    /// The shadow's masters after its step.
    pub fn masters(&self) -> amp::Result<Vec<Vec<f32>>> {
        super::masters(&self.model)
    }
}

/// The optimizer's `exp_avg` and `exp_avg_sq` per parameter of `net`, in model order.
pub fn moments(net: &Vec<amp::nn::Linear>, optimizer: &Optimizer) -> amp::Result<[Vec<Vec<f32>>; 2]> {
    let saved = optimizer.state().save_state()?;
    let find = |name: String| -> amp::Result<Vec<f32>> {
        let (_, t) = saved
            .tensors
            .iter()
            .find(|(n, _)| *n == name)
            .ok_or_else(|| amp::Error::Internal { what: format!("no state tensor {name}") })?;
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let paths: Vec<String> = net.named_params().into_iter().map(|(path, _)| path).collect();
    let m = paths.iter().map(|p| find(format!("{p}/exp_avg"))).collect::<amp::Result<_>>()?;
    let v = paths.iter().map(|p| find(format!("{p}/exp_avg_sq"))).collect::<amp::Result<_>>()?;
    Ok([m, v])
}

/// One tensor's state and gradients around a step: masters before, moments before and after (the
/// run's), and the two unscaled gradients.
#[derive(Debug)]
pub struct StepAround<'a> {
    /// Masters before the step.
    pub w: &'a [f32],
    /// `exp_avg`, `exp_avg_sq` before the step.
    pub m0: &'a [f32],
    /// See `m0`.
    pub v0: &'a [f32],
    /// `exp_avg`, `exp_avg_sq` after the run's step (LAMB's update is measured from them).
    pub m1: &'a [f32],
    /// See `m1`.
    pub v1: &'a [f32],
    /// The run's gradient and the shadow's, unscaled.
    pub g: &'a [f64],
    /// See `g`.
    pub g2: &'a [f64],
}

/// Per element of one tensor, the bound on `|run's master - shadow's master|` after step number `t`
/// (module docs), for `kind` with learning rate `lr` and weight decay `wd`.
pub fn master_bounds(kind: Kind, t: u64, lr: f64, wd: f64, s: &StepAround<'_>) -> Vec<f64> {
    let eps = match kind {
        Kind::AdamW => 1e-8,
        Kind::Lamb => 1e-6,
    };
    let (bc1, bc2) = (1.0 - B1.powi(t as i32), 1.0 - B2.powi(t as i32));
    let n = s.w.len();
    // Per element: e (bound on |r - r'| with both roundings) and N / (bc1 D) (bound on |r|).
    let (mut e, mut r_max) = (vec![0.0; n], vec![0.0; n]);
    for i in 0..n {
        let d = (B2 * f64::from(s.v0[i]) / bc2).sqrt() + eps;
        let big_n = B1 * f64::from(s.m0[i]).abs() + (1.0 - B1) * s.g[i].abs().max(s.g2[i].abs());
        let lip = (1.0 - B1) / (bc1 * d) + big_n * (1.0 - B2).sqrt() / (bc1 * bc2.sqrt() * d * d);
        r_max[i] = big_n / (bc1 * d);
        e[i] = lip * (s.g[i] - s.g2[i]).abs() + 20.0 * U32 * r_max[i];
    }
    let w = |i: usize| f64::from(s.w[i]);
    match kind {
        Kind::AdamW => (0..n).map(|i| lr * e[i] + 4.0 * U32 * (w(i).abs() + lr * r_max[i])).collect(),
        Kind::Lamb => {
            let u: Vec<f64> = (0..n)
                .map(|i| {
                    let r = (f64::from(s.m1[i]) / bc1) / ((f64::from(s.v1[i]) / bc2).sqrt() + eps);
                    r + wd * w(i)
                })
                .collect();
            let norm = |x: &mut dyn Iterator<Item = f64>| x.map(|v| v * v).sum::<f64>().sqrt();
            let (nu, nw, big_e) =
                (norm(&mut u.iter().copied()), norm(&mut (0..n).map(w)), norm(&mut e.iter().copied()));
            if nu <= 2.0 * big_e {
                // The trust ratio is not pinned down: each step moves a master by at most lr ||w||.
                return vec![2.0 * lr * nw; n];
            }
            let ratio = lr * nw / nu;
            let d_ratio = lr * nw * big_e / (nu * (nu - big_e)) + 4.0 * U32 * ratio;
            (0..n)
                .map(|i| {
                    let u_i = u[i].abs() + e[i];
                    ratio * e[i] + u_i * d_ratio + 4.0 * U32 * (w(i).abs() + ratio * u_i)
                })
                .collect()
        }
    }
}
