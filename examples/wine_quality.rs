//! A real data set: an MLP classifies red wines by quality (the UCI wine-quality data that the
//! `linfa-datasets` crate ships, 1,599 wines, 11 features, quality 3-8), trained from the same weights
//! with the same hyper-parameters in fp32, fp16 AMP (O2 with dynamic loss scaling) and bf16 AMP (O2),
//! reporting the held-out accuracy of each, over several seeds (initial weights and train/test split)
//! with the mean and the standard deviation across seeds.
//!
//! Two more bf16 runs keep layers fp32 with `#[amp(fp32)]`: the output layer (are the logits in bf16 the
//! cause of a gap?), and the first layer too (is it the features rounded to bf16?).
//!
//! Run: `cargo run --release --example wine_quality` (`-- --seeds N --epochs N`, `--help`)

use amp::nn::{linear, Linear};
use amp::optim::{AdamConfig, FusedAdamW, ParamGroups};
use amp::scaler::ScalerConfig;
use amp::{AmpConfig, AmpModule, GradScaler, OptLevel, Precision};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::VarBuilder;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

const FEATURES: usize = 11;
const CLASSES: usize = 6; // quality 3..=8
const HIDDEN: usize = 64;

#[derive(AmpModule)]
struct Classifier {
    input: Linear,
    hidden: Linear,
    output: Linear,
}

impl Module for Classifier {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.output.forward(&self.hidden.forward(&self.input.forward(x)?.relu()?)?.relu()?)
    }
}

/// The same network with its logits computed in fp32 whatever the level.
#[derive(AmpModule)]
struct ClassifierFp32Logits {
    input: Linear,
    hidden: Linear,
    #[amp(fp32)]
    output: Linear,
}

impl Module for ClassifierFp32Logits {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.output.forward(&self.hidden.forward(&self.input.forward(x)?.relu()?)?.relu()?)
    }
}

/// The same network with its first layer (which reads the features) and its logits in fp32.
#[derive(AmpModule)]
struct ClassifierFp32Ends {
    #[amp(fp32)]
    input: Linear,
    hidden: Linear,
    #[amp(fp32)]
    output: Linear,
}

impl Module for ClassifierFp32Ends {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.output.forward(&self.hidden.forward(&self.input.forward(x)?.relu()?)?.relu()?)
    }
}

/// Which layers a run keeps fp32 whatever its level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepFp32 {
    /// None: every layer follows the level.
    Nothing,
    /// The output layer: logits computed and returned in fp32.
    Logits,
    /// The first layer (features never rounded to half) and the output layer.
    InputAndLogits,
}

/// Standardised features and class labels, split 80/20 with a seeded shuffle.
#[derive(Debug)]
pub struct Data {
    /// Training features `(n, 11)` and labels `(n)`.
    pub train: (Tensor, Tensor),
    /// Held-out features and labels.
    pub test: (Tensor, Tensor),
    /// Accuracy of always answering the most common class of the training set, on the test set.
    pub majority_baseline: f64,
}

/// Loads, standardises (training-set mean and deviation) and splits the data set with `split_seed`.
pub fn load(split_seed: u64) -> candle_core::Result<Data> {
    let dataset = linfa_datasets::winequality();
    let rows: Vec<(Vec<f64>, u32)> = dataset
        .records
        .outer_iter()
        .zip(dataset.targets.iter())
        .map(|(row, &quality)| (row.to_vec(), (quality.clamp(3, 8) - 3) as u32))
        .collect();
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.shuffle(&mut StdRng::seed_from_u64(split_seed));
    let cut = rows.len() * 4 / 5;
    let (train_idx, test_idx) = order.split_at(cut);
    let mean: Vec<f64> =
        (0..FEATURES).map(|j| train_idx.iter().map(|&i| rows[i].0[j]).sum::<f64>() / cut as f64).collect();
    let std: Vec<f64> = (0..FEATURES)
        .map(|j| {
            (train_idx.iter().map(|&i| (rows[i].0[j] - mean[j]).powi(2)).sum::<f64>() / cut as f64)
                .sqrt()
                .max(1e-12)
        })
        .collect();
    let tensors = |idx: &[usize]| -> candle_core::Result<(Tensor, Tensor)> {
        let x: Vec<f32> = idx
            .iter()
            .flat_map(|&i| {
                (0..FEATURES).map(|j| ((rows[i].0[j] - mean[j]) / std[j]) as f32).collect::<Vec<_>>()
            })
            .collect();
        let y: Vec<u32> = idx.iter().map(|&i| rows[i].1).collect();
        Ok((
            Tensor::from_vec(x, (idx.len(), FEATURES), &Device::Cpu)?,
            Tensor::from_vec(y, idx.len(), &Device::Cpu)?,
        ))
    };
    let mut counts = [0usize; CLASSES];
    train_idx.iter().for_each(|&i| counts[rows[i].1 as usize] += 1);
    let majority = (0..CLASSES).max_by_key(|&c| counts[c]).unwrap_or(0) as u32;
    let majority_baseline =
        test_idx.iter().filter(|&&i| rows[i].1 == majority).count() as f64 / test_idx.len() as f64;
    Ok(Data { train: tensors(train_idx)?, test: tensors(test_idx)?, majority_baseline })
}

/// Initial weights from `seed` (uniform in +-1/sqrt(fan_in)), shared by every run of a seed: the
/// comparison is the same every time it runs.
pub fn initial_weights(seed: u64) -> candle_core::Result<HashMap<String, Tensor>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut weights = HashMap::new();
    for (name, fan_in, fan_out) in
        [("input", FEATURES, HIDDEN), ("hidden", HIDDEN, HIDDEN), ("output", HIDDEN, CLASSES)]
    {
        let bound = 1.0 / (fan_in as f32).sqrt();
        let mut uniform =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-bound..bound)).collect() };
        let weight = Tensor::from_vec(uniform(fan_out * fan_in), (fan_out, fan_in), &Device::Cpu)?;
        let bias = Tensor::from_vec(uniform(fan_out), fan_out, &Device::Cpu)?;
        weights.insert(format!("{name}.weight"), weight);
        weights.insert(format!("{name}.bias"), bias);
    }
    Ok(weights)
}

fn layers(vb: VarBuilder<'_>) -> candle_core::Result<[Linear; 3]> {
    Ok([
        linear(FEATURES, HIDDEN, vb.pp("input"))?,
        linear(HIDDEN, HIDDEN, vb.pp("hidden"))?,
        linear(HIDDEN, CLASSES, vb.pp("output"))?,
    ])
}

/// A run's result.
#[derive(Debug, Clone, Copy)]
pub struct Outcome {
    /// Training cross-entropy at the last epoch.
    pub train_loss: f32,
    /// Held-out accuracy.
    pub test_accuracy: f64,
    /// Steps skipped by the loss scaler.
    pub skipped: u64,
}

/// One of the compared runs: a level, and whether the logits stay fp32.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    /// Its name in tables.
    pub name: &'static str,
    /// Level and half type (fp32: O0).
    pub config: AmpConfig,
    /// The layers kept fp32.
    pub keep_fp32: KeepFp32,
}

/// Full-batch AdamW for `epochs` steps of `run`.
pub fn train(
    weights: &HashMap<String, Tensor>,
    data: &Data,
    run: Run,
    epochs: usize,
) -> amp::Result<Outcome> {
    let [input, hidden, output] =
        layers(VarBuilder::from_tensors(weights.clone(), DType::F32, &Device::Cpu))?;
    match run.keep_fp32 {
        KeepFp32::Nothing => train_model(Classifier { input, hidden, output }, data, run.config, epochs),
        KeepFp32::Logits => {
            train_model(ClassifierFp32Logits { input, hidden, output }, data, run.config, epochs)
        }
        KeepFp32::InputAndLogits => {
            train_model(ClassifierFp32Ends { input, hidden, output }, data, run.config, epochs)
        }
    }
}

fn train_model<M: AmpModule + Module>(
    mut model: M,
    data: &Data,
    config: AmpConfig,
    epochs: usize,
) -> amp::Result<Outcome> {
    amp::initialize(&mut model, config)?;
    let adam = AdamConfig { lr: 3e-3, weight_decay: 1e-4, ..AdamConfig::default() };
    let mut optimizer = FusedAdamW::new(ParamGroups::from_model(&model)?, adam)?;
    let mut scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
    let (x, y) = &data.train;
    let mut train_loss = f32::NAN;
    for _ in 0..epochs {
        let loss = amp::ops::loss::cross_entropy(&model.forward(x)?, y)?;
        train_loss = loss.to_scalar()?;
        scaler.step_fused(&loss, &mut optimizer, None)?;
    }
    let (x, y) = &data.test;
    let predicted = model.forward(x)?.argmax(D::Minus1)?;
    let correct = predicted.eq(y)?.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
    Ok(Outcome {
        train_loss,
        test_accuracy: f64::from(correct) / y.dim(0)? as f64,
        skipped: scaler.state().skipped,
    })
}

/// The runs compared: fp32, fp16 and bf16 AMP, and bf16 AMP with fp32 logits, then fp32 ends.
pub fn runs() -> [Run; 5] {
    let (o0, o2) = (OptLevel::O0, OptLevel::O2);
    let run =
        |name, opt_level, half, keep_fp32| Run { name, config: AmpConfig { opt_level, half }, keep_fp32 };
    [
        run("fp32", o0, Precision::Bf16, KeepFp32::Nothing),
        run("fp16 AMP (O2)", o2, Precision::Fp16, KeepFp32::Nothing),
        run("bf16 AMP (O2)", o2, Precision::Bf16, KeepFp32::Nothing),
        run("bf16, fp32 logits", o2, Precision::Bf16, KeepFp32::Logits),
        run("bf16, fp32 input+logits", o2, Precision::Bf16, KeepFp32::InputAndLogits),
    ]
}

/// Mean and sample standard deviation.
pub fn mean_std(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (mean, var.sqrt())
}

/// The wine-quality comparison over several seeds.
#[derive(Debug, clap::Parser)]
#[command(name = "wine_quality")]
struct Args {
    /// Seeds (each: its own initial weights and train/test split)
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    seeds: u64,
    /// Full-batch AdamW steps per run
    #[arg(long, value_name = "N", default_value_t = 400, value_parser = clap::value_parser!(u32).range(1..))]
    epochs: u32,
}

#[allow(dead_code)]
fn main() -> amp::Result<()> {
    let args = <Args as clap::Parser>::parse();
    let runs = runs();
    let mut results = vec![Vec::new(); runs.len()];
    let mut baselines = Vec::new();
    for seed in 0..args.seeds {
        let data = load(7 + seed)?;
        let weights = initial_weights(11 + seed)?;
        baselines.push(data.majority_baseline);
        for (run, results) in runs.iter().zip(&mut results) {
            results.push(train(&weights, &data, *run, args.epochs as usize)?);
        }
    }
    let (baseline, _) = mean_std(&baselines);
    println!(
        "wine quality: 1279 training and 320 held-out wines, {} seeds (weights and split), {} steps",
        args.seeds, args.epochs
    );
    println!("majority-class baseline: {:.1}%; mean +- standard deviation across seeds", 100.0 * baseline);
    println!(
        "{:<24} {:>17} {:>18} {:>15} {:>18} {:>7}",
        "run", "train loss", "loss - fp32", "test accuracy", "points - fp32", "skipped"
    );
    let accuracy = |r: &[Outcome]| r.iter().map(|o| 100.0 * o.test_accuracy).collect::<Vec<_>>();
    let loss = |r: &[Outcome]| r.iter().map(|o| f64::from(o.train_loss)).collect::<Vec<_>>();
    let paired = |a: &[f64], b: &[f64]| mean_std(&a.iter().zip(b).map(|(x, y)| x - y).collect::<Vec<_>>());
    let (fp32_accuracy, fp32_loss) = (accuracy(&results[0]), loss(&results[0]));
    for (run, outcomes) in runs.iter().zip(&results) {
        let ((l, l_sd), (dl, dl_sd)) = (mean_std(&loss(outcomes)), paired(&loss(outcomes), &fp32_loss));
        let ours = accuracy(outcomes);
        let ((a, a_sd), (da, da_sd)) = (mean_std(&ours), paired(&ours, &fp32_accuracy));
        let skipped: u64 = outcomes.iter().map(|o| o.skipped).sum();
        println!(
            "{:<24} {l:>8.4} +- {l_sd:.4} {dl:>+8.4} +- {dl_sd:.4} {a:>7.1}% +- {a_sd:.1} {da:>+8.2} +- {da_sd:.2} {skipped:>7}",
            run.name
        );
    }
    Ok(())
}
