//! The loss scaler: skipped steps leave every weight bit-identical, a NaN loss stops at the floor with a
//! diagnostic, the scale follows a reference state machine exactly, and a resumed run matches an
//! uninterrupted one.

mod common;

use amp::nn::{linear, Linear};
use amp::scaler::{AtScaleFloor, ScaleChange, ScalerConfig, SkipReason};
use amp::{AmpConfig, AmpModule, AmpModuleExt, GradScaler, OptLevel, Precision};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use proptest::prelude::*;

#[derive(AmpModule)]
struct Net {
    hidden: Linear,
    out: Linear,
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.out.forward(&self.hidden.forward(x)?.tanh()?)
    }
}

/// The same weights every run (seeded, uniform in [-1/4, 1/4)), so every scale trajectory is reproducible.
fn fp16_net() -> amp::Result<Net> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut net = Net { hidden: linear(4, 16, vb.pp("hidden"))?, out: linear(16, 1, vb.pp("out"))? };
    let mut vars: Vec<(String, Var)> =
        varmap.data().lock().expect("no other thread holds the map").clone().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (seed, (_, var)) in vars.iter().enumerate() {
        var.set(&common::uniform_in(seed as u64, var.dims(), -0.25, 0.25, DType::F32)?)?;
    }
    amp::initialize(&mut net, AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Fp16))?;
    Ok(net)
}

/// A net with candle-nn's initial weights, initialized with `config`.
fn net_with(config: AmpConfig) -> amp::Result<Net> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut net = Net { hidden: linear(4, 16, vb.pp("hidden"))?, out: linear(16, 1, vb.pp("out"))? };
    amp::initialize(&mut net, config)?;
    Ok(net)
}

/// A momentum SGD over the masters whose state the test can inspect.
struct Sgd {
    velocity: Vec<Var>,
}

impl Sgd {
    fn new(net: &Net) -> amp::Result<Self> {
        let masters = net.master_vars();
        let velocity = masters.iter().map(|v| Var::zeros(v.shape(), DType::F32, &Device::Cpu));
        Ok(Sgd { velocity: velocity.collect::<candle_core::Result<_>>()? })
    }

    fn step(&self, net: &Net, grads: &candle_core::backprop::GradStore) -> amp::Result<()> {
        for (master, velocity) in net.master_vars().iter().zip(&self.velocity) {
            if let Some(grad) = grads.get(master.as_tensor()) {
                velocity.set(&((velocity.as_tensor() * 0.9)? + grad)?)?;
                master.set(&(master.as_tensor() - (velocity.as_tensor() * 0.05)?)?)?;
            }
        }
        Ok(())
    }
}

fn snapshot(net: &Net, sgd: &Sgd) -> Vec<Vec<u32>> {
    let bits = |t: &Tensor| -> Vec<u32> {
        let t = t.to_dtype(DType::F32).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1::<f32>());
        t.map(|v| v.iter().map(|x| x.to_bits()).collect()).unwrap_or_default()
    };
    let mut all: Vec<Vec<u32>> =
        net.named_params().iter().map(|(_, p)| bits(p.master().as_tensor())).collect();
    all.extend(net.named_params().iter().filter_map(|(_, p)| p.working().map(|w| bits(w.as_tensor()))));
    all.extend(sgd.velocity.iter().map(|v| bits(v.as_tensor())));
    all
}

fn batch(step: usize) -> candle_core::Result<(Tensor, Tensor)> {
    let x = Tensor::arange(0f32, 32.0, &Device::Cpu)?.reshape((8, 4))?;
    let x = ((x * 0.1)? + step as f64 * 0.01)?.sin()?;
    let y = x.sum_keepdim(1)?.cos()?;
    Ok((x, y))
}

/// `GradScaler::step` itself, with a finite loss whose backward makes one gradient non-finite: the
/// optimizer's closure is never called, every weight and the optimizer state stay bit-identical, the
/// report names the parameter and the scale backs off.
#[test]
fn step_skips_a_non_finite_gradient_without_calling_the_optimizer() -> amp::Result<()> {
    // Terms of the out layer's fp16 working copy `w` with a finite value and a non-finite gradient:
    // sqrt(w - w) is 0, its gradient inf - inf = NaN (candle prunes a product with 0 from the graph);
    // 65504 w / 100 sends back 65504 times a hundredth of the scale, past fp16's range.
    type Term = fn(&Tensor) -> candle_core::Result<Tensor>;
    let terms: [(&str, Term); 2] = [
        ("NaN", |w| (w - w)?.sqrt()?.to_dtype(DType::F32)?.sum_all()),
        ("inf", |w| (w * 65504.0)?.to_dtype(DType::F32)?.sum_all()? * 1e-2),
    ];
    for (what, term) in terms {
        let net = fp16_net()?;
        let sgd = Sgd::new(&net)?;
        let mut scaler =
            GradScaler::for_model(&net, ScalerConfig { init_scale: 1024.0, ..Default::default() })?;
        let (x, y) = batch(0)?;
        let loss = (net.forward(&x)? - &y)?.sqr()?.mean_all()?;
        let report = scaler.step(&net, &loss, |grads| sgd.step(&net, grads))?;
        assert!(report.applied(), "{report}");
        let before = snapshot(&net, &sgd);
        let w = net.out.weight().trainable().as_tensor();
        let loss = (loss + term(w)?)?;
        assert!(loss.to_scalar::<f32>()?.is_finite(), "{what}: the loss stays finite");
        let mut called = false;
        let report = scaler.step(&net, &loss, |_| {
            called = true;
            Ok(())
        })?;
        assert!(!called, "{what}: the optimizer was called: {report}");
        assert!(!report.applied(), "{what}: {report}");
        assert_eq!(
            report.skipped,
            Some(SkipReason::GradientOverflow { param: "out.weight".into() }),
            "{what}"
        );
        assert_eq!(report.scale_after, 512.0, "{what}: the scale backs off");
        assert_eq!(snapshot(&net, &sgd), before, "{what}: masters, working copies and state bit-identical");
    }
    Ok(())
}

#[test]
fn a_non_finite_gradient_skips_the_step_and_changes_nothing() -> amp::Result<()> {
    for poison in [f32::INFINITY, f32::NAN] {
        let net = fp16_net()?;
        let sgd = Sgd::new(&net)?;
        let mut scaler =
            GradScaler::for_model(&net, ScalerConfig { init_scale: 1024.0, ..Default::default() })?;
        assert!(scaler.is_enabled());
        let mut losses = Vec::new();
        for step in 0..200 {
            let (x, y) = batch(step)?;
            let loss = (net.forward(&x)? - &y)?.sqr()?.mean_all()?;
            losses.push(loss.to_scalar::<f32>()?);
            if step == 20 {
                // Poison one element of one gradient, as an fp16 overflow in backward would.
                let before = snapshot(&net, &sgd);
                let scale = scaler.scale();
                let mut grads = scaler.scale_loss(&loss)?.backward()?;
                // Keyed by the working copy, or by the master where amp's CPU GEMM read that.
                let weight = net.out.weight();
                let grad = weight.grad("out.weight", &grads)?.expect("gradient").clone();
                let key = [weight.master(), weight.trainable()]
                    .into_iter()
                    .find(|v| grads.get(v.as_tensor()).is_some())
                    .expect("the variable holding the gradient");
                let mut values = grad.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                values[7] = poison;
                let poisoned =
                    Tensor::from_vec(values, grad.shape(), &Device::Cpu)?.to_dtype(grad.dtype())?;
                grads.insert(key.as_tensor(), poisoned);
                let unscaled = scaler.unscale(&net, &mut grads)?;
                assert_eq!(unscaled.first_non_finite.as_deref(), Some("out.weight"));
                let report =
                    scaler.update(Some(SkipReason::GradientOverflow { param: "out.weight".into() }))?;
                assert!(!report.applied() && !report.warmup);
                assert_eq!(report.scale_after, scale / 2.0, "the scale backs off");
                assert_eq!(
                    snapshot(&net, &sgd),
                    before,
                    "masters, working copies and state are bit-identical"
                );
                continue;
            }
            let report = scaler.step(&net, &loss, |grads| sgd.step(&net, grads))?;
            assert!(report.applied(), "{report}");
        }
        let (first, last) = (losses[0], losses[losses.len() - 1]);
        assert!(last < 0.2 * first, "training converges after the skip: {first} -> {last}");
    }
    Ok(())
}

/// The bits of every gradient of `net` in `grads`, by master.
fn gradient_bits(net: &Net, grads: &candle_core::backprop::GradStore) -> amp::Result<Vec<Vec<u32>>> {
    let mut all = Vec::new();
    for master in net.master_vars() {
        let grad = grads.get(master.as_tensor()).expect("every master has a gradient");
        let values = grad.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        all.push(values.iter().map(|x| x.to_bits()).collect());
    }
    Ok(all)
}

/// `unscale` twice on the same gradients would divide them by the scale twice: the second call is
/// refused, names the parameter and divides nothing; after `update`, a new backward pass's gradients
/// unscale as usual, and so do a second backward pass's before any update (their tensors are new).
#[test]
fn unscaling_the_same_gradients_twice_is_refused_and_divides_nothing() -> amp::Result<()> {
    let net = fp16_net()?;
    let mut scaler = GradScaler::for_model(&net, ScalerConfig { init_scale: 1024.0, ..Default::default() })?;
    let (x, y) = batch(0)?;
    let loss = (net.forward(&x)? - &y)?.sqr()?.mean_all()?;
    let mut grads = scaler.scale_loss(&loss)?.backward()?;
    assert_eq!(scaler.unscale(&net, &mut grads)?.first_non_finite, None);
    let once = gradient_bits(&net, &grads)?;
    let err = scaler.unscale(&net, &mut grads).expect_err("a second unscale of the same gradients");
    assert!(matches!(&err, amp::Error::AlreadyUnscaled { path } if path == "hidden.weight"), "{err}");
    assert!(err.to_string().contains("divide it by the scale twice"), "{err}");
    assert_eq!(gradient_bits(&net, &grads)?, once, "the refused call divided nothing");

    // Another backward pass before the update (accumulating by hand): new tensors, unscaled.
    let mut more = scaler.scale_loss(&loss)?.backward()?;
    scaler.unscale(&net, &mut more)?;
    assert_eq!(gradient_bits(&net, &more)?, once, "the same loss, the same unscaled gradients");
    scaler.update(None)?;

    // After the update, the next step's gradients unscale as usual.
    let mut next = scaler.scale_loss(&loss)?.backward()?;
    scaler.unscale(&net, &mut next)?;
    assert_eq!(gradient_bits(&net, &next)?, once);
    Ok(())
}

#[test]
fn a_nan_loss_every_step_stops_at_the_floor_with_a_diagnostic() -> amp::Result<()> {
    let net = fp16_net()?;
    let mut scaler = GradScaler::new(ScalerConfig::default())?;
    let nan = Tensor::new(f32::NAN, &Device::Cpu)?;
    let mut steps = 0;
    let err = loop {
        steps += 1;
        assert!(steps < 100, "the scaler loops forever");
        match scaler.step(&net, &nan, |_| panic!("a NaN loss must never reach the optimizer")) {
            Ok(report) => {
                assert_eq!(report.skipped, Some(SkipReason::NonFiniteLoss));
                assert!(report.scale_after >= 1.0, "the scale never goes below the floor");
            }
            Err(err) => break err.to_string(),
        }
    };
    // 65536 halves 16 times to 1.0; the 17th overflow is at the floor.
    assert_eq!(steps, 17);
    assert!(
        err.contains("minimum loss scale 1") && err.contains("the loss") && err.contains("AtScaleFloor"),
        "{err}"
    );

    let mut patient =
        GradScaler::new(ScalerConfig { at_floor: AtScaleFloor::Continue, ..Default::default() })?;
    for _ in 0..40 {
        let report = patient.step(&net, &nan, |_| panic!("never applied"))?;
        assert!(report.scale_after >= 1.0);
    }
    assert_eq!(patient.scale(), 1.0);
    assert_eq!(patient.state().skipped, 40);
    Ok(())
}

#[test]
fn bf16_models_get_a_disabled_scaler_that_multiplies_nothing() -> amp::Result<()> {
    let net = net_with(AmpConfig::new(OptLevel::O2, &Device::Cpu))?;
    let scaler = GradScaler::for_model(&net, ScalerConfig::default())?;
    assert!(!scaler.is_enabled());
    assert_eq!(scaler.scale(), 1.0);
    let loss = Tensor::new(3.0f32, &Device::Cpu)?;
    assert_eq!(scaler.scale_loss(&loss)?.to_scalar::<f32>()?, 3.0);
    Ok(())
}

/// A bf16 model's scaler multiplies nothing but still guards `step` (a user's optimizer): an inf
/// gradient under a finite loss skips the step, naming the parameter, and every weight and the
/// optimizer's state stay as they were.
#[test]
fn a_bf16_models_scaler_skips_an_inf_gradient_in_step() -> amp::Result<()> {
    let net = net_with(AmpConfig::new(OptLevel::O2, &Device::Cpu))?;
    let mut scaler = GradScaler::for_model(&net, ScalerConfig::default())?;
    let sgd = Sgd::new(&net)?;
    let (x, y) = batch(0)?;
    let before = snapshot(&net, &sgd);
    // sqrt(w - w) is 0, a finite loss; its gradient is inf.
    let w = net.hidden.weight().trainable().as_tensor().to_dtype(DType::F32)?;
    let penalty = (&w - w.detach())?.sqrt()?.sum_all()?;
    let loss = ((net.forward(&x)? - &y)?.sqr()?.mean_all()? + penalty)?;
    let report = scaler.step(&net, &loss, |grads| sgd.step(&net, grads))?;
    assert!(
        matches!(&report.skipped, Some(SkipReason::GradientOverflow { param }) if param == "hidden.weight"),
        "{report}"
    );
    assert_eq!(snapshot(&net, &sgd), before, "nothing changed");
    let mut opted_out = GradScaler::for_model(&net, ScalerConfig::default())?.with_finite_guard(false);
    let loss = ((net.forward(&x)? - &y)?.sqr()?.mean_all()? + (&w - w.detach())?.sqrt()?.sum_all()?)?;
    assert!(opted_out.step(&net, &loss, |_| Ok(()))?.applied(), "the guard can be turned off");
    Ok(())
}

#[test]
fn a_resumed_run_continues_exactly_like_an_uninterrupted_one() -> amp::Result<()> {
    let pattern = |step: u64| step % 7 == 3 || step.is_multiple_of(11);
    let config = ScalerConfig { growth_interval: 5, hysteresis: 2, ..Default::default() };
    let mut straight = GradScaler::new(config)?;
    let mut first_half = GradScaler::new(config)?;
    for step in 0..100 {
        straight.update(pattern(step).then_some(SkipReason::NonFiniteLoss))?;
        if step < 50 {
            first_half.update(pattern(step).then_some(SkipReason::NonFiniteLoss))?;
        }
    }
    let saved = serde_json::to_string(&(first_half.config(), first_half.state()))
        .map_err(candle_core::Error::wrap)?;
    let (config, state) = serde_json::from_str(&saved).map_err(candle_core::Error::wrap)?;
    let mut resumed = GradScaler::new(ScalerConfig::default())?;
    resumed.load_state(config, state)?;
    for step in 50..100 {
        resumed.update(pattern(step).then_some(SkipReason::NonFiniteLoss))?;
    }
    assert_eq!(resumed.state(), straight.state());
    Ok(())
}

/// The reference state machine: PyTorch's `_amp_update_scale_` with DeepSpeed's hysteresis, a floor and
/// a cap, written from their definitions.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Reference {
    scale: f32,
    tracker: u32,
    tolerance: u32,
}

impl Reference {
    fn step(&mut self, overflow: bool, c: &ScalerConfig) {
        if overflow {
            self.tracker = 0;
            if self.tolerance > 1 {
                self.tolerance -= 1;
            } else if self.scale > c.min_scale {
                self.scale = f32::max(self.scale * c.backoff_factor, c.min_scale);
            }
        } else {
            self.tracker += 1;
            if self.tracker == c.growth_interval {
                self.tracker = 0;
                let grown = self.scale * c.growth_factor;
                if grown.is_finite() && self.scale < c.max_scale {
                    self.scale = grown.min(c.max_scale);
                    self.tolerance = c.hysteresis;
                }
            }
        }
    }
}

proptest! {
    #[test]
    fn the_scale_follows_the_reference_state_machine(
        steps in proptest::collection::vec(any::<bool>(), 1..400),
        interval in 1u32..6,
        hysteresis in 1u32..4,
        near_max in any::<bool>(),
    ) {
        let config = ScalerConfig {
            init_scale: if near_max { f32::MAX / 4.0 } else { 1024.0 },
            max_scale: f32::MAX,
            growth_interval: interval,
            hysteresis,
            at_floor: AtScaleFloor::Continue,
            ..Default::default()
        };
        let mut scaler = GradScaler::new(config).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut reference = Reference { scale: config.init_scale, tracker: 0, tolerance: hysteresis };
        for (i, overflow) in steps.iter().enumerate() {
            let report = scaler
                .update(overflow.then_some(SkipReason::NonFiniteLoss))
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            reference.step(*overflow, &config);
            prop_assert_eq!(scaler.scale(), reference.scale, "step {}", i);
            prop_assert_eq!(scaler.state().growth_tracker, reference.tracker);
            prop_assert_eq!(scaler.state().hysteresis_left, reference.tolerance);
            prop_assert!(scaler.scale().is_finite() && scaler.scale() >= 1.0);
            if report.change == ScaleChange::Grew {
                prop_assert!(report.scale_after > report.scale_before);
            }
        }
        prop_assert_eq!(scaler.state().skipped, steps.iter().filter(|o| **o).count() as u64);
    }
}

#[test]
fn scaler_state_travels_with_the_checkpoint_and_resume_is_exact() -> amp::Result<()> {
    let net = fp16_net()?;
    let sgd = Sgd::new(&net)?;
    let config = ScalerConfig { init_scale: 1024.0, growth_interval: 3, ..Default::default() };
    let mut scaler = GradScaler::new(config)?.named("main");
    let mut aux = GradScaler::new(ScalerConfig { init_scale: 8.0, ..config })?.named("aux");
    for step in 0..5 {
        let (x, y) = batch(step)?;
        let loss = (net.forward(&x)? - &y)?.sqr()?.mean_all()?;
        scaler.step(&net, &loss, |grads| sgd.step(&net, grads))?;
    }
    aux.update(Some(SkipReason::NonFiniteLoss))?;
    let path = std::env::temp_dir().join(format!("amp-scaler-{}.safetensors", std::process::id()));
    amp::checkpoint::save_with(&net, &[&scaler, &aux], &path)?;

    let mut restored_net = fp16_net()?;
    let mut restored = GradScaler::new(ScalerConfig::default())?.named("main");
    let mut restored_aux = GradScaler::new(ScalerConfig::default())?.named("aux");
    amp::checkpoint::load_with(&mut restored_net, &mut [&mut restored, &mut restored_aux], &path)?;
    assert_eq!(restored.state(), scaler.state());
    assert_eq!(restored.config(), scaler.config());
    assert_eq!(restored_aux.state(), aux.state(), "each loss's scaler keeps its own state");

    // Both continue identically.
    for step in 5..12 {
        let overflow = step % 4 == 0;
        let a = scaler.update(overflow.then_some(SkipReason::NonFiniteLoss))?;
        let b = restored.update(overflow.then_some(SkipReason::NonFiniteLoss))?;
        assert_eq!(a, b);
    }

    // A checkpoint without the requested state is refused and changes nothing.
    let mut missing = GradScaler::new(ScalerConfig::default())?.named("other");
    let before = *missing.state();
    let err = amp::checkpoint::load_with(&mut restored_net, &mut [&mut missing], &path).unwrap_err();
    assert!(err.to_string().contains("no `other` state"), "{err}");
    assert_eq!(*missing.state(), before);
    std::fs::remove_file(path).ok();
    Ok(())
}

#[test]
fn one_scaler_drives_several_optimizers() -> amp::Result<()> {
    let net = fp16_net()?;
    // One optimizer for the hidden layer, one for the output layer.
    let (hidden, out) = (Sgd::new(&net)?, Sgd::new(&net)?);
    let mut scaler = GradScaler::new(ScalerConfig { init_scale: 256.0, ..Default::default() })?;
    let (x, y) = batch(0)?;
    let before = net.out.weight().master().as_tensor().flatten_all()?.to_vec1::<f32>()?;
    let loss = (net.forward(&x)? - &y)?.sqr()?.mean_all()?;
    let report = scaler.step(&net, &loss, |grads| {
        hidden.step(&net, grads)?;
        out.step(&net, grads)
    })?;
    assert!(report.applied());
    let after = net.out.weight().master().as_tensor().flatten_all()?.to_vec1::<f32>()?;
    assert_ne!(before, after);
    Ok(())
}

#[test]
fn step_fused_skips_an_fp16_overflow_and_changes_nothing() -> amp::Result<()> {
    use amp::optim::{AdamConfig, FusedAdam, ParamGroups};
    for max_grad_norm in [None, Some(1.0)] {
        let net = fp16_net()?;
        let mut adam = FusedAdam::new(ParamGroups::from_model(&net)?, AdamConfig::default())?;
        let mut scaler = GradScaler::for_model(&net, ScalerConfig::default())?;
        // `sgd` only serves `snapshot`'s signature: its state stays zero.
        let sgd = Sgd::new(&net)?;
        // Unit inputs, far targets: |out| <= 4 (tanh activations, |w_out| <= 1/4), so the loss gradient per
        // sample is (out - 100) / 4, between 24 and 26 in size. Scaled by 2^16 it overflows fp16 whatever the
        // weights; the half gradients (the activations') stay under 26, and the weights' and biases' sums
        // are f32, so from 2^11 on (26 * 2048 < 65504) steps fit.
        let x = Tensor::ones((8, 4), DType::F32, &Device::Cpu)?;
        let y = (Tensor::ones((8, 1), DType::F32, &Device::Cpu)? * 100.0)?;
        let before = snapshot(&net, &sgd);
        let loss = (net.forward(&x)? - &y)?.sqr()?.mean_all()?;
        let report = scaler.step_fused(&loss, &mut adam, max_grad_norm)?;
        assert!(!report.applied(), "{report}");
        assert!(matches!(report.skipped, Some(SkipReason::GradientOverflow { .. })), "{report}");
        assert!(report.warmup, "a skip before any applied step is labelled warm-up");
        assert_eq!(report.scale_after, 32768.0);
        assert_eq!(snapshot(&net, &sgd), before, "masters and working copies bit-identical");
        assert_eq!(adam.steps()?, 0, "the optimizer was not called");
        // The scale keeps backing off until the step fits, then training proceeds.
        let mut applied = false;
        for _ in 0..20 {
            let loss = (net.forward(&x)? - &y)?.sqr()?.mean_all()?;
            applied |= scaler.step_fused(&loss, &mut adam, max_grad_norm)?.applied();
        }
        assert!(applied && adam.steps()? > 0, "scale {}", scaler.scale());
    }
    Ok(())
}

#[test]
fn deferred_steps_on_the_cpu_are_step_fused_with_the_reports_summed_at_settle() -> amp::Result<()> {
    use amp::optim::{AdamConfig, FusedAdam, ParamGroups};
    for max_grad_norm in [None, Some(1.0)] {
        let (now, deferred) = (fp16_net()?, fp16_net()?);
        let adam = |net: &Net| FusedAdam::new(ParamGroups::from_model(net)?, AdamConfig::default());
        let (mut now_adam, mut deferred_adam) = (adam(&now)?, adam(&deferred)?);
        let config = ScalerConfig { growth_interval: 4, ..Default::default() };
        let (mut now_scaler, mut deferred_scaler) = (GradScaler::new(config)?, GradScaler::new(config)?);
        // As in `step_fused_skips_an_fp16_overflow_and_changes_nothing`: the first 5 steps overflow (scale
        // 2^16 down to 2^11), then steps fit, and the scale grows back every 4 of them until it overflows.
        let x = Tensor::ones((8, 4), DType::F32, &Device::Cpu)?;
        let y = (Tensor::ones((8, 1), DType::F32, &Device::Cpu)? * 100.0)?;
        let mut window = Vec::new();
        for step in 1..=30 {
            // Step 13's loss is NaN: a skip for a different reason, in the middle of a window.
            let poison = if step == 13 { f64::NAN } else { 1.0 };
            let loss = |net: &Net| -> amp::Result<Tensor> {
                Ok(((net.forward(&x)? - &y)?.sqr()?.mean_all()? * poison)?)
            };
            window.push(now_scaler.step_fused(&loss(&now)?, &mut now_adam, max_grad_norm)?);
            deferred_scaler.step_fused_deferred(&loss(&deferred)?, &mut deferred_adam, max_grad_norm)?;
            assert_eq!(deferred_scaler.unsettled_steps(), 0, "nothing is queued on the CPU");
            if step % 5 != 0 {
                continue;
            }
            let settled = deferred_scaler.settle()?;
            let skipped: Vec<_> = window.iter().filter(|r| !r.applied()).collect();
            assert_eq!(settled.steps, 5);
            assert_eq!(settled.skipped, skipped.len() as u64, "{settled}");
            assert_eq!(settled.applied, 5 - skipped.len() as u64);
            assert_eq!(settled.last_skip, skipped.last().and_then(|r| r.skipped.clone()), "{settled}");
            assert_eq!(settled.scale_before, window[0].scale_before);
            assert_eq!(settled.scale_after, now_scaler.scale());
            assert_eq!(deferred_scaler.state(), now_scaler.state());
            window.clear();
        }
        let bits = |net: &Net| snapshot(net, &Sgd::new(net).expect("zeros"));
        assert_eq!(bits(&deferred), bits(&now), "the same weights, bit for bit");
        assert_eq!(deferred_adam.steps()?, now_adam.steps()?);
        let state = now_scaler.state();
        assert!(state.skipped >= 8 && state.applied >= 15, "both kinds of step happened: {state:?}");
        let idle = deferred_scaler.settle()?;
        assert_eq!((idle.steps, idle.scale_before, idle.scale_after), (0, state.scale, state.scale));
    }
    Ok(())
}

/// The fused step's overflow check reads only the gradients amp's products did not already check when
/// they deposited them (`gradient_sink`): a product's gradient that overflows is still found, the step
/// skipped and every master and working copy left bit for bit, the optimizer's step count too; the
/// next finite step applies.
#[test]
fn fused_step_finds_an_overflow_in_a_product_gradient_and_changes_nothing() -> amp::Result<()> {
    use amp::dispatch::{self, GemmPath, Override};
    use amp::optim::{AdamConfig, FusedAdamW, ParamGroups};

    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let vb = amp::varmap::SeededInit::new(5).var_builder(&varmap, DType::F32, &dev);
    // fp32 parameters: every gradient (weights' and biases') is then deposited by a product op and
    // checked there, so only that check can see the overflow (under O2 a bias's gradient reaches its
    // master through candle's store, and is checked in the step).
    let mut net = Net { hidden: linear(4, 16, vb.pp("hidden"))?, out: linear(16, 1, vb.pp("out"))? };
    amp::initialize(&mut net, AmpConfig { opt_level: OptLevel::O0, half: Precision::Fp16 })?;
    let mut adam = FusedAdamW::new(ParamGroups::from_model(&net)?, AdamConfig::default())?;
    let mut scaler = GradScaler::for_model(&net, ScalerConfig::default())?;
    let (x, y) = batch(0)?;
    let loss =
        |factor: f64| -> candle_core::Result<Tensor> { amp::ops::loss::mse(&net.forward(&x)?, &y)? * factor };
    let state = |net: &Net, adam: &FusedAdamW| -> amp::Result<Vec<u8>> {
        let bits = |t: &Tensor| -> candle_core::Result<Vec<u32>> {
            Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect())
        };
        let mut all = Vec::new();
        for (_, p) in net.named_params() {
            all.extend(bits(p.master().as_tensor())?);
            all.extend(p.working().map(|w| bits(w.as_tensor())).transpose()?.unwrap_or_default());
        }
        let mut bytes: Vec<u8> = all.iter().flat_map(|b| b.to_le_bytes()).collect();
        bytes.extend(adam.steps()?.to_le_bytes());
        Ok(bytes)
    };
    // amp's GEMM for every product (the dispatcher would leave products this small to candle).
    let over = Override::Path(GemmPath::Portable);
    dispatch::with_override(over, || -> amp::Result<()> {
        assert!(scaler.step_fused(&loss(1.0)?, &mut adam, None)?.applied());
        let before = state(&net, &adam)?;
        // The loss taken to half of f32's largest value: finite, but gradients that sum it over the
        // batch overflow (fp32: no loss scale).
        let factor = f64::from(f32::MAX) / 2.0 / f64::from(loss(1.0)?.to_scalar::<f32>()?);
        let report = scaler.step_fused(&loss(factor)?, &mut adam, None)?;
        assert!(matches!(report.skipped, Some(SkipReason::GradientOverflow { .. })), "{report}");
        assert!(state(&net, &adam)? == before, "a skipped step changed the model or the optimizer");
        assert!(scaler.step_fused(&loss(1.0)?, &mut adam, None)?.applied());
        assert!(state(&net, &adam)? != before);
        Ok(())
    })??;
    Ok(())
}

/// Rolling a scaler back to an earlier state in the same process (`load_state`, or a checkpoint's
/// `restore_state`) restarts its skip log's window there: the next step is counted from the restored
/// step (it had subtracted the later window's start from it, and overflowed).
#[test]
fn a_scaler_rolled_back_to_an_earlier_state_steps_on() -> amp::Result<()> {
    use amp::checkpoint::TrainingState;
    for restore in ["load_state", "restore_state"] {
        let mut scaler = GradScaler::new(ScalerConfig::default())?.with_summary_every(10);
        for _ in 0..5 {
            scaler.update(None)?;
        }
        let (config, state, saved) = (*scaler.config(), *scaler.state(), scaler.save_state()?);
        for _ in 0..20 {
            scaler.update(None)?;
        }
        match restore {
            "load_state" => scaler.load_state(config, state)?,
            _ => scaler.restore_state(saved)?,
        }
        for step in 6..=30 {
            let skip = (step % 7 == 0).then_some(SkipReason::NonFiniteLoss);
            assert_eq!(scaler.update(skip)?.step, step, "{restore}");
        }
    }
    Ok(())
}

/// Under O3 fp16 there is no fp32 master to unscale into: a scaler at another scale than 1 refuses the
/// step (unscaled in fp16, a gradient of 1e-8 flushes to zero) and changes nothing, saying to use a
/// fixed scale of 1 (Apex O3's), which trains it.
#[test]
fn an_fp16_gradient_without_a_master_is_not_unscaled_in_fp16() -> amp::Result<()> {
    let net = net_with(AmpConfig::new(OptLevel::O3, &Device::Cpu).with_half(Precision::Fp16))?;
    let (x, y) = batch(0)?;
    let loss =
        || -> amp::Result<Tensor> { Ok((net.forward(&x)?.to_dtype(DType::F32)? - &y)?.sqr()?.mean_all()?) };
    let weights = || -> amp::Result<Vec<Vec<f32>>> {
        let params = net.named_params();
        params
            .iter()
            .map(|(_, p)| Ok(p.master().as_tensor().to_dtype(DType::F32)?.flatten_all()?.to_vec1()?))
            .collect()
    };
    let before = weights()?;
    let mut scaler = GradScaler::new(ScalerConfig::default())?;
    let err = scaler.step(&net, &loss()?, |_| Ok(())).expect_err("refused").to_string();
    assert!(err.contains("fp16 gradient and no fp32 master") && err.contains("fixed(1.0)"), "{err}");
    assert_eq!(weights()?, before, "nothing changed");
    let mut fixed = GradScaler::new(ScalerConfig::fixed(1.0))?;
    assert!(fixed.step(&net, &loss()?, |_| Ok(()))?.applied());
    Ok(())
}

/// `step_unscaled` compiles for a model without fp16 attributes; when its opt level's half type makes
/// its layers compute in fp16 at run time, the step is refused, naming the first such layer, and
/// changes nothing. With bf16 it trains.
#[test]
fn step_unscaled_refuses_a_model_the_opt_level_puts_in_fp16() -> amp::Result<()> {
    for half in [Precision::Fp16, Precision::Bf16] {
        let net = net_with(AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(half))?;
        let (x, y) = batch(0)?;
        let loss = (net.forward(&x)? - &y)?.sqr()?.mean_all()?;
        let mut called = false;
        let result = amp::scaler::step_unscaled(&net, &loss, |_| {
            called = true;
            Ok(())
        });
        match half {
            Precision::Fp16 => {
                let err = result.expect_err("fp16 without a scaler").to_string();
                assert!(err.contains("`hidden` computes in fp16") && err.contains("for_model"), "{err}");
                assert!(!called);
            }
            _ => assert!(result?.applied() && called),
        }
    }
    Ok(())
}

/// A clipping threshold that is not a positive finite number (NaN would make every update NaN, a
/// negative one would reverse it) is refused before backward runs: weights, optimizer and scaler as
/// they were.
#[test]
fn a_bad_clipping_threshold_is_refused_and_changes_nothing() -> amp::Result<()> {
    use amp::optim::{AdamConfig, FusedAdam, ParamGroups};
    let net = fp16_net()?;
    let mut adam = FusedAdam::new(ParamGroups::from_model(&net)?, AdamConfig::default())?;
    let mut scaler = GradScaler::for_model(&net, ScalerConfig::default())?;
    let sgd = Sgd::new(&net)?;
    let (x, y) = batch(0)?;
    let (before, state) = (snapshot(&net, &sgd), *scaler.state());
    for bad in [f32::NAN, f32::INFINITY, -1.0, 0.0] {
        let loss = (net.forward(&x)? - &y)?.sqr()?.mean_all()?;
        let refused = scaler.step_fused(&loss, &mut adam, Some(bad));
        match &refused {
            Err(amp::Error::InvalidOptimizerConfig { reason }) => {
                assert!(reason.contains("max_grad_norm") && reason.contains("positive"), "{reason}")
            }
            other => panic!("max_grad_norm {bad}: expected a refusal, got {other:?}"),
        }
        assert_eq!(snapshot(&net, &sgd), before, "max_grad_norm {bad}");
        assert_eq!((scaler.state(), adam.steps()?), (&state, 0), "max_grad_norm {bad}");
    }
    let loss = (net.forward(&x)? - &y)?.sqr()?.mean_all()?;
    scaler.step_fused(&loss, &mut adam, Some(1.0))?;
    assert_eq!(scaler.state().steps, 1, "a valid threshold steps");
    Ok(())
}

/// A learning rate set to NaN, infinity or below 0 (`set_learning_rate` takes any value, as candle's
/// optimizers' does) is refused by the next step of each fused optimizer: weights
/// (refused before the optimizer touches anything) and scaler as they were, where a NaN rate made
/// every weight NaN on a step reported as applied.
#[test]
fn a_bad_learning_rate_is_refused_by_the_step_and_changes_nothing() -> amp::Result<()> {
    use amp::optim::{
        AdamConfig, FusedAdam, FusedLamb, FusedOptimizer, FusedSgd, LambConfig, ParamGroups, SgdConfig,
    };
    let net = fp16_net()?;
    let groups = || ParamGroups::from_model(&net);
    let mut optimizers: Vec<Box<dyn FusedOptimizer>> = vec![
        Box::new(FusedAdam::new(groups()?, AdamConfig::default())?),
        Box::new(FusedSgd::new(groups()?, SgdConfig { momentum: 0.9, ..SgdConfig::default() })?),
        Box::new(FusedLamb::new(groups()?, LambConfig::default())?),
    ];
    let mut scaler = GradScaler::for_model(&net, ScalerConfig::default())?;
    let sgd = Sgd::new(&net)?;
    let (x, y) = batch(0)?;
    for optimizer in &mut optimizers {
        let lr = optimizer.learning_rate();
        for bad in [f64::NAN, f64::INFINITY, -1e-3] {
            let (before, state) = (snapshot(&net, &sgd), *scaler.state());
            optimizer.set_learning_rate(bad);
            let loss = (net.forward(&x)? - &y)?.sqr()?.mean_all()?;
            match scaler.step_fused(&loss, optimizer.as_mut(), None) {
                Err(amp::Error::InvalidOptimizerConfig { reason }) => {
                    assert!(reason.contains("`lr`"), "{reason}")
                }
                other => panic!("lr {bad}: expected a refusal, got {other:?}"),
            }
            assert_eq!(snapshot(&net, &sgd), before, "lr {bad}");
            assert_eq!(scaler.state(), &state, "lr {bad}");
            // The deferred step refuses it before anything is queued.
            let loss = (net.forward(&x)? - &y)?.sqr()?.mean_all()?;
            let refused = scaler.step_fused_deferred(&loss, optimizer.as_mut(), None);
            assert!(
                matches!(refused, Err(amp::Error::InvalidOptimizerConfig { .. })),
                "lr {bad}: {refused:?}"
            );
            assert_eq!(snapshot(&net, &sgd), before, "lr {bad}, deferred");
            assert_eq!(scaler.state(), &state, "lr {bad}, deferred");
        }
        optimizer.set_learning_rate(lr);
        let loss = (net.forward(&x)? - &y)?.sqr()?.mean_all()?;
        let report = scaler.step_fused(&loss, optimizer.as_mut(), None)?;
        assert!(report.applied(), "a valid rate steps: {report}");
    }
    Ok(())
}

/// `load_state` holds a state to the invariants a checkpoint's is held to: a scale outside the config's
/// bounds or hysteresis left above the config's is refused, and the scaler keeps its own.
#[test]
fn load_state_refuses_a_state_the_config_cannot_reach() -> amp::Result<()> {
    let config = ScalerConfig { hysteresis: 2, ..ScalerConfig::default() };
    let mut scaler = GradScaler::new(config)?;
    let good = *scaler.state();
    let mut above = good;
    above.scale = config.max_scale * 2.0;
    let mut hysteresis = good;
    hysteresis.hysteresis_left = 3;
    for (what, bad) in [("scale", above), ("hysteresis_left", hysteresis)] {
        match scaler.load_state(config, bad) {
            Err(amp::Error::InvalidScalerConfig { reason }) => assert!(reason.contains(what), "{reason}"),
            other => panic!("{what}: expected a refusal, got {other:?}"),
        }
        assert_eq!(scaler.state(), &good, "{what}");
    }
    scaler.load_state(config, good)?;
    Ok(())
}
