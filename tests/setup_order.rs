//! Mistakes in the order of a training loop's setup, and losses that are not one value: each is refused
//! with the reason and the fix, and nothing changes. Without the refusals, an optimizer built before
//! `amp::initialize` steps the masters while forward reads working copies it never refreshes (the loss
//! stays flat on steps reported as applied), a scaler built before an fp16 model was initialized leaves
//! its fp16 gradients unscaled, and a per-sample loss is silently summed.

use amp::nn::{linear, Linear};
use amp::optim::{AdamConfig, FusedAdamW, ParamGroups};
use amp::scaler::{GradAccumulator, ScalerConfig};
use amp::{AmpConfig, AmpModule, AmpModuleExt, Error, GradScaler, OptLevel, Precision};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};

#[derive(AmpModule)]
struct Net {
    fc1: Linear,
    fc2: Linear,
}

#[derive(AmpModule)]
struct Fp16Head {
    fc1: Linear,
    #[amp(fp16)]
    fc2: Linear,
}

fn layers(vb: &VarBuilder<'_>) -> candle_core::Result<(Linear, Linear)> {
    Ok((linear(4, 8, vb.pp("fc1"))?, linear(8, 2, vb.pp("fc2"))?))
}

fn net() -> candle_core::Result<Net> {
    let vb = VarBuilder::from_varmap(&VarMap::new(), DType::F32, &Device::Cpu);
    let (fc1, fc2) = layers(&vb)?;
    Ok(Net { fc1, fc2 })
}

fn input() -> candle_core::Result<Tensor> {
    Tensor::arange(0f32, 24.0, &Device::Cpu)?.reshape((6, 4))?.affine(0.1, -1.0)
}

fn outputs(fc1: &Linear, fc2: &Linear) -> candle_core::Result<Tensor> {
    fc2.forward(&fc1.forward(&input()?)?.relu()?)?.to_dtype(DType::F32)
}

fn loss(net: &Net) -> candle_core::Result<Tensor> {
    outputs(&net.fc1, &net.fc2)?.sqr()?.mean_all()
}

/// Every parameter's master and trainable values, bit for bit.
fn bits<M: AmpModule>(model: &M) -> amp::Result<Vec<Vec<u32>>> {
    let mut all = Vec::new();
    for (_, p) in model.unique_params() {
        for var in [p.master(), p.trainable()] {
            let values = var.as_tensor().to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            all.push(values.iter().map(|v| v.to_bits()).collect());
        }
    }
    Ok(all)
}

fn adam<M: AmpModule>(model: &M) -> amp::Result<FusedAdamW> {
    FusedAdamW::new(ParamGroups::from_model(model)?, AdamConfig { lr: 1e-2, ..AdamConfig::default() })
}

#[test]
fn an_optimizer_built_before_initialize_is_refused_and_one_built_after_trains() -> amp::Result<()> {
    let mut model = net()?;
    let mut early = adam(&model)?;
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Bf16))?;
    let mut scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
    let before = bits(&model)?;

    let err = scaler.step_fused(&loss(&model)?, &mut early, None).unwrap_err();
    assert!(matches!(&err, Error::StaleParams { path } if path == "fc1.weight"), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains("after `amp::initialize`") && message.contains("nothing was changed"),
        "{message}"
    );
    assert_eq!(bits(&model)?, before, "a refused step changed the model");
    assert_eq!(scaler.state().steps, 0, "a refused step was counted");
    // The optimizer's own step refuses too, for loops that run backward themselves.
    let grads = loss(&model)?.backward()?;
    let err = amp::optim::FusedOptimizer::step(&mut early, &grads).unwrap_err();
    assert!(matches!(err, Error::StaleParams { .. }), "{err:?}");
    assert_eq!(bits(&model)?, before);

    // Built after `initialize`, the optimizer moves what forward reads.
    let mut optimizer = adam(&model)?;
    let first = loss(&model)?.to_scalar::<f32>()?;
    for _ in 0..20 {
        assert!(scaler.step_fused(&loss(&model)?, &mut optimizer, None)?.applied());
    }
    let last = loss(&model)?.to_scalar::<f32>()?;
    assert!(last < 0.5 * first, "loss {first} -> {last}");
    Ok(())
}

#[test]
fn initializing_again_to_another_half_makes_the_old_optimizer_stale() -> amp::Result<()> {
    let mut model = net()?;
    let device = Device::Cpu;
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O2, &device).with_half(Precision::Bf16))?;
    let mut optimizer = adam(&model)?;
    let mut scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
    assert!(scaler.step_fused(&loss(&model)?, &mut optimizer, None)?.applied());
    // The same level again converts nothing: the optimizer stays good.
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O2, &device).with_half(Precision::Bf16))?;
    assert!(scaler.step_fused(&loss(&model)?, &mut optimizer, None)?.applied());

    amp::initialize(&mut model, AmpConfig::new(OptLevel::O2, &device).with_half(Precision::Fp16))?;
    let mut scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
    let before = bits(&model)?;
    let err = scaler.step_fused(&loss(&model)?, &mut optimizer, None).unwrap_err();
    assert!(matches!(err, Error::StaleParams { .. }), "{err:?}");
    assert_eq!(bits(&model)?, before);
    Ok(())
}

#[test]
fn a_scaler_built_before_the_model_became_fp16_is_refused() -> amp::Result<()> {
    // fp16 from the level's half type, which no attribute names: only the run time knows it.
    let mut model = net()?;
    let mut scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
    assert!(!scaler.is_enabled(), "an fp32 model needs no scaling");
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Fp16))?;
    let mut optimizer = adam(&model)?;
    let before = bits(&model)?;

    let err = scaler.step_fused(&loss(&model)?, &mut optimizer, None).unwrap_err();
    let Error::ScalerBuiltBeforeFp16 { found } = &err else {
        panic!("expected ScalerBuiltBeforeFp16: {err:?}")
    };
    assert_eq!(found, "`fc1.weight` is stored in fp16");
    assert!(err.to_string().contains("Build the scaler after `amp::initialize`"), "{err}");
    let err = scaler.step(&model, &loss(&model)?, |_| Ok(())).unwrap_err();
    assert!(matches!(&err, Error::ScalerBuiltBeforeFp16 { found } if found == "`fc1` computes in fp16"));
    let mut accumulator = GradAccumulator::new();
    let err = scaler.accumulate(&model, &loss(&model)?, &mut accumulator).unwrap_err();
    assert!(matches!(err, Error::ScalerBuiltBeforeFp16 { .. }), "{err:?}");
    assert!(accumulator.is_empty());
    assert_eq!(bits(&model)?, before);

    // O1 keeps f32 parameters and computes in fp16 (the optimizer taken before, which O1 leaves good).
    let mut model = net()?;
    let mut scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
    let mut optimizer = adam(&model)?;
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O1, &Device::Cpu).with_half(Precision::Fp16))?;
    let err = scaler.step_fused(&loss(&model)?, &mut optimizer, None).unwrap_err();
    let expected = "the layer of `fc1.weight` computes in fp16";
    assert!(matches!(&err, Error::ScalerBuiltBeforeFp16 { found } if found == expected), "{err:?}");

    // Built after `initialize`, the scaler is enabled and steps apply. The first may overflow fp16 at
    // the initial scale of 2^16 and be skipped, halving the scale (about one run in twenty, with the
    // layers' random initial weights), as a dynamic scaler does.
    let mut scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
    assert!(scaler.is_enabled());
    let mut reports = Vec::new();
    while reports.len() < 4 {
        let report = scaler.step_fused(&loss(&model)?, &mut optimizer, None)?;
        let applied = report.applied();
        reports.push(report);
        if applied {
            break;
        }
    }
    assert!(reports.last().is_some_and(|r| r.applied()), "{reports:?}");
    Ok(())
}

#[test]
fn an_fp16_attribute_enables_the_scaler_before_initialize_and_an_explicit_disable_is_kept() -> amp::Result<()>
{
    let vb = VarBuilder::from_varmap(&VarMap::new(), DType::F32, &Device::Cpu);
    let (fc1, fc2) = layers(&vb)?;
    let mut model = Fp16Head { fc1, fc2 };
    let mut scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
    assert!(scaler.is_enabled(), "`#[amp(fp16)]` is known at compile time");
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Bf16))?;
    let mut optimizer = adam(&model)?;
    let head_loss = |m: &Fp16Head| outputs(&m.fc1, &m.fc2)?.sqr()?.mean_all();
    assert!(scaler.step_fused(&head_loss(&model)?, &mut optimizer, None)?.applied());
    // `GradScaler::disabled()` is a choice (the loss-scaling example trains fp16 unscaled on purpose).
    let report = GradScaler::disabled().step_fused(&head_loss(&model)?, &mut optimizer, None)?;
    assert!(report.applied());
    Ok(())
}

#[test]
fn a_scaler_config_is_checked_even_when_the_model_needs_no_scaling() {
    let model = net().unwrap();
    let config = ScalerConfig { init_scale: -5.0, ..ScalerConfig::default() };
    let err = GradScaler::for_model(&model, config).unwrap_err();
    assert!(matches!(err, Error::InvalidScalerConfig { .. }), "{err:?}");
}

#[test]
fn a_loss_of_more_or_fewer_than_one_value_is_refused() -> amp::Result<()> {
    let mut model = net()?;
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Bf16))?;
    let mut optimizer = adam(&model)?;
    let mut scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
    let before = bits(&model)?;
    let per_sample = outputs(&model.fc1, &model.fc2)?.sqr()?; // (6, 2): not reduced
    let empty = per_sample.narrow(0, 0, 0)?;

    for bad in [&per_sample, &empty] {
        let err = scaler.step_fused(bad, &mut optimizer, None).unwrap_err();
        assert!(matches!(&err, Error::LossNotScalar { shape } if shape == bad.dims()), "{err:?}");
        assert!(err.to_string().contains("`.mean_all()`"), "{err}");
        let err = scaler.step(&model, bad, |_| Ok(())).unwrap_err();
        assert!(matches!(err, Error::LossNotScalar { .. }), "{err:?}");
        let err = scaler.accumulate(&model, bad, &mut GradAccumulator::new()).unwrap_err();
        assert!(matches!(err, Error::LossNotScalar { .. }), "{err:?}");
        let err = scaler.scale_loss(bad).unwrap_err();
        assert!(matches!(err, Error::LossNotScalar { .. }), "{err:?}");
    }
    assert_eq!(bits(&model)?, before);
    assert_eq!(scaler.state().steps, 0);

    // One value in any shape is a loss: [1] as PyTorch takes it.
    let one = per_sample.mean_all()?.reshape(1)?;
    assert!(scaler.step_fused(&one, &mut optimizer, None)?.applied());
    Ok(())
}

#[test]
fn a_later_step_whose_loss_reaches_none_of_the_optimizers_parameters_is_refused() -> amp::Result<()> {
    let config = AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Bf16);
    let (mut a, mut b) = (net()?, net()?);
    amp::initialize(&mut a, config)?;
    amp::initialize(&mut b, config)?;
    let mut optimizer = adam(&a)?;
    let mut scaler = GradScaler::for_model(&a, ScalerConfig::default())?;
    assert!(scaler.step_fused(&loss(&a)?, &mut optimizer, None)?.applied());
    let (before_a, before_b) = (bits(&a)?, bits(&b)?);
    // The other model's loss, after a first step that checked every parameter.
    let err = scaler.step_fused(&loss(&b)?, &mut optimizer, None).unwrap_err();
    let Error::NoGradient { params } = &err else { panic!("expected NoGradient: {err:?}") };
    assert_eq!(params.0.len(), 4, "{err}");
    assert!(err.to_string().contains("the loss does not depend on the optimizer's parameters"), "{err}");
    assert_eq!((bits(&a)?, bits(&b)?), (before_a, before_b));
    assert_eq!(scaler.state().steps, 1, "the refused step was counted");
    Ok(())
}
