//! Where an O2 parameter's gradient goes ([`GradientRoute`]). On amp's CPU GEMM a Linear's product
//! differentiates the fp32 master and reads the half working copy's values, and so does its bias: the
//! forward is the working-copy forward bit for bit, and the weight and bias gradients are the same f32
//! sums as ever, no longer rounded to half (under `GradientRoute::Working` each is that sum rounded
//! once to the working precision: so the two agree exactly after that rounding). A weight read both ways has
//! two gradients; amp's steps add them, a bare `GradStore` handed to an optimizer is refused.

use amp::dispatch::{self, Override};
use amp::nn::{linear, Linear};
use amp::optim::{AdamConfig, FusedAdamW, FusedOptimizer, ParamGroups};
use amp::scaler::ScalerConfig;
use amp::{AmpConfig, AmpModule, AmpModuleExt, Error, GradScaler, GradientRoute, OptLevel, Precision};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};

mod common;

#[derive(AmpModule)]
struct Mlp {
    up: Linear,
    down: Linear,
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.down.forward(&self.up.forward(x)?.relu()?)
    }
}

fn mlp(half: Precision, route: GradientRoute) -> amp::Result<Mlp> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut net = Mlp { up: linear(24, 40, vb.pp("up"))?, down: linear(40, 8, vb.pp("down"))? };
    for (i, (_, param)) in net.named_params().into_iter().enumerate() {
        let dims = param.master().dims().to_vec();
        param.master().set(&common::uniform_in(7 + i as u64, &dims, -0.4, 0.4, DType::F32)?)?;
    }
    amp::initialize(&mut net, AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(half))?;
    amp::set_gradient_route(&mut net, route);
    Ok(net)
}

fn batch(seed: u64) -> candle_core::Result<(Tensor, Tensor)> {
    Ok((
        common::uniform_in(seed, &[16, 24], -1.0, 1.0, DType::F32)?,
        common::uniform_in(seed + 1, &[16, 8], -1.0, 1.0, DType::F32)?,
    ))
}

fn loss(net: &Mlp, seed: u64) -> candle_core::Result<Tensor> {
    let (x, y) = batch(seed)?;
    amp::ops::loss::mse(&net.forward(&x)?, &y)
}

fn bits(t: &Tensor) -> candle_core::Result<Vec<u32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
}

#[test]
fn the_master_route_reads_the_working_copy_and_keeps_weight_and_bias_gradients_unrounded() -> amp::Result<()>
{
    for half in [Precision::Bf16, Precision::Fp16] {
        let (master, working) = (mlp(half, GradientRoute::Master)?, mlp(half, GradientRoute::Working)?);
        let (lm, lw) = (loss(&master, 1)?, loss(&working, 1)?);
        assert_eq!(bits(&lm)?, bits(&lw)?, "{half:?}: the forward is the working copy's, bit for bit");
        let (gm, gw) = (lm.backward()?, lw.backward()?);
        for ((path, pm), (_, pw)) in master.named_params().iter().zip(&working.named_params()) {
            let on_master = gm.get(pm.master().as_tensor());
            let on_working = gw.get(pw.trainable().as_tensor()).expect("a working-copy gradient");
            assert_eq!(on_working.dtype(), half.dtype(), "{half:?} {path}");
            // Weights from amp's GEMM, biases through the op that reads the master as its working copy.
            let grad = on_master.expect("the master route keys the gradient by the master");
            assert_eq!(grad.dtype(), DType::F32, "{half:?} {path}");
            assert!(gm.get(pm.trainable().as_tensor()).is_none(), "{half:?} {path}: one gradient only");
            assert_eq!(
                bits(&grad.to_dtype(half.dtype())?)?,
                bits(on_working)?,
                "{half:?} {path}: the working route's gradient is the master route's rounded once"
            );
        }
    }
    Ok(())
}

/// `down.bias`'s gradient for `sum(mlp(x) * r)` over 4096 rows is the column sums of `r`: under the
/// master route it is within f32's bound `gamma_n sum|r|` (n = 4096: 2.4e-4 of the sum, as every `r`
/// is positive) of the f64 sums, in bf16 and fp16; under the working route, rounded to bf16, it misses
/// that bound (a bf16 rounding is up to 2^-8 = 3.9e-3 of the sum).
#[test]
fn an_o2_bias_gradient_is_within_f32_bounds_of_the_f64_sum() -> amp::Result<()> {
    const ROWS: usize = 4096;
    let x = common::uniform_in(21, &[ROWS, 24], -1.0, 1.0, DType::F32)?;
    let r = common::uniform_in(22, &[ROWS, 8], 0.5, 1.0, DType::F32)?;
    let want = r.to_dtype(DType::F64)?.sum(0)?.to_vec1::<f64>()?;
    let nu = ROWS as f64 * common::unit_roundoff(DType::F32);
    let gamma = nu / (1.0 - nu);
    let error = |half, route| -> amp::Result<f64> {
        let net = mlp(half, route)?;
        let grads = (net.forward(&x)? * &r)?.sum_all()?.backward()?;
        let bias = net.down.bias().expect("a bias");
        let got =
            bias.grad("down.bias", &grads)?.expect("a gradient").to_dtype(DType::F64)?.to_vec1::<f64>()?;
        // Each column's error as a fraction of its bound (the sum of positive terms is its sum|r|).
        Ok(got.iter().zip(&want).map(|(g, w)| (g - w).abs() / (gamma * w)).fold(0.0, f64::max))
    };
    for half in [Precision::Bf16, Precision::Fp16] {
        let within = error(half, GradientRoute::Master)?;
        assert!(within <= 1.0, "{half:?}: {within:.3} of the f32 bound");
    }
    let rounded = error(Precision::Bf16, GradientRoute::Working)?;
    println!("O2 bias gradient, 4096 rows: the bf16 working copy's misses f32's bound by {rounded:.1}x");
    assert!(rounded > 1.0, "the bf16 working copy's gradient: {rounded:.3} of the f32 bound");
    Ok(())
}

#[test]
fn off_amps_gemm_every_gradient_stays_on_the_working_copy() -> amp::Result<()> {
    let net = mlp(Precision::Bf16, GradientRoute::Master)?;
    let grads = dispatch::with_override(Override::Candle, || loss(&net, 3)?.backward())??;
    for (path, param) in net.named_params() {
        assert!(grads.get(param.master().as_tensor()).is_none(), "{path}");
        assert_eq!(param.grad(&path, &grads)?.map(Tensor::dtype), Some(DType::BF16), "{path}");
    }
    Ok(())
}

/// 30 steps of fused AdamW under each route: the same training up to the gradients' half rounding.
#[test]
fn both_routes_train_alike() -> amp::Result<()> {
    let mut finals = Vec::new();
    for route in [GradientRoute::Master, GradientRoute::Working] {
        let net = mlp(Precision::Bf16, route)?;
        let mut adam =
            FusedAdamW::new(ParamGroups::from_model(&net)?, AdamConfig { lr: 3e-3, ..Default::default() })?;
        let mut scaler = GradScaler::for_model(&net, ScalerConfig::default())?;
        let first = loss(&net, 0)?.to_scalar::<f32>()?;
        for step in 0..30 {
            let report = scaler.step_fused(&loss(&net, 0)?, &mut adam, None)?;
            assert!(report.applied(), "{route:?} step {step}: {report}");
        }
        let last = loss(&net, 0)?.to_scalar::<f32>()?;
        assert!(last < 0.5 * first, "{route:?}: {first} -> {last}");
        finals.push(last);
    }
    let gap = (finals[0] - finals[1]).abs() / finals[1];
    assert!(gap < 0.05, "final losses {finals:?}");
    Ok(())
}

/// `down`'s weight read by its Linear (through the master) and by a penalty on the working copy.
fn split(net: &Mlp) -> candle_core::Result<GradStore> {
    let working = net.down.weight().trainable().as_tensor();
    let penalty = working.to_dtype(DType::F32)?.sqr()?.sum_all()?;
    (loss(net, 5)? + penalty)?.backward()
}

#[test]
fn a_weight_read_both_ways_gets_the_sum_and_a_bare_store_is_refused() -> amp::Result<()> {
    let net = mlp(Precision::Bf16, GradientRoute::Master)?;
    let weight = net.down.weight();
    let mut grads = split(&net)?;
    let (on_master, on_working) = (
        grads.get(weight.master().as_tensor()).expect("product gradient").clone(),
        grads.get(weight.trainable().as_tensor()).expect("penalty gradient").clone(),
    );
    let refused = weight.grad("down.weight", &grads);
    assert!(
        matches!(refused, Err(Error::SplitGradient { ref path }) if path == "down.weight"),
        "{refused:?}"
    );
    let mut adam = FusedAdamW::new(ParamGroups::from_model(&net)?, AdamConfig::default())?;
    let before = bits(weight.master().as_tensor())?;
    let err = adam.step(&grads).expect_err("an optimizer given both gradients refuses them");
    assert!(err.to_string().contains("grads_to_masters"), "{err}");
    assert_eq!(bits(weight.master().as_tensor())?, before, "nothing changed");

    amp::grads_to_masters(&net, &mut grads)?;
    let want = (&on_master + on_working.to_dtype(DType::F32)?)?;
    let folded = weight.grad("down.weight", &grads)?.expect("one gradient").clone();
    assert_eq!(bits(&folded)?, bits(&want)?, "the sum, in f32");
    assert!(grads.get(weight.trainable().as_tensor()).is_none());
    Ok(())
}

#[test]
fn a_fused_step_adds_the_two_gradients_itself() -> amp::Result<()> {
    // The same step twice: through `step_fused` (which runs backward and adds), and by hand.
    let (net, by_hand) =
        (mlp(Precision::Bf16, GradientRoute::Master)?, mlp(Precision::Bf16, GradientRoute::Master)?);
    let config = AdamConfig { lr: 1e-2, ..Default::default() };
    let mut adam = FusedAdamW::new(ParamGroups::from_model(&net)?, config)?;
    let mut scaler = GradScaler::disabled();
    let working = net.down.weight().trainable().as_tensor().clone();
    let total = (loss(&net, 5)? + working.to_dtype(DType::F32)?.sqr()?.sum_all()?)?;
    assert!(scaler.step_fused(&total, &mut adam, None)?.applied());

    let mut grads = split(&by_hand)?;
    let (master, working) =
        (by_hand.down.weight().master().as_tensor(), by_hand.down.weight().trainable().as_tensor());
    let from_working = grads.remove(working).expect("penalty gradient").to_dtype(DType::F32)?;
    let sum = (grads.get(master).expect("product gradient") + from_working)?;
    grads.insert(master, sum);
    let mut reference = FusedAdamW::new(ParamGroups::from_model(&by_hand)?, config)?;
    reference.step(&grads)?;
    amp::refresh_working_copies(&by_hand)?;
    for ((path, a), (_, b)) in net.named_params().iter().zip(&by_hand.named_params()) {
        assert_eq!(bits(a.master().as_tensor())?, bits(b.master().as_tensor())?, "{path}");
    }
    Ok(())
}

/// A step refused for a split gradient in its second group changes nothing: the first group's masters,
/// working copies and moments are as they were, and the step is not counted (the optimizer checks
/// every group before it updates any).
#[test]
fn an_optimizer_refuses_a_split_gradient_before_updating_any_group() -> amp::Result<()> {
    use amp::optim::{GroupOptions, OptimParam};
    let net = mlp(Precision::Bf16, GradientRoute::Master)?;
    let groups = ParamGroups::from_model(&net)?
        .with_group(OptimParam::is_bias_or_norm, GroupOptions { weight_decay: Some(0.0), lr: None });
    let mut adam = FusedAdamW::new(groups, AdamConfig::default())?;
    // `down.bias` read by its Linear (through the master) and by a penalty on its working copy.
    let working = net.down.bias().expect("a bias").trainable().as_tensor().clone();
    let grads = (loss(&net, 5)? + working.to_dtype(DType::F32)?.sqr()?.sum_all()?)?.backward()?;
    let before: Vec<Vec<u32>> =
        net.named_params().iter().map(|(_, p)| bits(p.master().as_tensor())).collect::<Result<_, _>>()?;
    let refused = adam.step(&grads);
    assert!(matches!(refused, Err(Error::SplitGradient { ref path }) if path == "down.bias"), "{refused:?}");
    let after: Vec<Vec<u32>> =
        net.named_params().iter().map(|(_, p)| bits(p.master().as_tensor())).collect::<Result<_, _>>()?;
    assert_eq!(after, before, "no group was updated");
    assert_eq!(adam.steps()?, 0, "nor the step counted");
    Ok(())
}
