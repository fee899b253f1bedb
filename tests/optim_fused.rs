//! Fused optimizers against straightforward f64 references over 100 steps, for f32 parameters and for
//! f16/bf16 working copies with fp32 masters; AdamW against candle-nn's AdamW step for step; resume.
//!
//! Tolerance: the fused kernels run the same formulas in f32. One step adds at most a few f32 roundings
//! to each master: about 2^-24 |p| from the subtraction plus about 10 * 2^-24 * lr from the update's
//! own operations. Over T = 100 steps with |p| <= 3 and lr <= 0.01 that is below
//! 100 * (3 + 0.1) * 2^-24 ~ 2e-5, the absolute tolerance used. Gradients are given exactly in the
//! parameter's dtype (the reference reads the same rounded values), so half precision adds nothing here.

mod common;

use amp::nn::Linear;
use amp::optim::{
    AdamConfig, FusedAdam, FusedLamb, FusedOptimizer, FusedSgd, LambConfig, ParamGroups, SgdConfig,
};
use amp::{AmpConfig, AmpModule, AmpModuleExt, OptLevel, Param, Precision};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use rand::rngs::StdRng;
use rand::SeedableRng;

const STEPS: usize = 100;

/// One f64 vector per parameter.
type PerParam = Vec<Vec<f64>>;
const TOLERANCE: f64 = 2e-5;

#[derive(AmpModule)]
struct One {
    fc: Linear,
}

/// A one-layer model whose trainable weight is stored in `precision` (O2 working copy for half).
fn model(precision: Precision, seed: u64) -> amp::Result<One> {
    let mut rng = StdRng::seed_from_u64(seed);
    let weight = Param::new(Var::from_tensor(&common::randn(&mut rng, &[5, 7], 1.0)?)?);
    let bias = Param::new(Var::from_tensor(&common::randn(&mut rng, &[5], 1.0)?)?);
    let mut model = One { fc: Linear::new(weight, Some(bias)) };
    let level = if precision == Precision::Fp32 { OptLevel::O0 } else { OptLevel::O2 };
    amp::initialize(&mut model, AmpConfig { opt_level: level, half: precision })?;
    Ok(model)
}

/// Gradients equal to `g` exactly, keyed by the trainable variables: backward of `sum(w * g)`.
fn grads_equal_to(model: &One, step: usize, scale: f32) -> amp::Result<(GradStore, Vec<Vec<f64>>)> {
    let mut rng = StdRng::seed_from_u64(1000 + step as u64);
    let mut loss = Tensor::new(0f32, &Device::Cpu)?;
    let mut exact = Vec::new();
    for (_, param) in model.named_params() {
        let w = param.trainable();
        let g = (common::randn(&mut rng, w.dims(), 0.5)? * f64::from(scale))?.to_dtype(w.dtype())?;
        exact.push(
            g.to_dtype(DType::F64)?
                .flatten_all()?
                .to_vec1::<f64>()?
                .iter()
                .map(|x| x / f64::from(scale))
                .collect(),
        );
        loss = (loss + (w.as_tensor() * &g)?.to_dtype(DType::F32)?.sum_all()?)?;
    }
    Ok((loss.backward()?, exact))
}

fn masters(model: &One) -> amp::Result<Vec<Vec<f64>>> {
    model
        .named_params()
        .iter()
        .map(|(_, p)| Ok(p.master().as_tensor().to_dtype(DType::F64)?.flatten_all()?.to_vec1()?))
        .collect()
}

fn assert_close(got: &[Vec<f64>], want: &[Vec<f64>], what: &str) {
    for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
        assert!((g - w).abs() <= TOLERANCE, "{what}: {g} vs reference {w}");
    }
}

fn assert_working_is_rounded_master(model: &One) -> amp::Result<()> {
    for (path, p) in model.named_params() {
        if let Some(w) = p.working() {
            let rounded = p.master().as_tensor().to_dtype(w.dtype())?;
            let diff =
                (w.as_tensor().to_dtype(DType::F32)? - rounded.to_dtype(DType::F32)?)?.abs()?.sum_all()?;
            assert_eq!(diff.to_scalar::<f32>()?, 0.0, "{path}: working copy is the rounded master");
        }
    }
    Ok(())
}

/// Runs `optimizer` and the f64 `reference` side by side; the loss scale is applied to the gradients
/// and removed inline by the fused step.
fn run(
    precision: Precision,
    make: impl Fn(ParamGroups) -> amp::Result<Box<dyn FusedOptimizer>>,
    mut reference: impl FnMut(&mut [Vec<f64>], &[Vec<f64>], usize),
) -> amp::Result<()> {
    let model = model(precision, 3)?;
    let mut optimizer = make(ParamGroups::from_model(&model)?)?;
    let mut want = masters(&model)?;
    let scale = 1024.0;
    for step in 1..=STEPS {
        let (grads, exact) = grads_equal_to(&model, step, scale)?;
        optimizer.step_scaled(&grads, 1.0 / scale)?;
        reference(&mut want, &exact, step);
    }
    assert_close(&masters(&model)?, &want, &format!("{precision}"));
    assert_working_is_rounded_master(&model)
}

fn adam_reference(c: AdamConfig) -> impl FnMut(&mut [Vec<f64>], &[Vec<f64>], usize) {
    let (mut m, mut v, mut vmax): (PerParam, PerParam, PerParam) = Default::default();
    move |params, grads, t| {
        if m.is_empty() {
            m = grads.iter().map(|g| vec![0.0; g.len()]).collect();
            v = m.clone();
            vmax = m.clone();
        }
        for (i, (p, g)) in params.iter_mut().zip(grads).enumerate() {
            for j in 0..p.len() {
                let mut grad = g[j];
                if c.decoupled_weight_decay {
                    p[j] *= 1.0 - c.lr * c.weight_decay;
                } else {
                    grad += c.weight_decay * p[j];
                }
                m[i][j] = c.beta1 * m[i][j] + (1.0 - c.beta1) * grad;
                v[i][j] = c.beta2 * v[i][j] + (1.0 - c.beta2) * grad * grad;
                vmax[i][j] = vmax[i][j].max(v[i][j]);
                let second = if c.amsgrad { vmax[i][j] } else { v[i][j] };
                let (bc1, bc2) = (1.0 - c.beta1.powi(t as i32), 1.0 - c.beta2.powi(t as i32));
                p[j] -= c.lr * (m[i][j] / bc1) / ((second / bc2).sqrt() + c.eps);
            }
        }
    }
}

#[test]
fn adam_and_adamw_match_the_f64_reference_in_every_precision() -> amp::Result<()> {
    let configs = [
        AdamConfig { lr: 0.01, ..AdamConfig::default() },
        AdamConfig { lr: 0.01, weight_decay: 0.1, ..AdamConfig::adam() },
        AdamConfig { lr: 0.01, amsgrad: true, ..AdamConfig::default() },
    ];
    for precision in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
        for config in configs {
            run(precision, |g| Ok(Box::new(FusedAdam::new(g, config)?)), adam_reference(config))?;
        }
    }
    Ok(())
}

#[test]
fn sgd_matches_the_f64_reference_in_every_precision() -> amp::Result<()> {
    let configs = [
        SgdConfig { lr: 0.01, ..SgdConfig::default() },
        SgdConfig { lr: 0.01, momentum: 0.9, dampening: 0.1, weight_decay: 0.01, ..SgdConfig::default() },
        SgdConfig { lr: 0.01, momentum: 0.9, nesterov: true, ..SgdConfig::default() },
    ];
    for precision in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
        for c in configs {
            let mut buffers: Vec<Vec<f64>> = Vec::new();
            let reference = move |params: &mut [Vec<f64>], grads: &[Vec<f64>], t: usize| {
                if buffers.is_empty() {
                    buffers = grads.iter().map(|g| vec![0.0; g.len()]).collect();
                }
                for (i, (p, g)) in params.iter_mut().zip(grads).enumerate() {
                    for j in 0..p.len() {
                        let grad = g[j] + c.weight_decay * p[j];
                        let mut step = grad;
                        if c.momentum != 0.0 {
                            let b = &mut buffers[i][j];
                            *b = if t == 1 { grad } else { c.momentum * *b + (1.0 - c.dampening) * grad };
                            step = if c.nesterov { grad + c.momentum * *b } else { *b };
                        }
                        p[j] -= c.lr * step;
                    }
                }
            };
            run(precision, |g| Ok(Box::new(FusedSgd::new(g, c)?)), reference)?;
        }
    }
    Ok(())
}

#[test]
fn lamb_matches_the_f64_reference_in_every_precision() -> amp::Result<()> {
    let c = LambConfig { lr: 0.01, ..LambConfig::default() };
    for precision in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
        let (mut m, mut v): (PerParam, PerParam) = Default::default();
        let reference = move |params: &mut [Vec<f64>], grads: &[Vec<f64>], t: usize| {
            if m.is_empty() {
                m = grads.iter().map(|g| vec![0.0; g.len()]).collect();
                v = m.clone();
            }
            let (bc1, bc2) = (1.0 - c.beta1.powi(t as i32), 1.0 - c.beta2.powi(t as i32));
            for (i, (p, g)) in params.iter_mut().zip(grads).enumerate() {
                let update: Vec<f64> = (0..p.len())
                    .map(|j| {
                        m[i][j] = c.beta1 * m[i][j] + (1.0 - c.beta1) * g[j];
                        v[i][j] = c.beta2 * v[i][j] + (1.0 - c.beta2) * g[j] * g[j];
                        (m[i][j] / bc1) / ((v[i][j] / bc2).sqrt() + c.eps) + c.weight_decay * p[j]
                    })
                    .collect();
                let norm = |x: &[f64]| x.iter().map(|a| a * a).sum::<f64>().sqrt();
                let (pn, un) = (norm(p), norm(&update));
                let ratio = if pn > 0.0 && un > 0.0 { pn / un } else { 1.0 };
                for j in 0..p.len() {
                    p[j] -= c.lr * ratio * update[j];
                }
            }
        };
        run(precision, |g| Ok(Box::new(FusedLamb::new(g, c)?)), reference)?;
    }
    Ok(())
}

#[test]
fn adamw_matches_candle_nn_adamw_step_for_step() -> amp::Result<()> {
    use candle_nn::Optimizer;
    let ours = model(Precision::Fp32, 5)?;
    let theirs = model(Precision::Fp32, 5)?;
    let config = AdamConfig { lr: 0.01, weight_decay: 0.05, ..AdamConfig::default() };
    let mut fused = FusedAdam::new(ParamGroups::from_vars(ours.trainable_vars())?, config)?;
    let params = candle_nn::ParamsAdamW { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.05 };
    let mut reference = candle_nn::AdamW::new(theirs.trainable_vars(), params)?;
    for step in 1..=STEPS {
        let (grads, _) = grads_equal_to(&ours, step, 1.0)?;
        fused.step(&grads)?;
        let (grads, _) = grads_equal_to(&theirs, step, 1.0)?;
        reference.step(&grads)?;
        for (a, b) in masters(&ours)?.iter().flatten().zip(masters(&theirs)?.iter().flatten()) {
            assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "step {step}: {a} vs candle-nn {b}");
        }
    }
    Ok(())
}

#[test]
fn optimizer_state_resumes_exactly_through_a_checkpoint() -> amp::Result<()> {
    let config = AdamConfig { lr: 0.01, amsgrad: true, ..AdamConfig::default() };
    let straight = model(Precision::Bf16, 9)?;
    let mut straight_opt = FusedAdam::new(ParamGroups::from_model(&straight)?, config)?;
    let first = model(Precision::Bf16, 9)?;
    let mut first_opt = FusedAdam::new(ParamGroups::from_model(&first)?, config)?;
    for step in 1..=10 {
        straight_opt.step(&grads_equal_to(&straight, step, 1.0)?.0)?;
        first_opt.step(&grads_equal_to(&first, step, 1.0)?.0)?;
    }
    let path = std::env::temp_dir().join(format!("amp-optim-{}.safetensors", std::process::id()));
    amp::checkpoint::save_with(&first, &[&first_opt], &path)?;
    let mut resumed = model(Precision::Bf16, 77)?;
    let mut resumed_opt = FusedAdam::new(ParamGroups::from_model(&resumed)?, AdamConfig::default())?;
    amp::checkpoint::load_with(&mut resumed, &mut [&mut resumed_opt], &path)?;
    assert_eq!(resumed_opt.steps()?, 10);
    for step in 11..=20 {
        straight_opt.step(&grads_equal_to(&straight, step, 1.0)?.0)?;
        resumed_opt.step(&grads_equal_to(&resumed, step, 1.0)?.0)?;
    }
    assert_eq!(masters(&resumed)?, masters(&straight)?, "bit-identical after resume");
    std::fs::remove_file(path).ok();
    Ok(())
}

#[test]
fn o3_models_and_half_variables_are_refused_with_the_fix() -> amp::Result<()> {
    let mut pure = model(Precision::Fp32, 1)?;
    amp::initialize(&mut pure, AmpConfig { opt_level: OptLevel::O3, half: Precision::Bf16 })?;
    let err = ParamGroups::from_model(&pure).unwrap_err().to_string();
    assert!(err.contains("fc.weight") && err.contains("O2"), "{err}");
    let half = Var::zeros(3, DType::F16, &Device::Cpu)?;
    let err = ParamGroups::from_vars([half]).unwrap_err().to_string();
    assert!(err.contains("param.0") && err.contains("fp16"), "{err}");
    Ok(())
}

#[test]
fn optimizer_state_is_accounted_in_the_precision_plan() -> amp::Result<()> {
    let model = model(Precision::Bf16, 2)?;
    let params = model.precision_plan().params();
    let adam = FusedAdam::new(ParamGroups::from_model(&model)?, AdamConfig::default())?;
    let amsgrad =
        FusedAdam::new(ParamGroups::from_model(&model)?, AdamConfig { amsgrad: true, ..Default::default() })?;
    let sgd =
        FusedSgd::new(ParamGroups::from_model(&model)?, SgdConfig { momentum: 0.9, ..Default::default() })?;
    assert_eq!(adam.state_bytes(), 8 * params, "two fp32 moments");
    assert_eq!(amsgrad.state_bytes(), 12 * params, "plus the running maximum");
    assert_eq!(sgd.state_bytes(), 4 * params, "one fp32 momentum buffer");
    let plan = model.precision_plan().with_optimizer_state(adam.state_bytes());
    assert!(plan.to_string().contains(&format!("optimizer state{}", "")), "{plan}");
    assert!(plan.to_string().contains(&(8 * params).to_string()), "{plan}");
    Ok(())
}

#[test]
fn clipping_by_value_and_varmap_parameters() -> amp::Result<()> {
    use amp::optim::clip_grad_value;
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let w = vb.get_with_hints((4, 4), "w", candle_nn::init::Init::Const(1.0))?;
    let b = vb.get_with_hints(4, "b", candle_nn::init::Init::Const(0.0))?;
    let groups = ParamGroups::from_varmap(&varmap)?;
    let names: Vec<&str> = groups.params().iter().map(|p| p.path.as_str()).collect();
    assert_eq!(names, ["b", "w"], "VarMap parameters by name");
    let mut sgd = FusedSgd::new(groups, SgdConfig { lr: 1.0, ..SgdConfig::default() })?;
    // Gradients 3 * 8 = 24 per element (scaled by 8), clipped to 0.5 in unscaled units.
    let loss = ((w.sum_all()? + b.sum_all()?)? * 24.0)?;
    let grads = loss.backward()?;
    clip_grad_value(&sgd, &grads, 0.5, 1.0 / 8.0)?;
    let g = grads.get(&w).expect("gradient").flatten_all()?.to_vec1::<f32>()?;
    assert!(g.iter().all(|&x| x == 4.0), "clamped at 0.5 * 8 in scaled units: {g:?}");
    sgd.step_scaled(&grads, 1.0 / 8.0)?;
    let w_after = w.flatten_all()?.to_vec1::<f32>()?;
    assert!(w_after.iter().all(|&x| x == 0.5), "SGD moved each weight by lr * 0.5: {w_after:?}");
    Ok(())
}
