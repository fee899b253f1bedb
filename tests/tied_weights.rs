//! Tied weights: two layers built on one variable (one `VarBuilder` name) share one parameter, at every
//! level. `amp::initialize` converts it once, so the layers keep one master and one working copy; the
//! optimizers, the scaler's unscale, the data-parallel broadcast and ZeRO-1 take it once. A model with
//! a tied pair trains bit for bit as a model that applies one layer twice.

use amp::distributed::{DataParallel, SingleProcess, Zero1};
use amp::nn::{linear, Linear};
use amp::optim::{AdamConfig, FusedAdamW, FusedOptimizer, ParamGroups};
use amp::scaler::ScalerConfig;
use amp::{AmpConfig, AmpModule, AmpModuleExt, Error, GradScaler, OptLevel, Precision};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Optimizer, VarBuilder, VarMap};

mod common;

/// `second(tanh(first(x)))`, the two layers on the same variables.
#[derive(AmpModule)]
struct Tied {
    first: Linear,
    second: Linear,
}

/// `layer(tanh(layer(x)))`: the same function with one layer.
#[derive(AmpModule)]
struct Twice {
    layer: Linear,
}

/// As `Tied`, with the second layer kept in fp32.
#[derive(AmpModule)]
struct TiedMixed {
    first: Linear,
    #[amp(fp32)]
    second: Linear,
}

trait Net: AmpModule {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor>;
}

impl Net for Tied {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.second.forward(&self.first.forward(x)?.tanh()?)
    }
}

impl Net for Twice {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.layer.forward(&self.layer.forward(x)?.tanh()?)
    }
}

const WIDTH: usize = 6;

/// Seeded values for the one weight and bias, built through `vb` under the name `shared`.
fn shared_layer(vb: &VarBuilder<'_>, varmap: &VarMap) -> candle_core::Result<Linear> {
    let layer = linear(WIDTH, WIDTH, vb.pp("shared"))?;
    // Seeded by shape, so the same values whatever order the map lists them in.
    for var in varmap.all_vars() {
        let seed = if var.rank() == 2 { 11 } else { 12 };
        var.set(&common::uniform_in(seed, var.dims(), -0.4, 0.4, DType::F32)?)?;
    }
    Ok(layer)
}

fn tied(config: AmpConfig) -> amp::Result<Tied> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let first = shared_layer(&vb, &varmap)?;
    let mut model = Tied { first, second: linear(WIDTH, WIDTH, vb.pp("shared"))? };
    amp::initialize(&mut model, config)?;
    Ok(model)
}

fn twice(config: AmpConfig) -> amp::Result<Twice> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut model = Twice { layer: shared_layer(&vb, &varmap)? };
    amp::initialize(&mut model, config)?;
    Ok(model)
}

fn batch(seed: u64) -> candle_core::Result<(Tensor, Tensor)> {
    Ok((
        common::uniform_in(seed, &[16, WIDTH], -1.0, 1.0, DType::F32)?,
        common::uniform_in(seed + 100, &[16, WIDTH], -1.0, 1.0, DType::F32)?,
    ))
}

fn loss(model: &impl Net, seed: u64) -> candle_core::Result<Tensor> {
    let (x, y) = batch(seed)?;
    amp::ops::loss::mse(&model.forward(&x)?, &y)
}

fn bits(t: &Tensor) -> candle_core::Result<Vec<u32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
}

/// The masters of `model`'s unique parameters, as bits.
fn masters(model: &impl AmpModule) -> candle_core::Result<Vec<Vec<u32>>> {
    model.unique_params().iter().map(|(_, p)| bits(p.master().as_tensor())).collect()
}

fn configs() -> [(&'static str, AmpConfig); 4] {
    let dev = Device::Cpu;
    [
        ("fp32 O0", AmpConfig::new(OptLevel::O0, &dev)),
        ("bf16 O1", AmpConfig::new(OptLevel::O1, &dev).with_half(Precision::Bf16)),
        ("bf16 O2", AmpConfig::new(OptLevel::O2, &dev).with_half(Precision::Bf16)),
        ("fp16 O2", AmpConfig::new(OptLevel::O2, &dev).with_half(Precision::Fp16)),
    ]
}

#[test]
fn every_level_keeps_a_tied_parameter_one_variable() -> amp::Result<()> {
    let dev = Device::Cpu;
    let o3 = AmpConfig::new(OptLevel::O3, &dev).with_half(Precision::Bf16);
    let mut model = tied(o3)?;
    // O3, then O2 from there, then back to O0: each conversion keeps the pair shared.
    for config in [None, Some(configs()[2].1), Some(configs()[0].1)] {
        if let Some(config) = config {
            amp::initialize(&mut model, config)?;
        }
        let bias = |l: &Linear| l.bias().cloned().expect("a bias");
        let pairs = [
            (model.first.weight().clone(), model.second.weight().clone()),
            (bias(&model.first), bias(&model.second)),
        ];
        for (a, b) in pairs {
            assert_eq!(a.master().as_tensor().id(), b.master().as_tensor().id(), "{:?}", a.storage());
            assert_eq!(a.trainable().as_tensor().id(), b.trainable().as_tensor().id(), "{:?}", a.storage());
        }
        assert_eq!(model.named_params().len(), 4, "named under each path");
        let unique: Vec<String> = model.unique_params().into_iter().map(|(path, _)| path).collect();
        assert_eq!(unique, ["first.weight", "first.bias"], "once, at the first path");
        assert_eq!(model.master_vars().len(), 2);
        // O3 has no fp32 master for the fused optimizers; the others list the pair once.
        if model.first.weight().storage() != amp::ParamStorage::Half(Precision::Bf16) {
            assert_eq!(ParamGroups::from_model(&model)?.params().len(), 2);
        }
    }
    Ok(())
}

#[test]
fn a_tied_pair_trains_as_one_layer_applied_twice() -> amp::Result<()> {
    for (name, config) in configs() {
        let (pair, single) = (tied(config)?, twice(config)?);
        let adam = |groups| FusedAdamW::new(groups, AdamConfig { lr: 1e-2, ..Default::default() });
        let (mut pair_adam, mut single_adam) =
            (adam(ParamGroups::from_model(&pair)?)?, adam(ParamGroups::from_model(&single)?)?);
        assert_eq!(pair_adam.param_groups().params().len(), 2, "{name}: weight and bias once");
        let scaler = || GradScaler::new(ScalerConfig { init_scale: 1024.0, ..Default::default() });
        let (mut pair_scaler, mut single_scaler) = (scaler()?, scaler()?);
        let start = masters(&pair)?;
        for step in 0..5 {
            let a = pair_scaler.step_fused(&loss(&pair, step)?, &mut pair_adam, Some(1.0))?;
            let b = single_scaler.step_fused(&loss(&single, step)?, &mut single_adam, Some(1.0))?;
            assert!(a.applied() && b.applied(), "{name} step {step}: {a} / {b}");
        }
        assert_eq!(masters(&pair)?, masters(&single)?, "{name}: the same masters, bit for bit");
        assert_ne!(masters(&pair)?, start, "{name}: and they moved");
        assert_eq!(pair_adam.steps()?, 5);
        let working = |l: &Linear| bits(l.weight().trainable().as_tensor());
        assert_eq!(working(&pair.first)?, working(&pair.second)?, "{name}: one working copy");
        assert_eq!(working(&pair.first)?, working(&single.layer)?, "{name}");
    }
    Ok(())
}

/// `GradScaler::step` with a candle optimizer over `master_vars()`: the tied gradient is unscaled once
/// (fp16 at scale 1024) and the master stepped once.
#[test]
fn a_candle_optimizer_steps_a_tied_master_once() -> amp::Result<()> {
    let config = AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Fp16);
    let (pair, single) = (tied(config)?, twice(config)?);
    let (mut pair_sgd, mut single_sgd) =
        (candle_nn::SGD::new(pair.master_vars(), 0.1)?, candle_nn::SGD::new(single.master_vars(), 0.1)?);
    assert_eq!(pair.master_vars().len(), 2);
    let scaler = || GradScaler::new(ScalerConfig { init_scale: 1024.0, ..Default::default() });
    let (mut pair_scaler, mut single_scaler) = (scaler()?, scaler()?);
    for step in 0..3 {
        let a = pair_scaler.step(&pair, &loss(&pair, step)?, |g| Ok(pair_sgd.step(g)?))?;
        let b = single_scaler.step(&single, &loss(&single, step)?, |g| Ok(single_sgd.step(g)?))?;
        assert!(a.applied() && b.applied(), "step {step}: {a} / {b}");
    }
    assert_eq!(masters(&pair)?, masters(&single)?, "the same masters, bit for bit");
    Ok(())
}

/// Data parallelism on a world of one: the broadcast and the steps take the tied parameter once, and
/// ZeRO-1's sharding finds it under both paths.
#[test]
fn data_parallel_and_zero_take_a_tied_parameter_once() -> amp::Result<()> {
    let config = AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Bf16);
    let comm = SingleProcess::new();
    let (pair, single) = (tied(config)?, twice(config)?);
    let mut dp = DataParallel::new(&comm, Default::default())?;
    dp.broadcast_masters(&pair)?;
    let adam = |groups| FusedAdamW::new(groups, AdamConfig::default());
    let (mut pair_adam, mut single_adam) =
        (adam(ParamGroups::from_model(&pair)?)?, adam(ParamGroups::from_model(&single)?)?);
    let (mut pair_scaler, mut single_scaler) = (GradScaler::disabled(), GradScaler::disabled());
    for step in 0..3 {
        dp.step_fused(&mut pair_scaler, &loss(&pair, step)?, &mut pair_adam, Some(1.0))?;
        single_scaler.step_fused(&loss(&single, step)?, &mut single_adam, Some(1.0))?;
    }
    assert_eq!(masters(&pair)?, masters(&single)?, "the same masters, bit for bit");

    let mut pair = tied(config)?;
    let mut zero = Zero1::new(&comm, ParamGroups::from_model(&pair)?, Default::default())?;
    assert_eq!(zero.shard_masters(&mut pair)?, 0, "one rank owns everything");
    Ok(())
}

#[test]
fn tied_layers_of_different_precisions_are_refused() -> amp::Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let first = shared_layer(&vb, &varmap)?;
    let mut model = TiedMixed { first, second: linear(WIDTH, WIDTH, vb.pp("shared"))? };
    let config = AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Bf16);
    let refused = amp::initialize(&mut model, config);
    match &refused {
        Err(Error::TiedStorageDiffers { path, tied_to, .. }) => {
            assert_eq!((path.as_str(), tied_to.as_str()), ("second.weight", "first.weight"));
        }
        other => panic!("expected TiedStorageDiffers, got {other:?}"),
    }
    let message = refused.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(message.contains("same precision") && message.contains("`first.weight`"), "{message}");
    assert!(!message.contains("  "), "one line of words: {message:?}");
    Ok(())
}
