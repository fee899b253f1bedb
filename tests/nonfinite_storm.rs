//! Non-finite storms: a seeded 10,000-step fp16 O2 run with the dynamic scaler, for AdamW and LAMB, with
//! inf or NaN injected into one element of a random parameter's gradient at about 10% of the steps and
//! in bursts of 50 consecutive steps. Every step, no master, moment or working copy is non-finite; every
//! injected step is skipped and its report names the injected parameter, no other step is skipped; the
//! scale stays within [min_scale, max_scale]. Also a NaN in the forward input and an activation that
//! overflows fp16 between two fp16 layers: skipped, nothing changed (a BatchNorm's running statistics
//! included).

mod common;
mod reliability;

use amp::checkpoint::TrainingState;
use amp::nn::{batch_norm, linear, BatchNorm, Linear};
use amp::optim::{AdamConfig, FusedAdamW, FusedLamb, FusedOptimizer, LambConfig, ParamGroups};
use amp::scaler::{AtScaleFloor, ScalerConfig, SkipReason};
use amp::{AmpConfig, AmpModule, AmpModuleExt, GradScaler, OptLevel, Precision};
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Module, Shape, Tensor};
use candle_nn::{ModuleT, VarBuilder, VarMap};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use reliability::{fp16_net, Net, Outcome};

const STEPS: u64 = 10_000;
const BURST: u64 = 50;
const SIZES: (usize, usize, usize) = (4, 16, 2);

/// Forward: zeros (added to the loss, it changes nothing). Backward: a gradient that is zero except one
/// element, `value`: an inf or NaN in exactly one parameter's gradient, as an fp16 overflow would leave.
struct PoisonGradient {
    index: usize,
    value: f32,
}

impl CustomOp1 for PoisonGradient {
    fn name(&self) -> &'static str {
        "poison-gradient"
    }

    fn cpu_fwd(&self, _: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![0.0; layout.shape().elem_count()]), layout.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _: &Tensor, _: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let mut values = vec![0f32; arg.elem_count()];
        values[self.index] = self.value;
        Ok(Some(Tensor::from_vec(values, arg.shape(), arg.device())?.to_dtype(arg.dtype())?))
    }
}

/// Which steps get a poisoned gradient: three bursts of 50, and 10% of the others, seeded.
fn schedule(rng: &mut StdRng) -> Vec<bool> {
    let mut poisoned: Vec<bool> = (0..STEPS).map(|_| rng.random_bool(0.1)).collect();
    for start in [1_000, 4_321, 8_765] {
        poisoned[start..start + BURST as usize].fill(true);
    }
    poisoned
}

/// True when every master, working copy and optimizer state value is finite.
fn all_finite(net: &Net, optimizer: &dyn TrainingState) -> amp::Result<bool> {
    let mut tensors: Vec<Tensor> = Vec::new();
    for (_, p) in net.named_params() {
        tensors.push(p.master().as_tensor().clone());
        tensors.extend(p.working().map(|w| w.as_tensor().clone()));
    }
    tensors.extend(optimizer.save_state()?.tensors.into_iter().map(|(_, t)| t));
    for t in &tensors {
        if !common::all_finite(t)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The storm for one optimizer; returns (injected, skipped).
fn storm<O: FusedOptimizer + TrainingState>(optimizer: &mut O, net: &Net, seed: u64) -> Outcome<(u64, u64)> {
    let config = ScalerConfig {
        init_scale: 1024.0,
        max_scale: 4096.0,
        growth_interval: 20,
        at_floor: AtScaleFloor::Continue,
        ..Default::default()
    };
    let mut scaler = GradScaler::new(config)?;
    let mut rng = StdRng::seed_from_u64(seed);
    let poisoned = schedule(&mut rng);
    let params = net.named_params();
    let (mut injected, mut at_floor) = (0, 0);
    for (step, poison) in poisoned.iter().enumerate() {
        let (x, y) = reliability::batch(step as u64 % 97, 8, SIZES.0, SIZES.2)?;
        let mut loss = reliability::mse(net, &x, &y)?;
        let mut target = None;
        if *poison {
            let (path, param) = &params[rng.random_range(0..params.len())];
            let value = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN][rng.random_range(0..3)];
            let op = PoisonGradient { index: rng.random_range(0..param.elem_count()), value };
            loss = (loss + param.trainable().as_tensor().apply_op1(op)?.sum_all()?.to_dtype(DType::F32)?)?;
            target = Some(path.clone());
            injected += 1;
        }
        let report = scaler.step_fused(&loss, optimizer, None)?;
        match (&target, &report.skipped) {
            (None, None) => {}
            (Some(path), Some(SkipReason::GradientOverflow { param })) => {
                assert_eq!(param, path, "step {step}: the report names the injected parameter")
            }
            _ => panic!("step {step}: injected into {target:?}, got {report}"),
        }
        assert!(all_finite(net, optimizer)?, "step {step}: a non-finite value reached the weights or state");
        let scale = scaler.scale();
        assert!(scale >= config.min_scale && scale <= config.max_scale, "step {step}: scale {scale}");
        at_floor += u64::from(scale == config.min_scale);
    }
    assert!(at_floor > 0, "the bursts drove the scale to its floor");
    Ok((injected, scaler.state().skipped))
}

#[test]
fn a_storm_of_non_finite_gradients_never_reaches_the_weights() -> Outcome {
    let net = fp16_net(SIZES.0, SIZES.1, SIZES.2, 5)?;
    let mut adam = FusedAdamW::new(ParamGroups::from_model(&net)?, AdamConfig::default())?;
    let (injected, skipped) = storm(&mut adam, &net, 1)?;
    println!("non-finite storm, AdamW: {STEPS} steps, {injected} injected, {skipped} skipped");
    assert_eq!(skipped, injected);

    let net = fp16_net(SIZES.0, SIZES.1, SIZES.2, 6)?;
    let mut lamb = FusedLamb::new(ParamGroups::from_model(&net)?, LambConfig::default())?;
    let (injected, skipped) = storm(&mut lamb, &net, 2)?;
    println!("non-finite storm, LAMB: {STEPS} steps, {injected} injected, {skipped} skipped");
    assert_eq!(skipped, injected);
    Ok(())
}

/// Two fp16 layers with nothing between them, so a large activation of the first reaches the second.
#[derive(AmpModule)]
struct Stack {
    first: Linear,
    second: Linear,
}

impl Module for Stack {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.second.forward(&self.first.forward(x)?)
    }
}

#[test]
fn a_nan_input_and_an_fp16_overflow_inside_the_model_skip_the_step() -> Outcome {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut model = Stack {
        first: linear(SIZES.0, SIZES.1, vb.pp("first"))?,
        second: linear(SIZES.1, SIZES.2, vb.pp("second"))?,
    };
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Fp16))?;
    let mut adam = FusedAdamW::new(ParamGroups::from_model(&model)?, AdamConfig::default())?;
    let mut scaler = GradScaler::new(ScalerConfig { init_scale: 1024.0, ..Default::default() })?;
    let (x, y) = reliability::batch(0, 8, SIZES.0, SIZES.2)?;
    let loss = |x: &Tensor| (model.forward(x)? - &y)?.sqr()?.mean_all();

    let before = reliability::snapshot(&model, &[&adam])?;
    let mut values = x.flatten_all()?.to_vec1::<f32>()?;
    values[5] = f32::NAN;
    let nan_x = Tensor::from_vec(values, x.shape(), &Device::Cpu)?;
    let report = scaler.step_fused(&loss(&nan_x)?, &mut adam, None)?;
    assert_eq!(report.skipped, Some(SkipReason::NonFiniteLoss), "{report}");
    assert_eq!(reliability::snapshot(&model, &[&adam])?, before, "a NaN input changed nothing");

    // First-layer weights of 5000 and inputs of 4 or more: every activation of the first layer is above
    // 80,000, past fp16's 65504, and the second layer computes in fp16.
    let first = model.first.weight();
    first.master().set(&(first.master().as_tensor().ones_like()? * 5000.0)?)?;
    first.refresh_working()?;
    let big_x = (x.abs()? + 4.0)?;
    let hidden = model.first.forward(&big_x)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    assert!(hidden.iter().all(|h| *h > 65504.0), "the activation leaves fp16's range");
    let before = reliability::snapshot(&model, &[&adam])?;
    let report = scaler.step_fused(&loss(&big_x)?, &mut adam, None)?;
    assert!(!report.applied(), "{report}");
    assert_eq!(reliability::snapshot(&model, &[&adam])?, before, "an overflowing activation changed nothing");
    assert_eq!(adam.steps()?, 0);
    Ok(())
}

/// An fp16 layer into a BatchNorm, whose forward folds the batch's statistics into its running ones.
#[derive(AmpModule)]
struct Normed {
    first: Linear,
    norm: BatchNorm,
}

impl Module for Normed {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.norm.forward_t(&self.first.forward(x)?, true)
    }
}

/// A NaN and an infinite input into a BatchNorm: the skipped steps leave its running statistics (buffers, which
/// checkpoints save) as they were, where folding a NaN batch mean in would have made every later eval
/// forward NaN. A finite step then moves them.
#[test]
fn a_skipped_step_leaves_batch_norm_running_statistics_unchanged() -> Outcome {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut model = Normed {
        first: linear(SIZES.0, SIZES.1, vb.pp("first"))?,
        norm: batch_norm(SIZES.1, 1e-5, vb.pp("norm"))?,
    };
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Fp16))?;
    let mut adam = FusedAdamW::new(ParamGroups::from_model(&model)?, AdamConfig::default())?;
    let mut scaler = GradScaler::new(ScalerConfig { init_scale: 1024.0, ..Default::default() })?;
    let (x, _) = reliability::batch(0, 8, SIZES.0, SIZES.2)?;
    let loss = |x: &Tensor| model.forward(x)?.sqr()?.mean_all();
    assert!(model.named_buffers().len() == 2, "the snapshot sees the running statistics");

    let before = reliability::snapshot(&model, &[&adam])?;
    let mut values = x.flatten_all()?.to_vec1::<f32>()?;
    values[5] = f32::NAN;
    let nan_x = Tensor::from_vec(values, x.shape(), &Device::Cpu)?;
    let report = scaler.step_fused(&loss(&nan_x)?, &mut adam, None)?;
    assert!(!report.applied(), "{report}");
    assert_eq!(reliability::snapshot(&model, &[&adam])?, before, "a NaN input changed nothing");

    // An infinite input: the batch's mean is inf and its variance NaN.
    let mut values = x.flatten_all()?.to_vec1::<f32>()?;
    values[3] = f32::INFINITY;
    let inf_x = Tensor::from_vec(values, x.shape(), &Device::Cpu)?;
    let report = scaler.step_fused(&loss(&inf_x)?, &mut adam, None)?;
    assert!(!report.applied(), "{report}");
    assert_eq!(reliability::snapshot(&model, &[&adam])?, before, "an infinite input changed nothing");

    let mean = || model.norm.running_mean().to_vec1::<f32>();
    let stale = mean()?;
    model.forward(&x)?;
    assert_ne!(mean()?, stale, "a finite batch moves the running mean");
    assert!(mean()?.iter().all(|m| m.is_finite()));
    Ok(())
}
