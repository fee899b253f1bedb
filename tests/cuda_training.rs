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
    Ok(loss.expect("the model has parameters").backward()?)
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
