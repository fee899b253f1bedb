//! Gradient accumulation (`GradScaler::accumulate` + `step_fused_accumulated` / `step_accumulated`):
//! - the sums are f32: against an f64 sum of the very gradients each micro-batch produced (half, from
//!   half working copies), the error is within f32's summation bound, where summing in the gradients'
//!   own dtype is off by orders of magnitude;
//! - an fp32 model's accumulated step is the one-batch step up to f32 rounding;
//! - one non-finite micro-batch skips the whole window and changes no bit of the training state;
//! - the loss scale cannot move inside a window, and an empty window is refused.

mod common;
mod reliability;

use amp::distributed::{Communicator, DataParallel, DataParallelConfig, SingleProcess};
use amp::nn::{linear, Linear};
use amp::optim::{AdamConfig, FusedAdamW, ParamGroups};
use amp::scaler::{GradAccumulator, ScalerConfig, SkipReason};
use amp::{AmpConfig, AmpModule, AmpModuleExt, Error, GradScaler, GradientRoute, OptLevel, Precision};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use reliability::Outcome;

/// One linear layer, `inputs -> outputs`, seeded weights uniform in [-1/4, 1/4).
#[derive(AmpModule)]
struct Head {
    fc: Linear,
}

impl Module for Head {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fc.forward(x)
    }
}

fn head(inputs: usize, outputs: usize, config: AmpConfig) -> amp::Result<Head> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut model = Head { fc: linear(inputs, outputs, vb.pp("fc"))? };
    for (i, (_, p)) in model.named_params().iter().enumerate() {
        let dims = p.master().dims().to_vec();
        p.master().set(&common::uniform_in(7 + i as u64, &dims, -0.25, 0.25, DType::F32)?)?;
    }
    amp::initialize(&mut model, config)?;
    Ok(model)
}

fn o2(half: Precision) -> AmpConfig {
    AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(half)
}

/// Micro-batch `j`: `rows` inputs in [-1, 1) and targets, all positive-mean so that the weight
/// gradients of every micro-batch share a sign and their sum grows (where a half sum stalls).
fn micro_batch(j: u64, rows: usize, inputs: usize, outputs: usize) -> candle_core::Result<(Tensor, Tensor)> {
    let x = common::uniform_in(1000 + j, &[rows, inputs], 0.0, 1.0, DType::F32)?;
    let y = common::uniform_in(5000 + j, &[rows, outputs], 2.0, 3.0, DType::F32)?;
    Ok((x, y))
}

fn mse<M: Module>(model: &M, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    (model.forward(x)?.to_dtype(DType::F32)? - y)?.sqr()?.mean_all()
}

/// bf16 and fp16 working copies whose gradients are half (`GradientRoute::Working`, as on a GPU or
/// under ZeRO): 256 micro-batches, each gradient read on its own in its half dtype. The accumulated
/// sum must be their f64 sum within the f32 bound `255 u_f32 sum |g_j|` per element; a sum in the
/// half dtype (computed here too) is far outside it.
#[test]
fn the_sums_are_f32_sums_of_the_micro_batches_half_gradients() -> Outcome {
    const MICRO: usize = 256;
    for (half, scale) in [(Precision::Bf16, 1.0), (Precision::Fp16, 1024.0)] {
        let mut model = head(8, 4, o2(half))?;
        amp::set_gradient_route(&mut model, GradientRoute::Working);
        let mut scaler = GradScaler::new(ScalerConfig::fixed(scale))?;
        let mut accumulator = GradAccumulator::new();
        let params = model.named_params();
        let mut exact: Vec<Vec<f64>> =
            params.iter().map(|(_, p)| vec![0.0; p.master().elem_count()]).collect();
        let mut magnitude = exact.clone();
        let mut in_half: Vec<Option<Tensor>> = vec![None; params.len()];
        for j in 0..MICRO as u64 {
            let (x, y) = micro_batch(j, 4, 8, 4)?;
            let loss = (mse(&model, &x, &y)? / MICRO as f64)?;
            // The micro-batch's own gradients, as backward gives them (half, scaled).
            let grads = (&loss * f64::from(scale))?.backward()?;
            for (i, (path, p)) in params.iter().enumerate() {
                let trainable = p.working().map_or(p.master().as_tensor(), |w| w.as_tensor());
                let g = grads.get(trainable).ok_or(format!("{path}: no gradient"))?;
                assert_eq!(g.dtype(), half.dtype(), "{path}: the route gives half gradients");
                let values = g.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
                for ((e, m), v) in exact[i].iter_mut().zip(&mut magnitude[i]).zip(values) {
                    *e += v;
                    *m += v.abs();
                }
                in_half[i] = Some(match in_half[i].take() {
                    None => g.clone(),
                    Some(sum) => (sum + g)?,
                });
            }
            scaler.accumulate(&model, &loss, &mut accumulator)?;
        }
        assert_eq!(accumulator.micro_batches(), MICRO);
        let bound = (MICRO - 1) as f64 * common::unit_roundoff(DType::F32);
        for (i, (path, p)) in params.iter().enumerate() {
            let sum = accumulator.gradient(p.master().as_tensor()).ok_or(format!("{path}: no sum"))?;
            assert_eq!(sum.dtype(), DType::F32, "{path}");
            let got = sum.flatten_all()?.to_vec1::<f32>()?;
            let naive = in_half[i].as_ref().ok_or("no half sum")?;
            let naive = naive.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
            let mut naive_worst = 0f64;
            for (k, &g) in got.iter().enumerate() {
                let err = (f64::from(g) - exact[i][k]).abs();
                assert!(
                    err <= bound * magnitude[i][k],
                    "{half} {path}[{k}]: {g} against {} (error {err:.3e} > {:.3e})",
                    exact[i][k],
                    bound * magnitude[i][k]
                );
                naive_worst = naive_worst.max((naive[k] - exact[i][k]).abs() / (bound * magnitude[i][k]));
            }
            // The same sums in the gradients' dtype miss the bound by far: the test can fail.
            assert!(naive_worst > 100.0, "{half} {path}: a half sum is within {naive_worst:.1}x the bound");
            eprintln!(
                "{half} {path}: f32 sums within the bound; a {half} sum misses it by {naive_worst:.0}x"
            );
        }
    }
    Ok(())
}

/// Two micro-batches of 8 rows, each loss halved, step like one batch of 16 rows: in fp32 (O0), and
/// in O1 and O2 with bf16 and fp16, whose products round each row alike in both runs and give f32
/// weight and bias gradients (`GradientRoute::Master`), so that only the order of f32 sums differs:
/// the sums within 1e-6 of the whole batch's gradients, masters within 1e-6 (O2: 1e-5) after 6 AdamW
/// steps (fp16's first skipped alike at the initial scale), each having moved by more than 1e-3 of
/// its size.
#[test]
fn an_accumulated_step_is_the_one_batch_step() -> Outcome {
    let dev = Device::Cpu;
    // O2: two masters an f32 rounding apart can round to neighbouring half values in their working
    // copies, which the next forward reads; 1e-5 leaves room for that (observed: at most 3e-8).
    let o1 = |half| AmpConfig::new(OptLevel::O1, &dev).with_half(half);
    for (name, config, tolerance) in [
        ("fp32 O0", AmpConfig::new(OptLevel::O0, &dev), 1e-6),
        ("bf16 O1", o1(Precision::Bf16), 1e-6),
        ("fp16 O1", o1(Precision::Fp16), 1e-6),
        ("bf16 O2", o2(Precision::Bf16), 1e-5),
        ("fp16 O2", o2(Precision::Fp16), 1e-5),
    ] {
        let (whole, split, start) = (head(6, 3, config)?, head(6, 3, config)?, head(6, 3, config)?);
        let adam = |m: &Head| FusedAdamW::new(ParamGroups::from_model(m)?, AdamConfig::default());
        let (mut whole_adam, mut split_adam) = (adam(&whole)?, adam(&split)?);
        let scaler = |m: &Head| GradScaler::for_model(m, ScalerConfig::default());
        let (mut whole_scaler, mut split_scaler) = (scaler(&whole)?, scaler(&split)?);
        let mut accumulator = GradAccumulator::new();
        for step in 0..6u64 {
            let (x, y) = micro_batch(step, 16, 6, 3)?;
            let one = whole_scaler.step_fused(&mse(&whole, &x, &y)?, &mut whole_adam, Some(1.0))?;
            for half in 0..2 {
                let (x, y) = (x.narrow(0, 8 * half, 8)?, y.narrow(0, 8 * half, 8)?);
                split_scaler.accumulate(&split, &(mse(&split, &x, &y)? / 2.0)?, &mut accumulator)?;
            }
            // The window's sums, unscaled, are the whole batch's gradient at the same weights (AdamW
            // and clipping below would not see a constant factor in them).
            // The whole batch's gradients as amp's steps compute them, read by a step that changes
            // nothing (its `apply` only copies them out).
            let mut one_batch = Vec::new();
            GradScaler::disabled().step(&split, &mse(&split, &x, &y)?, |grads| {
                for (_, p) in split.named_params() {
                    one_batch.push(grads.get(p.master().as_tensor()).cloned());
                }
                Ok(())
            })?;
            for ((path, p), want) in split.named_params().iter().zip(&one_batch) {
                let master = p.master().as_tensor();
                let sum = (accumulator.gradient(master).ok_or("no sum")? / f64::from(split_scaler.scale()))?;
                if !common::all_finite(&sum)? {
                    continue; // fp16 at the initial scale overflows: both runs skip (asserted below)
                }
                let want = want.as_ref().ok_or("no gradient")?;
                common::assert_close(&format!("{name} step {step} {path} gradient"), &sum, want, 1e-6)?;
            }
            let report = split_scaler.step_fused_accumulated(&mut accumulator, &mut split_adam, Some(1.0))?;
            // fp16's first steps skip at the initial scale (65536) alike.
            assert_eq!(report.skipped, one.skipped, "{name}, step {step}: {report} / {one}");
            assert!(accumulator.is_empty());
        }
        assert_eq!(split_adam.steps()?, whole_adam.steps()?);
        assert!(split_adam.steps()? >= 4, "{name}: {} steps applied", split_adam.steps()?);
        let (whole, split, start) = (whole.named_params(), split.named_params(), start.named_params());
        for (((path, a), (_, b)), (_, s)) in whole.iter().zip(&split).zip(&start) {
            let (a, b, s) = (a.master().as_tensor(), b.master().as_tensor(), s.master().as_tensor());
            common::assert_close(&format!("{name} {path}"), b, a, tolerance)?;
            assert!(common::relative_error(a, s)? > 1e-3, "{name} {path}: the weights did not move");
        }
    }
    Ok(())
}

/// fp16 O2 with dynamic scaling: a window whose second micro-batch overflows fp16 skips as a whole,
/// every bit of masters, working copies, optimizer and scaler state as before but the scale, which
/// backs off once; a window with a NaN loss skips as a non-finite loss; the next window applies.
#[test]
fn a_non_finite_micro_batch_skips_the_window_and_changes_nothing() -> Outcome {
    let net = reliability::fp16_net(6, 24, 3, 5)?;
    let mut adam = FusedAdamW::new(ParamGroups::from_model(&net)?, AdamConfig::default())?;
    let mut scaler = GradScaler::new(ScalerConfig { init_scale: 1024.0, ..Default::default() })?;
    let mut accumulator = GradAccumulator::new();
    let mut window = |factors: [f64; 3], scaler: &mut GradScaler, adam: &mut FusedAdamW| -> Outcome<_> {
        for (j, factor) in factors.into_iter().enumerate() {
            let (x, y) = reliability::batch(j as u64, 8, 6, 3)?;
            let loss = ((reliability::mse(&net, &x, &y)? / 3.0)? * factor)?;
            scaler.accumulate(&net, &loss, &mut accumulator)?;
        }
        Ok(scaler.step_fused_accumulated(&mut accumulator, adam, None)?)
    };
    let report = window([1.0; 3], &mut scaler, &mut adam)?;
    assert!(report.applied(), "{report}");
    let before = reliability::snapshot(&net, &[&adam])?;
    let report = window([1.0, 1e30, 1.0], &mut scaler, &mut adam)?;
    assert!(matches!(&report.skipped, Some(SkipReason::GradientOverflow { .. })), "{report}");
    assert_eq!((report.scale_before, report.scale_after), (1024.0, 512.0));
    let report = window([1.0, 1.0, f64::NAN], &mut scaler, &mut adam)?;
    assert_eq!(report.skipped, Some(SkipReason::NonFiniteLoss), "{report}");
    assert!(reliability::snapshot(&net, &[&adam])? == before, "a skipped window changed the state");
    assert_eq!(adam.steps()?, 1);
    let report = window([1.0; 3], &mut scaler, &mut adam)?;
    assert!(report.applied() && adam.steps()? == 2, "{report}");
    assert!(reliability::snapshot(&net, &[&adam])? != before);
    Ok(())
}

/// A window is refused, keeping its sums, when it is empty, when its scaler stepped inside it (even
/// an applied step that leaves the scale as it was), and when the optimizer updates a parameter that
/// the model given to `accumulate` does not hold.
#[test]
fn interrupted_empty_and_partial_windows_are_refused_and_keep_their_sums() -> Outcome {
    let net = reliability::fp16_net(6, 24, 3, 5)?;
    let mut adam = FusedAdamW::new(ParamGroups::from_model(&net)?, AdamConfig::default())?;
    let mut scaler = GradScaler::new(ScalerConfig { init_scale: 1024.0, ..Default::default() })?;
    let mut accumulator = GradAccumulator::new();
    let err = scaler.step_fused_accumulated(&mut accumulator, &mut adam, None).err();
    assert!(matches!(err, Some(Error::NothingAccumulated)), "{err:?}");
    let (x, y) = reliability::batch(0, 8, 6, 3)?;
    scaler.accumulate(&net, &reliability::mse(&net, &x, &y)?, &mut accumulator)?;
    let bytes = accumulator.bytes();
    assert_eq!(bytes, 4 * (6 * 24 + 24 + 24 * 3 + 3), "one f32 sum per parameter element");
    let before = reliability::snapshot(&net, &[&adam])?;
    let kept = |a: &GradAccumulator| (a.micro_batches(), a.bytes()) == (1, bytes);
    // An applied step of the scaler inside the window: the scale stays 1024, the weights would not.
    scaler.update(None)?;
    assert_eq!(scaler.scale(), 1024.0);
    let err = scaler.accumulate(&net, &reliability::mse(&net, &x, &y)?, &mut accumulator).err();
    let interrupted = |err: &Option<Error>, steps, to| matches!(err, Some(Error::AccumulationInterrupted { steps: s, from: 1024.0, to: t }) if *s == steps && *t == to);
    assert!(interrupted(&err, 1, 1024.0), "{err:?}");
    assert!(kept(&accumulator), "nothing was added");
    // A skipped one moves the scale too.
    scaler.update(Some(SkipReason::NonFiniteLoss))?;
    let err = scaler.step_fused_accumulated(&mut accumulator, &mut adam, None).err();
    assert!(interrupted(&err, 2, 512.0), "{err:?}");
    assert!(kept(&accumulator) && reliability::snapshot(&net, &[&adam])? == before);
    // A window of the output layer alone, stepped by an optimizer over the whole net.
    let mut window = GradAccumulator::new();
    scaler.accumulate(&net.out, &reliability::mse(&net, &x, &y)?, &mut window)?;
    let err = scaler.step_fused_accumulated(&mut window, &mut adam, None).err();
    assert!(matches!(&err, Some(Error::NotAccumulated { path }) if path == "hidden.weight"), "{err:?}");
    assert_eq!(window.micro_batches(), 1, "the sums are kept");
    assert!(reliability::snapshot(&net, &[&adam])? == before);
    Ok(())
}

/// Two layers that share one variable (tied weights, one `VarBuilder` name): its gradient is summed
/// once per micro-batch, the two uses' parts added, as one backward pass of the whole batch gives it.
#[test]
fn a_tied_weight_is_summed_once_per_micro_batch() -> Outcome {
    #[derive(AmpModule)]
    struct Tied {
        first: Linear,
        second: Linear,
    }
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut model = Tied { first: linear(4, 4, vb.pp("tied"))?, second: linear(4, 4, vb.pp("tied"))? };
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O0, &Device::Cpu))?;
    let forward = |x: &Tensor| model.second.forward(&model.first.forward(x)?.tanh()?);
    let loss = |rows: std::ops::Range<usize>| -> candle_core::Result<Tensor> {
        let (x, y) = micro_batch(3, 16, 4, 4)?;
        let (x, y) = (x.narrow(0, rows.start, rows.len())?, y.narrow(0, rows.start, rows.len())?);
        (forward(&x)? - y)?.sqr()?.mean_all()
    };
    let mut scaler = GradScaler::disabled();
    let mut accumulator = GradAccumulator::new();
    for rows in [0..8, 8..16] {
        scaler.accumulate(&model, &(loss(rows)? / 2.0)?, &mut accumulator)?;
    }
    let whole = loss(0..16)?.backward()?;
    let weight = model.first.weight().master().as_tensor();
    assert_eq!(weight.id(), model.second.weight().master().as_tensor().id(), "one variable");
    let want = whole.get(weight).ok_or("no gradient")?;
    common::assert_close("tied weight", accumulator.gradient(weight).ok_or("no sum")?, want, 1e-6)?;
    Ok(())
}

/// `step_accumulated` hands the user's optimizer the unscaled f32 sums, keyed by the masters.
#[test]
fn step_accumulated_hands_apply_the_unscaled_f32_sums() -> Outcome {
    let net = reliability::fp16_net(6, 24, 3, 5)?;
    let mut scaler = GradScaler::new(ScalerConfig::fixed(256.0))?;
    let mut accumulator = GradAccumulator::new();
    for j in 0..3 {
        let (x, y) = reliability::batch(j, 8, 6, 3)?;
        scaler.accumulate(&net, &reliability::mse(&net, &x, &y)?, &mut accumulator)?;
    }
    let expected: Vec<Tensor> = net
        .named_params()
        .iter()
        .map(|(_, p)| Ok((accumulator.gradient(p.master().as_tensor()).ok_or("no sum")? / 256.0)?))
        .collect::<Outcome<_>>()?;
    let report = scaler.step_accumulated(&net, &mut accumulator, |grads| {
        for ((path, p), want) in net.named_params().iter().zip(&expected) {
            let got = grads.get(p.master().as_tensor()).expect("keyed by the master");
            assert_eq!(got.dtype(), DType::F32, "{path}");
            assert_eq!(reliability::bits(got), reliability::bits(want), "{path}: unscaled exactly");
        }
        Ok(())
    })?;
    assert!(report.applied() && accumulator.is_empty(), "{report}");
    Ok(())
}

/// The data-parallel accumulated step on a world of one is the one-process accumulated step, bit for
/// bit, over windows that apply and one that overflows; its gradients travel once per window, as many
/// bytes in as many collectives as plain data-parallel steps, one per window.
#[test]
fn the_data_parallel_accumulated_step_on_one_process_is_step_fused_accumulated() -> Outcome {
    let (comm, plain_comm) = (SingleProcess::new(), SingleProcess::new());
    let (plain, replica) = (reliability::fp16_net(6, 24, 3, 5)?, reliability::fp16_net(6, 24, 3, 5)?);
    let adam = |m: &reliability::Net| FusedAdamW::new(ParamGroups::from_model(m)?, AdamConfig::default());
    let (mut plain_adam, mut adam) = (adam(&plain)?, adam(&replica)?);
    let config = || ScalerConfig { init_scale: 1024.0, ..Default::default() };
    let (mut plain_scaler, mut scaler) = (GradScaler::new(config())?, GradScaler::new(config())?);
    let (mut plain_acc, mut acc) = (GradAccumulator::new(), GradAccumulator::new());
    let mut dp = DataParallel::new(&comm, DataParallelConfig { bucket_bytes: 160, ..Default::default() })?;
    for window in 0..5u64 {
        for j in 0..2 {
            let (x, y) = reliability::batch(2 * window + j, 8, 6, 3)?;
            let factor = if window == 2 && j == 1 { 1e30 } else { 0.5 };
            plain_scaler.accumulate(
                &plain,
                &(reliability::mse(&plain, &x, &y)? * factor)?,
                &mut plain_acc,
            )?;
            scaler.accumulate(&replica, &(reliability::mse(&replica, &x, &y)? * factor)?, &mut acc)?;
        }
        let a = plain_scaler.step_fused_accumulated(&mut plain_acc, &mut plain_adam, Some(1.0))?;
        let b = dp.step_fused_accumulated(&mut scaler, &mut acc, &mut adam, Some(1.0))?;
        assert_eq!((a.applied(), b.applied()), (window != 2, window != 2), "window {window}: {a} / {b}");
        let left = reliability::snapshot(&plain, &[&plain_adam, &plain_scaler])?;
        let right = reliability::snapshot(&replica, &[&adam, &scaler])?;
        assert!(left == right, "window {window}: the data-parallel state parted from the one-process one");
    }
    let mut plain_dp =
        DataParallel::new(&plain_comm, DataParallelConfig { bucket_bytes: 160, ..Default::default() })?;
    let mut plain_scaler = GradScaler::new(config())?;
    for step in 0..5u64 {
        let (x, y) = reliability::batch(step, 8, 6, 3)?;
        plain_dp.step_fused(
            &mut plain_scaler,
            &reliability::mse(&plain, &x, &y)?,
            &mut plain_adam,
            Some(1.0),
        )?;
    }
    let (windows, steps) = (comm.traffic(), plain_comm.traffic());
    assert_eq!(
        (windows.all_reduce, windows.calls),
        (steps.all_reduce, steps.calls),
        "{windows:?} / {steps:?}"
    );
    assert!(windows.all_reduce >= 5 * 4 * 243, "{windows:?}");
    Ok(())
}

/// O3 (bf16 parameters, no masters): the sums are still f32; `step_accumulated` hands `apply` each
/// sum rounded once to the parameter's dtype, where the store of one backward pass would hold it.
#[test]
fn without_masters_the_sums_are_f32_and_apply_gets_them_rounded_once() -> Outcome {
    let model = head(8, 4, AmpConfig::new(OptLevel::O3, &Device::Cpu).with_half(Precision::Bf16))?;
    let mut scaler = GradScaler::disabled();
    let mut accumulator = GradAccumulator::new();
    for j in 0..64 {
        let (x, y) = micro_batch(j, 4, 8, 4)?;
        scaler.accumulate(&model, &(mse(&model, &x, &y)? / 64.0)?, &mut accumulator)?;
    }
    let params = model.named_params();
    let mut rounded = Vec::new();
    for (path, p) in &params {
        assert_eq!(p.master().dtype(), DType::BF16, "{path}: O3 keeps no master");
        let sum = accumulator.gradient(p.master().as_tensor()).ok_or("no sum")?;
        assert_eq!(sum.dtype(), DType::F32, "{path}: summed in f32");
        rounded.push(sum.to_dtype(DType::BF16)?);
    }
    let report = scaler.step_accumulated(&model, &mut accumulator, |grads| {
        for ((path, p), want) in params.iter().zip(&rounded) {
            let got = grads.get(p.master().as_tensor()).expect("keyed by the parameter");
            assert_eq!(got.dtype(), DType::BF16, "{path}");
            assert_eq!(reliability::bits(got), reliability::bits(want), "{path}");
        }
        Ok(())
    })?;
    assert!(report.applied(), "{report}");
    Ok(())
}

/// Refusals that come from the gradients rather than the window also keep the sums: a parameter the
/// window holds no gradient for (`MissingGradients::Error`, the default) in `step_fused_accumulated`,
/// and an O3 fp16 window that `step_accumulated` would have to unscale in fp16. Before, both emptied
/// the accumulator first, and their "nothing was changed" lost the window.
#[test]
fn refusals_for_the_gradients_keep_the_window() -> Outcome {
    // A second layer that the loss does not reach: no gradient for it in any micro-batch.
    #[derive(AmpModule)]
    struct Unused {
        used: Linear,
        unused: Linear,
    }
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut model = Unused { used: linear(4, 2, vb.pp("used"))?, unused: linear(4, 2, vb.pp("unused"))? };
    amp::initialize(&mut model, o2(Precision::Bf16))?;
    let mut adam = FusedAdamW::new(ParamGroups::from_model(&model)?, AdamConfig::default())?;
    let mut scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
    let mut accumulator = GradAccumulator::new();
    for j in 0..2 {
        let (x, y) = micro_batch(j, 4, 4, 2)?;
        scaler.accumulate(&model, &(mse(&model.used, &x, &y)? / 2.0)?, &mut accumulator)?;
    }
    let bytes = accumulator.bytes();
    let err = scaler.step_fused_accumulated(&mut accumulator, &mut adam, None).err();
    assert!(matches!(&err, Some(Error::NoGradient { .. })), "{err:?}");
    assert_eq!((accumulator.micro_batches(), accumulator.bytes()), (2, bytes), "the sums are kept");

    let o3 = head(8, 4, AmpConfig::new(OptLevel::O3, &Device::Cpu).with_half(Precision::Fp16))?;
    let mut scaler = GradScaler::new(ScalerConfig { init_scale: 1024.0, ..Default::default() })?;
    let mut accumulator = GradAccumulator::new();
    for j in 0..2 {
        let (x, y) = micro_batch(j, 4, 8, 4)?;
        scaler.accumulate(&o3, &(mse(&o3, &x, &y)? / 2.0)?, &mut accumulator)?;
    }
    let bytes = accumulator.bytes();
    let err = scaler.step_accumulated(&o3, &mut accumulator, |_| Ok(())).err();
    assert!(matches!(&err, Some(Error::Fp16Unscale { .. })), "{err:?}");
    assert_eq!((accumulator.micro_batches(), accumulator.bytes()), (2, bytes), "the sums are kept");
    Ok(())
}
