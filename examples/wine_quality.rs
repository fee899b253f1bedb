//! A real data set: an MLP classifies red wines by quality (the UCI wine-quality data that the
//! `linfa-datasets` crate ships, 1,599 wines, 11 features, quality 3-8), trained from the same weights
//! with the same hyper-parameters in fp32, fp16 AMP (O2 with dynamic loss scaling) and bf16 AMP (O2),
//! reporting the held-out accuracy of each.
//!
//! Run: `cargo run --release --example wine_quality`

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

/// Standardised features and class labels, split 80/20 with a fixed shuffle.
#[derive(Debug)]
pub struct Data {
    /// Training features `(n, 11)` and labels `(n)`.
    pub train: (Tensor, Tensor),
    /// Held-out features and labels.
    pub test: (Tensor, Tensor),
    /// Accuracy of always answering the most common class of the training set, on the test set.
    pub majority_baseline: f64,
}

/// Loads, standardises (training-set mean and deviation) and splits the data set.
pub fn load() -> candle_core::Result<Data> {
    let dataset = linfa_datasets::winequality();
    let rows: Vec<(Vec<f64>, u32)> = dataset
        .records
        .outer_iter()
        .zip(dataset.targets.iter())
        .map(|(row, &quality)| (row.to_vec(), (quality.clamp(3, 8) - 3) as u32))
        .collect();
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.shuffle(&mut StdRng::seed_from_u64(7));
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

/// Seeded initial weights (uniform in +-1/sqrt(fan_in)), shared by every run: the comparison is the
/// same every time it runs.
pub fn initial_weights() -> candle_core::Result<HashMap<String, Tensor>> {
    let mut rng = StdRng::seed_from_u64(11);
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

fn build(vb: VarBuilder<'_>) -> candle_core::Result<Classifier> {
    Ok(Classifier {
        input: linear(FEATURES, HIDDEN, vb.pp("input"))?,
        hidden: linear(HIDDEN, HIDDEN, vb.pp("hidden"))?,
        output: linear(HIDDEN, CLASSES, vb.pp("output"))?,
    })
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

/// Full-batch AdamW for `epochs` steps under `config` (fp32: O0).
pub fn train(
    weights: &HashMap<String, Tensor>,
    data: &Data,
    config: AmpConfig,
    epochs: usize,
) -> amp::Result<Outcome> {
    let mut model = build(VarBuilder::from_tensors(weights.clone(), DType::F32, &Device::Cpu))?;
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

/// The three runs compared.
pub fn runs() -> [(&'static str, AmpConfig); 3] {
    [
        ("fp32", AmpConfig { opt_level: OptLevel::O0, half: Precision::Bf16 }),
        ("fp16 AMP (O2)", AmpConfig { opt_level: OptLevel::O2, half: Precision::Fp16 }),
        ("bf16 AMP (O2)", AmpConfig { opt_level: OptLevel::O2, half: Precision::Bf16 }),
    ]
}

#[allow(dead_code)]
fn main() -> amp::Result<()> {
    let data = load()?;
    let weights = initial_weights()?;
    println!("wine quality: {} training and {} held-out wines", data.train.1.dim(0)?, data.test.1.dim(0)?);
    println!("majority-class baseline: {:.1}%", 100.0 * data.majority_baseline);
    println!("{:<16} {:>12} {:>14} {:>8}", "run", "train loss", "test accuracy", "skipped");
    for (name, config) in runs() {
        let outcome = train(&weights, &data, config, 400)?;
        println!(
            "{name:<16} {:>12.4} {:>13.1}% {:>8}",
            outcome.train_loss,
            100.0 * outcome.test_accuracy,
            outcome.skipped
        );
    }
    Ok(())
}
