//! Adam and LAMB with bf16 moments (`AdamConfig::state_dtype = StateDtype::Bf16`, `LambConfig`'s) and
//! SGD with a bf16 momentum buffer (`SgdConfig::state_dtype`): half the optimizer's memory, the masters still f32, the step's
//! effect within its rounding noise of an f64 reference, exact resume from a checkpoint, a non-finite
//! step that changes nothing, and the settings it cannot serve refused.
//!
//! Tolerance of the f64 comparison: with bf16 moments each element's step size carries noise (the
//! second moment's stochastic rounding: about 5% of `v`, so about 2.5% of the step; see
//! `kernels/tests/adam_bf16.rs`), independent from element to element and from step to step once the
//! average has forgotten it (a few thousand steps for `beta2 = 0.999`). Over T steps each master's
//! error is then a sum of T noisy steps: well under 2.5% of the distance it moved in f64. The test
//! asserts the mean error over all elements is under 2% of the mean distance moved (measured 0.8%; f32
//! moments 0.0014%, held under 0.01%), and that the mean signed error is near 0 (no drift: measured
//! 0.005% of the distance, held under 0.5%). SGD's buffer (momentum 0.9) is a shorter average with less
//! noise: the same bounds hold with room (measured 0.46%, Nesterov 0.42%; f32 buffer 0.00004%). LAMB's
//! step is Adam's direction scaled per tensor by `||w|| / ||u||`: the same per-element noise, and a
//! ratio whose own noise averages over the tensor's elements (measured 0.86%; f32 moments 0.00006%).

mod common;

use amp::checkpoint::{SavedState, TrainingState};
use amp::nn::Linear;
use amp::optim::{
    AdamConfig, FusedAdam, FusedLamb, FusedOptimizer, FusedSgd, LambConfig, ParamGroups, SgdConfig,
    StateDtype,
};
use amp::scaler::ScalerConfig;
use amp::{AmpConfig, AmpModule, AmpModuleExt, GradScaler, OptLevel, Param, Precision};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor, Var};
use rand::rngs::StdRng;
use rand::SeedableRng;

#[derive(AmpModule)]
struct Net {
    fc: Linear,
}

/// A 64 x 64 layer under O2 (bf16 working copies, f32 masters).
fn model(seed: u64) -> amp::Result<Net> {
    let mut rng = StdRng::seed_from_u64(seed);
    let weight = Param::new(Var::from_tensor(&common::randn(&mut rng, &[64, 64], 0.5)?)?);
    let bias = Param::new(Var::from_tensor(&common::randn(&mut rng, &[64], 0.5)?)?);
    let mut model = Net { fc: Linear::new(weight, Some(bias)) };
    amp::initialize(&mut model, AmpConfig { opt_level: OptLevel::O2, half: Precision::Bf16 })?;
    Ok(model)
}

fn bf16_state() -> AdamConfig {
    AdamConfig { lr: 1e-2, state_dtype: StateDtype::Bf16, ..AdamConfig::default() }
}

/// Gradients of step `step`, exactly representable in bf16, as a `GradStore` and as f64 values: each
/// element's gradient is its own scale (spread over 2^-6..2^2) times noise, so the moments see
/// magnitudes that change from step to step.
fn grads(model: &Net, step: u64) -> amp::Result<(GradStore, Vec<Vec<f64>>)> {
    let mut rng = StdRng::seed_from_u64(5000 + step);
    let mut loss = Tensor::new(0f32, &Device::Cpu)?;
    let mut exact = Vec::new();
    for (i, (_, param)) in model.named_params().into_iter().enumerate() {
        let w = param.trainable();
        let n = w.elem_count();
        let scales: Vec<f32> = (0..n).map(|j| 2f32.powi(((j * 7 + i) % 9) as i32 - 6)).collect();
        let scales = Tensor::from_vec(scales, w.dims(), &Device::Cpu)?;
        let g = (common::randn(&mut rng, w.dims(), 1.0)? * scales)?.to_dtype(w.dtype())?;
        exact.push(g.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?);
        loss = (loss + (w.as_tensor() * &g)?.to_dtype(DType::F32)?.sum_all()?)?;
    }
    Ok((loss.backward()?, exact))
}

fn masters(model: &Net) -> amp::Result<Vec<Vec<f64>>> {
    model
        .named_params()
        .iter()
        .map(|(_, p)| Ok(p.master().as_tensor().to_dtype(DType::F64)?.flatten_all()?.to_vec1()?))
        .collect()
}

/// AdamW in f64 (PyTorch's formula), one step on every parameter.
fn adamw_f64(
    c: &AdamConfig,
    t: u64,
    p: &mut [Vec<f64>],
    m: &mut [Vec<f64>],
    v: &mut [Vec<f64>],
    g: &[Vec<f64>],
) {
    let (bc1, bc2) = (1.0 - c.beta1.powi(t as i32), 1.0 - c.beta2.powi(t as i32));
    for (((p, m), v), g) in p.iter_mut().zip(m).zip(v).zip(g) {
        for j in 0..p.len() {
            p[j] *= 1.0 - c.lr * c.weight_decay;
            m[j] = c.beta1 * m[j] + (1.0 - c.beta1) * g[j];
            v[j] = c.beta2 * v[j] + (1.0 - c.beta2) * g[j] * g[j];
            p[j] -= c.lr * (m[j] / bc1) / ((v[j] / bc2).sqrt() + c.eps);
        }
    }
}

/// SGD with momentum in f64 (PyTorch's formula, no weight decay), one step on every parameter.
fn sgd_f64(c: &SgdConfig, t: u64, p: &mut [Vec<f64>], b: &mut [Vec<f64>], g: &[Vec<f64>]) {
    for ((p, b), g) in p.iter_mut().zip(b).zip(g) {
        for j in 0..p.len() {
            b[j] = if t == 1 { g[j] } else { c.momentum * b[j] + (1.0 - c.dampening) * g[j] };
            let d = if c.nesterov { g[j] + c.momentum * b[j] } else { b[j] };
            p[j] -= c.lr * d;
        }
    }
}

/// After `steps` steps of an optimizer from `make` and of the f64 `reference` (step number, masters,
/// gradients): (mean |master - f64| / mean |f64 moved|, mean signed error of the same along the f64
/// motion).
fn against_f64(
    make: impl FnOnce(ParamGroups) -> amp::Result<Box<dyn FusedOptimizer>>,
    mut reference: impl FnMut(u64, &mut [Vec<f64>], &[Vec<f64>]),
    steps: u64,
) -> amp::Result<(f64, f64)> {
    let model = model(1)?;
    let start = masters(&model)?;
    let mut want = start.clone();
    let mut optimizer = make(ParamGroups::from_model(&model)?)?;
    for t in 1..=steps {
        let (store, exact) = grads(&model, t)?;
        optimizer.step(&store)?;
        reference(t, &mut want, &exact);
    }
    let got = masters(&model)?;
    let (mut error, mut signed, mut moved, mut n) = (0.0, 0.0, 0.0, 0.0);
    for ((g, w), s) in got.iter().flatten().zip(want.iter().flatten()).zip(start.iter().flatten()) {
        error += (g - w).abs();
        // Signed along the direction the f64 run moved: positive is a step too long.
        signed += (g - w) * (w - s).signum();
        moved += (w - s).abs();
        n += 1.0;
    }
    Ok((error / moved, signed / n / (moved / n)))
}

/// [`against_f64`] for Adam with `config`.
fn adam_against_f64(config: AdamConfig, steps: u64) -> amp::Result<(f64, f64)> {
    let zeros = || -> Vec<Vec<f64>> { vec![vec![0.0; 64 * 64], vec![0.0; 64]] };
    let (mut m, mut v) = (zeros(), zeros());
    let make = |g| -> amp::Result<Box<dyn FusedOptimizer>> { Ok(Box::new(FusedAdam::new(g, config)?)) };
    against_f64(make, |t, p, g| adamw_f64(&config, t, p, &mut m, &mut v, g), steps)
}

/// The bounds of the module's docs on [`against_f64`]'s results for f32 state (`f32_error`) and bf16
/// state (error and drift), printed.
#[track_caller]
fn assert_within_noise(what: &str, f32_error: f64, (bf16_error, bf16_drift): (f64, f64)) {
    println!(
        "{what}: mean |error| / mean distance moved: f32 state {f32_error:.2e}, bf16 {bf16_error:.2e} (drift \
         {bf16_drift:.2e})"
    );
    assert!(f32_error < 1e-4, "{what}, f32 state: {f32_error}");
    assert!(bf16_error < 0.02, "{what}, bf16 state: {bf16_error}");
    assert!(bf16_drift.abs() < 0.005, "{what}, bf16 state drift: {bf16_drift}");
}

#[test]
fn bf16_moments_move_the_masters_where_f64_adam_does_within_their_noise() -> amp::Result<()> {
    let steps = 300;
    let (f32_error, _) =
        adam_against_f64(AdamConfig { state_dtype: StateDtype::F32, ..bf16_state() }, steps)?;
    let (bf16_error, bf16_drift) = adam_against_f64(bf16_state(), steps)?;
    assert_within_noise("Adam", f32_error, (bf16_error, bf16_drift));
    Ok(())
}

#[test]
fn the_state_takes_half_the_bytes_and_is_saved_in_bf16() -> amp::Result<()> {
    let model = model(2)?;
    let params = model.precision_plan().params();
    let f32_state = FusedAdam::new(ParamGroups::from_model(&model)?, AdamConfig::default())?;
    let bf16 = FusedAdam::new(ParamGroups::from_model(&model)?, bf16_state())?;
    assert_eq!(f32_state.state_bytes(), 8 * params);
    assert_eq!(bf16.state_bytes(), 4 * params, "two bf16 moments");
    let saved = bf16.save_state()?;
    assert_eq!(saved.tensors.len(), 4, "two moments of two parameters");
    for (name, t) in &saved.tensors {
        assert_eq!(t.dtype(), DType::BF16, "{name}");
    }
    Ok(())
}

/// Ten steps of two optimizers from `make` on two copies of a model; one is saved and loaded into a
/// third model with an optimizer from `fresh` (other settings: the checkpoint's replace them); ten more
/// steps of the straight run and the resumed one, whose masters must be bit-identical. Returns both
/// optimizers (resumed, straight) for their state to be compared.
fn resume<O: FusedOptimizer + TrainingState>(
    seed: u64,
    make: impl Fn(ParamGroups) -> amp::Result<O>,
    fresh: impl FnOnce(ParamGroups) -> amp::Result<O>,
) -> amp::Result<(O, O)> {
    let straight = model(seed)?;
    let mut straight_opt = make(ParamGroups::from_model(&straight)?)?;
    let first = model(seed)?;
    let mut first_opt = make(ParamGroups::from_model(&first)?)?;
    for step in 1..=10 {
        straight_opt.step(&grads(&straight, step)?.0)?;
        first_opt.step(&grads(&first, step)?.0)?;
    }
    let name = format!("amp-bf16-state-{seed}-{}.safetensors", std::process::id());
    let path = std::env::temp_dir().join(name);
    amp::checkpoint::save_with(&first, &[&first_opt], &path)?;
    let mut resumed = model(seed + 70)?;
    let mut resumed_opt = fresh(ParamGroups::from_model(&resumed)?)?;
    amp::checkpoint::load_with(&mut resumed, &mut [&mut resumed_opt], &path)?;
    std::fs::remove_file(&path).ok();
    assert_eq!(resumed_opt.state_bytes(), straight_opt.state_bytes());
    for step in 11..=20 {
        straight_opt.step(&grads(&straight, step)?.0)?;
        resumed_opt.step(&grads(&resumed, step)?.0)?;
    }
    assert_eq!(masters(&resumed)?, masters(&straight)?, "masters bit-identical after resume");
    Ok((resumed_opt, straight_opt))
}

/// Every state tensor of `a` and `b` is bf16 and bit-identical.
fn assert_same_bf16_state(a: &dyn TrainingState, b: &dyn TrainingState) -> amp::Result<()> {
    let (a, b) = (a.save_state()?, b.save_state()?);
    assert_eq!(a.tensors.len(), b.tensors.len());
    for ((name, x), (_, y)) in a.tensors.iter().zip(&b.tensors) {
        assert_eq!(x.dtype(), DType::BF16, "{name}");
        let bits = |t: &Tensor| -> amp::Result<Vec<u16>> {
            Ok(t.flatten_all()?.to_vec1::<half::bf16>()?.iter().map(|v| v.to_bits()).collect())
        };
        assert_eq!(bits(x)?, bits(y)?, "{name} bit-identical after resume");
    }
    Ok(())
}

#[test]
fn a_run_resumed_from_a_checkpoint_continues_bit_for_bit() -> amp::Result<()> {
    // Built with f32 state: the checkpoint's settings (bf16 moments) replace the optimizer's.
    let (resumed, straight) =
        resume(3, |g| FusedAdam::new(g, bf16_state()), |g| FusedAdam::new(g, AdamConfig::default()))?;
    assert_eq!(resumed.config().state_dtype, StateDtype::Bf16);
    assert_same_bf16_state(&resumed, &straight)
}

/// Three steps of `optimizer` through a default scaler, then one whose loss is not finite: it must be
/// skipped with the masters, the bf16 state and the step count bit-identical.
fn assert_a_non_finite_step_changes_nothing<O>(model: &Net, optimizer: &mut O) -> amp::Result<()>
where
    O: FusedOptimizer + TrainingState,
{
    let mut scaler = GradScaler::for_model(model, ScalerConfig::default())?;
    let x = Tensor::ones((2, 64), DType::F32, &Device::Cpu)?;
    for _ in 0..3 {
        scaler.step_fused(&model.fc.forward(&x)?.sqr()?.mean_all()?, optimizer, None)?;
    }
    let (before, state_before) = (masters(model)?, optimizer.save_state()?);
    let loss = model.fc.forward(&(x * f64::INFINITY)?)?.sqr()?.mean_all()?;
    let report = scaler.step_fused(&loss, optimizer, None)?;
    assert!(!report.applied(), "{report:?}");
    assert_eq!(masters(model)?, before);
    let state_after = optimizer.save_state()?;
    for ((name, a), (_, b)) in state_before.tensors.iter().zip(&state_after.tensors) {
        let (a, b) = (a.flatten_all()?.to_vec1::<half::bf16>()?, b.flatten_all()?.to_vec1::<half::bf16>()?);
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{name} changed");
    }
    assert_eq!(state_after.json, state_before.json, "the step count did not move");
    Ok(())
}

#[test]
fn a_non_finite_gradient_skips_the_step_and_leaves_masters_and_moments_bit_identical() -> amp::Result<()> {
    let model = model(4)?;
    let mut optimizer = FusedAdam::new(ParamGroups::from_model(&model)?, bf16_state())?;
    assert_a_non_finite_step_changes_nothing(&model, &mut optimizer)
}

#[test]
fn settings_bf16_state_cannot_serve_are_refused_with_the_fix() -> amp::Result<()> {
    let model = model(5)?;
    let amsgrad = AdamConfig { amsgrad: true, ..bf16_state() };
    let err = FusedAdam::new(ParamGroups::from_model(&model)?, amsgrad).unwrap_err().to_string();
    assert!(err.contains("amsgrad") && err.contains("StateDtype::F32"), "{err}");

    // A checkpoint whose settings say bf16 but whose moments are f32 (edited, or not amp's).
    let optimizer = FusedAdam::new(ParamGroups::from_model(&model)?, bf16_state())?;
    let saved = optimizer.save_state()?;
    let tensors = saved
        .tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), t.to_dtype(DType::F32)?)))
        .collect::<amp::Result<Vec<_>>>()?;
    let edited = SavedState { json: saved.json.clone(), tensors };
    let err = optimizer.check_state(&edited).unwrap_err().to_string();
    assert!(err.contains("F32") && err.contains("BF16") && err.contains("exp_avg"), "{err}");
    Ok(())
}

#[test]
fn checkpoints_written_before_the_setting_existed_load_with_f32_state() -> amp::Result<()> {
    let model = model(6)?;
    let mut optimizer = FusedAdam::new(ParamGroups::from_model(&model)?, AdamConfig::default())?;
    let mut saved = optimizer.save_state()?;
    assert!(saved.json.contains(r#""state_dtype":"F32""#), "{}", saved.json);
    saved.json = saved.json.replace(r#","state_dtype":"F32""#, "");
    optimizer.check_state(&saved)?;
    optimizer.restore_state(saved)?;
    assert_eq!(optimizer.config().state_dtype, StateDtype::F32);
    let mut sgd =
        FusedSgd::new(ParamGroups::from_model(&model)?, SgdConfig { momentum: 0.9, ..Default::default() })?;
    let mut saved = sgd.save_state()?;
    saved.json = saved.json.replace(r#","state_dtype":"F32""#, "");
    assert!(!saved.json.contains("state_dtype"), "{}", saved.json);
    sgd.check_state(&saved)?;
    sgd.restore_state(saved)?;
    assert_eq!(sgd.config().state_dtype, StateDtype::F32);
    Ok(())
}

fn sgd_bf16() -> SgdConfig {
    SgdConfig { lr: 1e-2, momentum: 0.9, state_dtype: StateDtype::Bf16, ..SgdConfig::default() }
}

/// [`against_f64`] for SGD with `config`.
fn sgd_against_f64(config: SgdConfig, steps: u64) -> amp::Result<(f64, f64)> {
    let mut b = vec![vec![0.0; 64 * 64], vec![0.0; 64]];
    let make = |g| -> amp::Result<Box<dyn FusedOptimizer>> { Ok(Box::new(FusedSgd::new(g, config)?)) };
    against_f64(make, |t, p, g| sgd_f64(&config, t, p, &mut b, g), steps)
}

#[test]
fn a_bf16_momentum_buffer_moves_the_masters_where_f64_sgd_does_within_its_noise() -> amp::Result<()> {
    let steps = 300;
    for config in [sgd_bf16(), SgdConfig { nesterov: true, ..sgd_bf16() }] {
        let (f32_error, _) = sgd_against_f64(SgdConfig { state_dtype: StateDtype::F32, ..config }, steps)?;
        let (bf16_error, bf16_drift) = sgd_against_f64(config, steps)?;
        let what = if config.nesterov { "SGD (Nesterov)" } else { "SGD" };
        assert_within_noise(what, f32_error, (bf16_error, bf16_drift));
    }
    Ok(())
}

#[test]
fn sgd_state_takes_half_the_bytes_resumes_bit_for_bit_and_needs_no_buffer_without_momentum() -> amp::Result<()>
{
    let net = model(7)?;
    let params = net.precision_plan().params();
    let bf16 = FusedSgd::new(ParamGroups::from_model(&net)?, sgd_bf16())?;
    assert_eq!(bf16.state_bytes(), 2 * params, "one bf16 buffer");
    let plain = SgdConfig { momentum: 0.0, ..sgd_bf16() };
    let mut none = FusedSgd::new(ParamGroups::from_model(&net)?, plain)?;
    assert_eq!(none.state_bytes(), 0);
    none.step(&grads(&net, 1)?.0)?;

    let (resumed, straight) =
        resume(8, |g| FusedSgd::new(g, sgd_bf16()), |g| FusedSgd::new(g, SgdConfig::default()))?;
    assert_same_bf16_state(&resumed, &straight)?;
    Ok(())
}

fn lamb_bf16() -> LambConfig {
    LambConfig { lr: 1e-2, state_dtype: StateDtype::Bf16, ..LambConfig::default() }
}

/// LAMB in f64 (Apex's `FusedLAMB` formula: decoupled decay added to the update, the trust ratio
/// `||w|| / ||u||` per tensor), one step on every parameter.
fn lamb_f64(
    c: &LambConfig,
    t: u64,
    p: &mut [Vec<f64>],
    m: &mut [Vec<f64>],
    v: &mut [Vec<f64>],
    g: &[Vec<f64>],
) {
    let (bc1, bc2) = (1.0 - c.beta1.powi(t as i32), 1.0 - c.beta2.powi(t as i32));
    for (((p, m), v), g) in p.iter_mut().zip(m).zip(v).zip(g) {
        let mut u = vec![0.0; p.len()];
        for j in 0..p.len() {
            m[j] = c.beta1 * m[j] + (1.0 - c.beta1) * g[j];
            v[j] = c.beta2 * v[j] + (1.0 - c.beta2) * g[j] * g[j];
            u[j] = (m[j] / bc1) / ((v[j] / bc2).sqrt() + c.eps) + c.weight_decay * p[j];
        }
        let norm = |x: &[f64]| x.iter().map(|x| x * x).sum::<f64>().sqrt();
        let ratio = c.lr * norm(p) / norm(&u);
        for j in 0..p.len() {
            p[j] -= ratio * u[j];
        }
    }
}

/// [`against_f64`] for LAMB with `config`.
fn lamb_against_f64(config: LambConfig, steps: u64) -> amp::Result<(f64, f64)> {
    let zeros = || -> Vec<Vec<f64>> { vec![vec![0.0; 64 * 64], vec![0.0; 64]] };
    let (mut m, mut v) = (zeros(), zeros());
    let make = |g| -> amp::Result<Box<dyn FusedOptimizer>> { Ok(Box::new(FusedLamb::new(g, config)?)) };
    against_f64(make, |t, p, g| lamb_f64(&config, t, p, &mut m, &mut v, g), steps)
}

#[test]
fn lamb_with_bf16_moments_moves_the_masters_where_f64_lamb_does_within_their_noise() -> amp::Result<()> {
    let steps = 300;
    let (f32_error, _) = lamb_against_f64(LambConfig { state_dtype: StateDtype::F32, ..lamb_bf16() }, steps)?;
    let (bf16_error, bf16_drift) = lamb_against_f64(lamb_bf16(), steps)?;
    assert_within_noise("LAMB", f32_error, (bf16_error, bf16_drift));
    Ok(())
}

#[test]
fn lamb_state_takes_half_the_bytes_resumes_bit_for_bit_and_skips_non_finite_steps() -> amp::Result<()> {
    let net = model(9)?;
    let params = net.precision_plan().params();
    let f32_state = FusedLamb::new(ParamGroups::from_model(&net)?, LambConfig::default())?;
    assert_eq!(f32_state.state_bytes(), 8 * params);
    let bf16 = FusedLamb::new(ParamGroups::from_model(&net)?, lamb_bf16())?;
    assert_eq!(bf16.state_bytes(), 4 * params, "two bf16 moments");

    let (resumed, straight) =
        resume(10, |g| FusedLamb::new(g, lamb_bf16()), |g| FusedLamb::new(g, LambConfig::default()))?;
    assert_eq!(resumed.config().state_dtype, StateDtype::Bf16);
    assert_same_bf16_state(&resumed, &straight)?;

    let mut optimizer = FusedLamb::new(ParamGroups::from_model(&net)?, lamb_bf16())?;
    assert_a_non_finite_step_changes_nothing(&net, &mut optimizer)?;

    // Checkpoints written before the setting existed hold f32 moments and load as such.
    let mut saved = f32_state.save_state()?;
    saved.json = saved.json.replace(r#","state_dtype":"F32""#, "");
    assert!(!saved.json.contains("state_dtype"), "{}", saved.json);
    let mut old = FusedLamb::new(ParamGroups::from_model(&net)?, lamb_bf16())?;
    old.check_state(&saved)?;
    old.restore_state(saved)?;
    assert_eq!(old.config().state_dtype, StateDtype::F32);
    assert_eq!(old.state_bytes(), 8 * params);
    Ok(())
}
