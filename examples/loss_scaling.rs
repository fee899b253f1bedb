//! Loss scaling shown: a model whose fp16 gradients underflow.
//!
//! What it shows: the loss is multiplied by 2^-20 (as if it were averaged over a huge batch) and the
//! learning rate by 2^20, so fp32 SGD trains exactly as usual while the gradients become ~1e-7 to 1e-10,
//! below fp16's smallest subnormal (6e-8). The example measures the fraction of fp32 gradient values that
//! flush to zero when rounded to fp16 (Micikevicius et al. measured 67% for SSD), then trains the same
//! model from the same weights in fp32, fp16 O2 without scaling (the updates vanish and the loss stalls)
//! and fp16 O2 with the dynamic scaler (it matches fp32).
//!
//! Every run is repeated over several seeds (initial weights and batch; `--seeds`, default 5) and the
//! table gives each setup's mean and spread, and its final loss against fp32's of the same seed.
//!
//! Run: `cargo run --release --example loss_scaling` (`-- --seeds N --steps N`, `--help`)

use amp::nn::{linear, Linear};
use amp::optim::{FusedSgd, ParamGroups, SgdConfig};
use amp::scaler::ScalerConfig;
use amp::{AmpConfig, AmpModule, AmpModuleExt, GradScaler, OptLevel, Precision};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// The loss factor that pushes gradients below fp16's range, and the learning-rate factor that undoes it.
const LOSS_FACTOR: f64 = 1.0 / 1_048_576.0;

#[derive(AmpModule)]
struct Mlp {
    layers: Vec<Linear>,
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let last = self.layers.len() - 1;
        self.layers.iter().enumerate().try_fold(x.clone(), |x, (i, layer)| {
            let y = layer.forward(&x)?;
            if i == last {
                Ok(y)
            } else {
                y.tanh()
            }
        })
    }
}

/// How one run ended.
#[derive(Debug, Clone, Copy)]
pub struct Outcome {
    /// Loss (unscaled, without the tiny factor) before the first step.
    pub first: f32,
    /// Mean loss over the last tenth of the steps.
    pub last: f32,
    /// Steps the scaler skipped.
    pub skipped: u64,
}

/// Which precision setup a run uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Setup {
    /// fp32 (O0).
    Fp32,
    /// fp16 O2 with no loss scaling.
    Fp16Unscaled,
    /// fp16 O2 with the dynamic scaler.
    Fp16Scaled,
}

/// Initial weights of a `width`-wide, `depth`-deep MLP (uniform in +-1/sqrt(fan_in), as candle-nn's
/// default bias init) and a regression batch, both drawn from `seed`: the run is the same every time.
pub fn problem(
    width: usize,
    depth: usize,
    seed: u64,
) -> candle_core::Result<(HashMap<String, Tensor>, Tensor, Tensor)> {
    let mut rng = StdRng::seed_from_u64(17 + seed);
    let mut uniform = |shape: &[usize], bound: f32| {
        let n = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|_| rng.random_range(-bound..bound)).collect();
        Tensor::from_vec(values, shape, &Device::Cpu)
    };
    let mut weights = HashMap::new();
    for i in 0..=depth {
        let out = if i == depth { 1 } else { width };
        let bound = 1.0 / (width as f32).sqrt();
        weights.insert(format!("layers.{i}.weight"), uniform(&[out, width], bound)?);
        weights.insert(format!("layers.{i}.bias"), uniform(&[out], bound)?);
    }
    let x = uniform(&[64, width], 1.7)?;
    let y = (x.narrow(1, 0, 1)? * 0.5)?.sin()?;
    Ok((weights, x, y))
}

fn build(vb: &VarBuilder<'_>, width: usize, depth: usize) -> candle_core::Result<Mlp> {
    let mut layers = (0..depth)
        .map(|i| linear(width, width, vb.pp(format!("layers.{i}"))))
        .collect::<Result<Vec<_>, _>>()?;
    layers.push(linear(width, 1, vb.pp(format!("layers.{depth}")))?);
    Ok(Mlp { layers })
}

/// The fraction of non-zero fp32 weight gradients that round to zero in fp16, at the initial weights.
pub fn flush_fraction(
    weights: &HashMap<String, Tensor>,
    x: &Tensor,
    y: &Tensor,
    width: usize,
    depth: usize,
) -> amp::Result<f64> {
    let model = build(&VarBuilder::from_tensors(weights.clone(), DType::F32, &Device::Cpu), width, depth)?;
    let loss = ((model.forward(x)? - y)?.sqr()?.mean_all()? * LOSS_FACTOR)?;
    let grads = loss.backward()?;
    let (mut nonzero, mut flushed) = (0usize, 0usize);
    for (path, param) in model.named_params() {
        let Some(grad) = param.grad(&path, &grads)? else { continue };
        for g in grad.flatten_all()?.to_vec1::<f32>()? {
            if g != 0.0 {
                nonzero += 1;
                flushed += usize::from(half::f16::from_f32(g) == half::f16::ZERO);
            }
        }
    }
    Ok(flushed as f64 / nonzero.max(1) as f64)
}

/// Trains `steps` steps of momentum SGD from `weights` under `setup`.
pub fn train(
    weights: &HashMap<String, Tensor>,
    x: &Tensor,
    y: &Tensor,
    width: usize,
    depth: usize,
    setup: Setup,
    steps: usize,
) -> amp::Result<Outcome> {
    let mut model =
        build(&VarBuilder::from_tensors(weights.clone(), DType::F32, &Device::Cpu), width, depth)?;
    let config = match setup {
        Setup::Fp32 => AmpConfig { opt_level: OptLevel::O0, half: Precision::Fp16 },
        Setup::Fp16Unscaled | Setup::Fp16Scaled => {
            AmpConfig { opt_level: OptLevel::O2, half: Precision::Fp16 }
        }
    };
    amp::initialize(&mut model, config)?;
    let sgd = SgdConfig { lr: 0.05 / LOSS_FACTOR, momentum: 0.9, ..SgdConfig::default() };
    let mut optimizer = FusedSgd::new(ParamGroups::from_model(&model)?, sgd)?;
    let mut scaler = match setup {
        Setup::Fp16Scaled => GradScaler::new(ScalerConfig::default())?,
        // Disabled: scale 1, gradients stay where backward put them; non-finite steps are still skipped.
        Setup::Fp32 | Setup::Fp16Unscaled => GradScaler::disabled().with_finite_guard(true),
    };
    let mut losses = Vec::with_capacity(steps);
    for _ in 0..steps {
        let mse = (model.forward(x)? - y)?.sqr()?.mean_all()?;
        losses.push(mse.to_scalar::<f32>()?);
        scaler.step_fused(&(mse * LOSS_FACTOR)?, &mut optimizer, None)?;
    }
    let tail = &losses[steps - steps / 10..];
    Ok(Outcome {
        first: losses[0],
        last: tail.iter().sum::<f32>() / tail.len() as f32,
        skipped: scaler.state().skipped,
    })
}

/// Loss scaling shown: fp32, fp16 without scaling and fp16 with the dynamic scaler, over several seeds.
#[derive(Debug, clap::Parser)]
#[command(name = "loss_scaling")]
struct Args {
    /// Seeds (each its own initial weights and batch)
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    seeds: u64,
    /// SGD steps per run, at least 10
    #[arg(long, value_name = "N", default_value_t = 300, value_parser = clap::value_parser!(u64).range(10..))]
    steps: u64,
}

/// Mean and sample standard deviation.
fn mean_sd(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    (mean, (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0)).sqrt())
}

#[allow(dead_code)]
fn main() -> amp::Result<()> {
    let args = <Args as clap::Parser>::parse();
    let (width, depth, steps) = (64, 4, args.steps as usize);
    let setups = [Setup::Fp32, Setup::Fp16Unscaled, Setup::Fp16Scaled];
    let (mut flushed, mut outcomes) = (Vec::new(), vec![Vec::new(); setups.len()]);
    for seed in 0..args.seeds {
        let (weights, x, y) = problem(width, depth, seed)?;
        flushed.push(flush_fraction(&weights, &x, &y, width, depth)?);
        for (setup, outcomes) in setups.iter().zip(&mut outcomes) {
            outcomes.push(train(&weights, &x, &y, width, depth, *setup, steps)?);
        }
    }
    let (flush_mean, flush_sd) = mean_sd(&flushed);
    println!(
        "fp32 weight gradients that flush to zero in fp16: {:.1}% +- {:.1}%",
        100.0 * flush_mean,
        100.0 * flush_sd
    );
    println!(
        "{} seeds (weights and batch), {steps} steps; mean +- standard deviation across seeds; final loss: \
         mean of the last 10% of steps; \"/ fp32\": final loss over fp32's of the same seed",
        args.seeds
    );
    println!(
        "{:<14} {:>22} {:>22} {:>20} {:>8}",
        "run", "first loss", "final loss", "final / fp32", "skipped"
    );
    for (setup, runs) in setups.iter().zip(&outcomes) {
        let of = |f: &dyn Fn(&Outcome) -> f64| runs.iter().map(f).collect::<Vec<_>>();
        let (first, first_sd) = mean_sd(&of(&|o| f64::from(o.first)));
        let (last, last_sd) = mean_sd(&of(&|o| f64::from(o.last)));
        let ratios: Vec<f64> =
            runs.iter().zip(&outcomes[0]).map(|(o, fp32)| f64::from(o.last / fp32.last)).collect();
        let (ratio, ratio_sd) = mean_sd(&ratios);
        let ratio = match setup {
            Setup::Fp32 => "-".to_string(),
            _ if ratio > 100.0 => format!("{ratio:.1e} +- {ratio_sd:.0e}"),
            _ => format!("{ratio:.4} +- {ratio_sd:.4}"),
        };
        println!(
            "{:<14} {:>22} {:>22} {ratio:>20} {:>8}",
            format!("{setup:?}"),
            format!("{first:.3e} +- {first_sd:.1e}"),
            format!("{last:.3e} +- {last_sd:.1e}"),
            runs.iter().map(|o| o.skipped).sum::<u64>()
        );
    }
    Ok(())
}
