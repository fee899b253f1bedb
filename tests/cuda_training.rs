//! The same training code on a CUDA device as on the CPU (feature `cuda`; every test passes with a note
//! when no device is usable, so the suite runs anywhere).
//!
//! - FusedAdamW, FusedSgd and FusedLamb on the device against the CPU step for step, on gradients that
//!   are identical on both (backward of `sum(w * g)`): the kernels mirror the CPU's arithmetic, so
//!   masters agree to within an f32 ulp or so per step (the bias corrections' `pow` may round
//!   differently; LAMB's norms are summed in another order), well inside 1e-6 relative after 10 steps.
//! - A step whose gradients overflow leaves masters, working copies and moments bit-identical.
//! - The scaler's unscale and check on the device find the same first overflowing parameter.
//! - Optimizer state kept on the device goes into checkpoints and resumes exactly.
//! - Deferred steps (`step_fused_deferred`: the scale, the checks and the skip decision stay on the
//!   device) follow the CPU's `step_fused` through overflows, a NaN loss and clipping; `settle` reports
//!   the same counts, reasons and scale, and a checkpoint taken with steps queued saves their outcome.
#![cfg(feature = "cuda")]

mod common;

use amp::nn::Linear;
use amp::optim::{
    AdamConfig, FusedAdam, FusedLamb, FusedOptimizer, FusedSgd, LambConfig, ParamGroups, SgdConfig,
};
use amp::scaler::ScalerConfig;
use amp::{AmpConfig, AmpModule, AmpModuleExt, GradScaler, OptLevel, Param, Precision};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor, Var};
use rand::rngs::StdRng;
use rand::SeedableRng;

#[derive(AmpModule)]
struct Two {
    fc1: Linear,
    fc2: Linear,
}

fn gpu() -> Option<Device> {
    if !amp::cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return None;
    }
    Device::new_cuda(0).ok()
}

/// The same seeded model on `device`, O2 with `half` working copies.
fn model(device: &Device, half: Precision) -> amp::Result<Two> {
    let mut rng = StdRng::seed_from_u64(7);
    let mut param = |shape: &[usize]| -> amp::Result<Param> {
        Ok(Param::new(Var::from_tensor(&common::randn(&mut rng, shape, 0.5)?.to_device(device)?)?))
    };
    let fc1 = Linear::new(param(&[64, 200_000 / 64])?, Some(param(&[64])?));
    let fc2 = Linear::new(param(&[7, 64])?, None);
    let mut model = Two { fc1, fc2 };
    amp::initialize(&mut model, AmpConfig { opt_level: OptLevel::O2, half })?;
    Ok(model)
}

/// Gradients equal to seeded values times `scale`, on the model's device.
fn grads(model: &Two, step: u64, scale: f32) -> amp::Result<GradStore> {
    Ok(loss(model, step, scale)?.backward()?)
}

/// `sum(w * g)` over the parameters, `g` seeded values times `scale`: the gradients are the `g`.
fn loss(model: &Two, step: u64, scale: f32) -> amp::Result<Tensor> {
    let mut rng = StdRng::seed_from_u64(100 + step);
    let mut loss: Option<Tensor> = None;
    for (_, param) in model.named_params() {
        let w = param.trainable();
        let g = (common::randn(&mut rng, w.dims(), 0.5)? * f64::from(scale))?;
        let g = g.to_dtype(w.dtype())?.to_device(w.device())?;
        let term = (w.as_tensor() * &g)?.to_dtype(DType::F32)?.sum_all()?;
        loss = Some(match loss {
            Some(l) => (l + term)?,
            None => term,
        });
    }
    Ok(loss.expect("the model has parameters"))
}

fn masters(model: &Two) -> amp::Result<Vec<Vec<f32>>> {
    model
        .named_params()
        .iter()
        .map(|(_, p)| Ok(p.master().as_tensor().to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?))
        .collect()
}

fn max_relative(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-3))
        .fold(0.0, f32::max)
}

type MakeOptimizer = fn(ParamGroups) -> amp::Result<Box<dyn FusedOptimizer>>;

fn optimizers() -> [(&'static str, MakeOptimizer); 3] {
    [
        ("AdamW", |g| Ok(Box::new(FusedAdam::new(g, AdamConfig { lr: 1e-2, ..AdamConfig::default() })?))),
        ("SGD", |g| {
            let config = SgdConfig { lr: 1e-2, momentum: 0.9, weight_decay: 1e-4, ..SgdConfig::default() };
            Ok(Box::new(FusedSgd::new(g, config)?))
        }),
        ("LAMB", |g| Ok(Box::new(FusedLamb::new(g, LambConfig { lr: 1e-2, ..LambConfig::default() })?))),
    ]
}

#[test]
fn fused_optimizers_on_cuda_match_the_cpu_step_for_step() -> amp::Result<()> {
    let Some(cuda) = gpu() else { return Ok(()) };
    for (name, make) in optimizers() {
        for half in [Precision::Fp16, Precision::Bf16] {
            let (on_gpu, on_cpu) = (model(&cuda, half)?, model(&Device::Cpu, half)?);
            let mut gpu_opt = make(ParamGroups::from_model(&on_gpu)?)?;
            let mut cpu_opt = make(ParamGroups::from_model(&on_cpu)?)?;
            for step in 0..10 {
                gpu_opt.step_scaled(&grads(&on_gpu, step, 512.0)?, 1.0 / 512.0)?;
                cpu_opt.step_scaled(&grads(&on_cpu, step, 512.0)?, 1.0 / 512.0)?;
                let error = max_relative(&masters(&on_gpu)?, &masters(&on_cpu)?);
                assert!(error <= 1e-6, "{name} {half}: step {step}: masters differ by {error:e} relative");
            }
            working_copies_are_rounded_masters(&on_gpu)?;
        }
    }
    Ok(())
}

/// The working copies are the rounded masters, on the device too.
fn working_copies_are_rounded_masters(on_gpu: &Two) -> amp::Result<()> {
    for (path, p) in on_gpu.named_params() {
        if let Some(w) = p.working() {
            let rounded = p.master().as_tensor().to_dtype(w.dtype())?;
            let diff = (w.as_tensor().to_dtype(DType::F32)? - rounded.to_dtype(DType::F32)?)?
                .abs()?
                .sum_all()?
                .to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "{path}");
        }
    }
    Ok(())
}

#[test]
fn an_overflowing_step_on_cuda_changes_nothing() -> amp::Result<()> {
    let Some(cuda) = gpu() else { return Ok(()) };
    let net = model(&cuda, Precision::Fp16)?;
    let mut adam = FusedAdam::new(ParamGroups::from_model(&net)?, AdamConfig::default())?;
    let mut scaler = GradScaler::new(ScalerConfig::default())?;
    // One applied step, so that the moments live on the device.
    let loss = net.fc2.forward(&net.fc1.forward(&Tensor::ones((4, 3125), DType::F32, &cuda)?)?)?.sum_all()?;
    let report = scaler.step_fused(&(loss * 1e-6)?, &mut adam, None)?;
    assert!(report.applied(), "{report}");
    let before = masters(&net)?;
    let state_before = amp::checkpoint::TrainingState::save_state(&adam)?;
    // Inputs of 1e30 make every fp16 gradient infinite.
    let x = (Tensor::ones((4, 3125), DType::F32, &cuda)? * 1e30)?;
    let loss = net.fc2.forward(&net.fc1.forward(&x)?)?.sqr()?.mean_all()?;
    let report = scaler.step_fused(&loss, &mut adam, Some(1.0))?;
    assert!(!report.applied(), "{report}");
    assert_eq!(masters(&net)?, before, "masters bit-identical");
    let state_after = amp::checkpoint::TrainingState::save_state(&adam)?;
    for ((name, a), (_, b)) in state_before.tensors.iter().zip(&state_after.tensors) {
        let (a, b) = (a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?);
        assert_eq!(a, b, "{name} bit-identical");
    }
    Ok(())
}

#[test]
fn unscale_on_cuda_names_the_same_parameter_as_on_the_cpu() -> amp::Result<()> {
    let Some(cuda) = gpu() else { return Ok(()) };
    for device in [cuda, Device::Cpu] {
        let net = model(&device, Precision::Fp16)?;
        let scaler = GradScaler::new(ScalerConfig::default())?;
        let x = (Tensor::ones((2, 3125), DType::F32, &device)? * 300.0)?;
        let loss = net.fc2.forward(&net.fc1.forward(&x)?)?.sqr()?.sum_all()?;
        let mut grads = scaler.scale_loss(&loss)?.backward()?;
        let unscaled = scaler.unscale(&net, &mut grads)?;
        assert_eq!(unscaled.first_non_finite.as_deref(), Some("fc1.weight"), "{device:?}");
    }
    Ok(())
}

#[test]
fn device_optimizer_state_round_trips_through_a_checkpoint() -> amp::Result<()> {
    let Some(cuda) = gpu() else { return Ok(()) };
    let dir = std::env::temp_dir().join(format!("amp-cuda-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| amp::Error::Internal { what: e.to_string() })?;
    let path = dir.join("run.safetensors");
    let net = model(&cuda, Precision::Bf16)?;
    let mut adam = FusedAdam::new(ParamGroups::from_model(&net)?, AdamConfig::default())?;
    for step in 0..3 {
        adam.step(&grads(&net, step, 1.0)?)?;
    }
    amp::checkpoint::save_with(&net, &[&adam], &path)?;
    // Continue the original, and a copy restored from the checkpoint, by the same steps.
    let mut restored_net = model(&cuda, Precision::Bf16)?;
    let mut restored = FusedAdam::new(ParamGroups::from_model(&restored_net)?, AdamConfig::default())?;
    amp::checkpoint::load_with(&mut restored_net, &mut [&mut restored], &path)?;
    for step in 3..6 {
        adam.step(&grads(&net, step, 1.0)?)?;
        restored.step(&grads(&restored_net, step, 1.0)?)?;
    }
    assert_eq!(masters(&restored_net)?, masters(&net)?, "resume is exact");
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn deferred_steps_on_cuda_follow_step_fused_on_the_cpu() -> amp::Result<()> {
    let Some(cuda) = gpu() else { return Ok(()) };
    for (name, make) in optimizers() {
        for max_grad_norm in [None, Some(50.0)] {
            let (on_gpu, on_cpu) = (model(&cuda, Precision::Fp16)?, model(&Device::Cpu, Precision::Fp16)?);
            let mut gpu_opt = make(ParamGroups::from_model(&on_gpu)?)?;
            let mut cpu_opt = make(ParamGroups::from_model(&on_cpu)?)?;
            let config = ScalerConfig { growth_interval: 3, ..ScalerConfig::default() };
            let (mut gpu_scaler, mut cpu_scaler) = (GradScaler::new(config)?, GradScaler::new(config)?);
            let what = format!("{name}, clip {max_grad_norm:?}");
            let mut window = Vec::new();
            for step in 0..24 {
                // Gradients of about 0.5 overflow fp16 at the initial scale 2^16 (|g| * 2^16 > 65504 for
                // |g| > 1): the first steps are skipped until the scale backs off; the scale grows every
                // 3 steps after. Step 10's loss is NaN.
                let poison = if step == 10 { f64::NAN } else { 1.0 };
                let gpu_loss = (loss(&on_gpu, step, 1.0)? * poison)?;
                let cpu_loss = (loss(&on_cpu, step, 1.0)? * poison)?;
                gpu_scaler.step_fused_deferred(&gpu_loss, gpu_opt.as_mut(), max_grad_norm)?;
                window.push(cpu_scaler.step_fused(&cpu_loss, cpu_opt.as_mut(), max_grad_norm)?);
                if step % 6 != 5 {
                    continue;
                }
                assert_eq!(gpu_scaler.unsettled_steps(), 6, "{what}");
                if step == 11 {
                    // A checkpoint with steps queued saves their outcome.
                    let saved = amp::checkpoint::TrainingState::save_state(&gpu_scaler)?;
                    let want = amp::checkpoint::TrainingState::save_state(&cpu_scaler)?;
                    assert_eq!(saved.json, want.json, "{what}: scaler state saved mid-queue");
                }
                let settled = gpu_scaler.settle()?;
                let skipped: Vec<_> = window.iter().filter(|r| !r.applied()).collect();
                assert_eq!(
                    (settled.steps, settled.skipped),
                    (6, skipped.len() as u64),
                    "{what}: step {step}: {settled}"
                );
                assert_eq!(
                    settled.last_skip,
                    skipped.last().and_then(|r| r.skipped.clone()),
                    "{what}: {settled}"
                );
                assert_eq!(gpu_scaler.state(), cpu_scaler.state(), "{what}: step {step}");
                window.clear();
                // Clipping multiplies by a factor from the global norm, summed in another order on each
                // side: an ulp of the factor per step, hence the looser bound.
                let tolerance = if max_grad_norm.is_some() { 1e-5 } else { 1e-6 };
                let error = max_relative(&masters(&on_gpu)?, &masters(&on_cpu)?);
                assert!(error <= tolerance, "{what}: step {step}: masters differ by {error:e} relative");
            }
            let state = cpu_scaler.state();
            assert!(state.skipped >= 2 && state.applied >= 12, "{what}: both kinds of step: {state:?}");
            working_copies_are_rounded_masters(&on_gpu)?;
        }
    }
    Ok(())
}

#[test]
fn deferred_adam_counts_its_steps_on_the_device() -> amp::Result<()> {
    let Some(cuda) = gpu() else { return Ok(()) };
    let net = model(&cuda, Precision::Bf16)?;
    let mut adam = FusedAdam::new(ParamGroups::from_model(&net)?, AdamConfig::default())?;
    let mut scaler = GradScaler::for_model(&net, ScalerConfig::default())?.with_finite_guard(true);
    for step in 0..5 {
        // Step 2's loss is NaN: the guard skips it on the device.
        let poison = if step == 2 { f64::NAN } else { 1.0 };
        scaler.step_fused_deferred(&(loss(&net, step, 1.0)? * poison)?, &mut adam, None)?;
    }
    assert_eq!(adam.steps()?, 4, "the skipped step is not counted");
    let settled = scaler.settle()?;
    assert_eq!((settled.steps, settled.applied), (5, 4), "{settled}");
    assert_eq!(settled.last_skip, Some(amp::scaler::SkipReason::NonFiniteLoss));
    // A host-side step takes the state back and goes on from the device's counts.
    let report = scaler.step_fused(&loss(&net, 5, 1.0)?, &mut adam, None)?;
    assert!(report.applied(), "{report}");
    assert_eq!((report.step, adam.steps()?), (6, 5));
    Ok(())
}

/// A disabled scaler (a bf16 model's) checks the gradients of a deferred step as `step_fused` does: a
/// NaN gradient under a finite loss skips the step on the device and changes no weight.
#[test]
fn a_deferred_step_of_a_disabled_scaler_skips_a_nan_gradient() -> amp::Result<()> {
    let Some(cuda) = gpu() else { return Ok(()) };
    let net = model(&cuda, Precision::Bf16)?;
    let mut adam = FusedAdam::new(ParamGroups::from_model(&net)?, AdamConfig::default())?;
    let mut scaler = GradScaler::for_model(&net, ScalerConfig::default())?;
    scaler.step_fused_deferred(&loss(&net, 0, 1.0)?, &mut adam, None)?;
    let before = masters(&net)?;
    // sqrt(w - w) is 0 (a finite loss) and its gradient inf - inf = NaN.
    let w = net.fc2.weight().trainable().as_tensor();
    let nan_gradient = (w - w)?.sqrt()?.to_dtype(DType::F32)?.sum_all()?;
    scaler.step_fused_deferred(&(loss(&net, 1, 1.0)? + nan_gradient)?, &mut adam, None)?;
    let settled = scaler.settle()?;
    assert_eq!((settled.steps, settled.applied), (2, 1), "{settled}");
    assert_eq!(masters(&net)?, before, "masters bit-identical");
    assert_eq!(adam.steps()?, 1, "the skipped step is not counted");
    Ok(())
}

/// Under the padding policy a bf16 product of n = 1001 runs on operands padded to n = 1008 and gives
/// the unpadded product's values and both gradients, up to a bf16 rounding where cuBLAS's kernel for
/// the padded shape sums in another order. The policy is process-wide: a test running meanwhile may
/// see its products padded, which changes nothing it asserts.
#[test]
fn padded_products_on_cuda_match_the_unpadded_ones() -> amp::Result<()> {
    let Some(cuda) = gpu() else { return Ok(()) };
    let (m, k, n) = (64, 96, 1001);
    let operand = |seed, shape: &[usize]| -> amp::Result<Tensor> {
        Ok(common::randn_in(seed, shape, 1.0, DType::BF16)?.to_dtype(DType::F32)?.to_device(&cuda)?)
    };
    let (a, b, dc) = (operand(1, &[m, k])?, operand(2, &[k, n])?, operand(3, &[m, n])?);
    let run = |pad: bool| -> amp::Result<[Tensor; 3]> {
        let before = amp::dispatch::pad_for_tensor_cores(pad);
        let choice = amp::dispatch::explain(&cuda, Precision::Bf16, amp::dispatch::Dims::new(m, n, k));
        let (va, vb) = (Var::from_tensor(&a)?, Var::from_tensor(&b)?);
        let c = amp::ops::matmul_to(&va, &vb, Precision::Bf16, DType::F32);
        amp::dispatch::pad_for_tensor_cores(before);
        let want = pad.then_some(amp::dispatch::Dims::new(m, 1008, k));
        assert_eq!(choice.padded, want, "{choice}");
        let c = c?;
        let grads = (&c * &dc)?.sum_all()?.backward()?;
        let grad = |v: &Var| grads.get(v).expect("a gradient").clone();
        Ok([c.clone(), grad(&va), grad(&vb)])
    };
    let (plain, padded) = (run(false)?, run(true)?);
    for (what, got, want) in
        [("C", &padded[0], &plain[0]), ("dA", &padded[1], &plain[1]), ("dB", &padded[2], &plain[2])]
    {
        common::assert_close(what, got, want, common::tolerance(DType::BF16, 1, 1.0))?;
    }
    Ok(())
}
