//! Bring your own candle model: candle-transformers' Gemma, unchanged, built through amp's `AmpVarMap`
//! and trained as fp32 (O0), bf16 O2 and fp16 O2 (dynamic loss scaling) from the same initial weights
//! and data, side by side.
//!
//! The model is small (2 layers, hidden 64, vocabulary 32) with random weights: no download. It learns
//! which token follows a sequence drawn from a Markov chain, whose best possible loss (the entropy rate)
//! is known. Gemma's attention runs candle-nn's `rotary_emb::rope` and `softmax_last_dim`, which have
//! no backward: its query and key projections never receive a gradient in candle. amp's first step
//! names them; this example declares them frozen (`MissingGradients::Warn`) and trains the rest.
//!
//! `cargo run --release --example bring_your_own` (`-- --seeds N --steps N`, `--help`)

use std::time::Instant;

use amp::optim::{AdamConfig, FusedAdamW, ParamGroups};
use amp::scaler::{MissingGradients, ScalerConfig};
use amp::varmap::{AmpVarMap, SeededInit};
use amp::{AmpConfig, AmpModuleExt, GradScaler, OptLevel, Precision};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use candle_transformers::models::gemma;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Tokens.
pub const VOCAB: usize = 32;
/// Tokens before the one to predict.
pub const SEQ: usize = 12;
/// Sequences per step.
pub const BATCH: usize = 32;

/// A small Gemma: 2 layers, 4 query heads sharing 2 key/value heads.
pub fn gemma_config() -> gemma::Config {
    gemma::Config {
        attention_bias: false,
        head_dim: 16,
        hidden_act: Some(candle_nn::Activation::GeluPytorchTanh),
        hidden_activation: None,
        hidden_size: 64,
        intermediate_size: 128,
        num_attention_heads: 4,
        num_hidden_layers: 2,
        num_key_value_heads: 2,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        vocab_size: VOCAB,
        max_position_embeddings: 64,
    }
}

/// A Markov chain with two likely successors per token, and its entropy rate (the best loss).
#[derive(Debug)]
pub struct Markov {
    rows: Vec<Vec<f64>>,
    /// Entropy rate in nats: the loss of the best predictor.
    pub floor: f64,
}

impl Markov {
    /// The chain of `seed`.
    pub fn new(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let rows: Vec<Vec<f64>> = (0..VOCAB)
            .map(|_| {
                let mut row = vec![0.002; VOCAB];
                for _ in 0..2 {
                    row[rng.random_range(0..VOCAB)] += rng.random_range(0.2..1.0);
                }
                let total: f64 = row.iter().sum();
                row.iter().map(|p| p / total).collect()
            })
            .collect();
        let stationary = stationary(&rows);
        let floor =
            rows.iter().zip(&stationary).map(|(r, p)| -p * r.iter().map(|q| q * q.ln()).sum::<f64>()).sum();
        Markov { rows, floor }
    }

    /// `steps` batches of (sequences `(BATCH, SEQ)`, the token after each `(BATCH)`), from `seed`.
    pub fn batches(&self, seed: u64, steps: usize) -> candle_core::Result<Vec<(Tensor, Tensor)>> {
        let mut rng = StdRng::seed_from_u64(seed);
        let start = stationary(&self.rows);
        (0..steps)
            .map(|_| {
                let mut ids = Vec::with_capacity(BATCH * (SEQ + 1));
                for _ in 0..BATCH {
                    let mut token = sample(&mut rng, &start);
                    ids.push(token as u32);
                    for _ in 0..SEQ {
                        token = sample(&mut rng, &self.rows[token]);
                        ids.push(token as u32);
                    }
                }
                let all = Tensor::from_vec(ids, (BATCH, SEQ + 1), &Device::Cpu)?;
                Ok((all.narrow(1, 0, SEQ)?, all.narrow(1, SEQ, 1)?.flatten_all()?))
            })
            .collect()
    }
}

fn stationary(rows: &[Vec<f64>]) -> Vec<f64> {
    let mut pi = vec![1.0 / VOCAB as f64; VOCAB];
    for _ in 0..2_000 {
        let mut next = vec![0.0; VOCAB];
        for (i, row) in rows.iter().enumerate() {
            for (j, p) in row.iter().enumerate() {
                next[j] += pi[i] * p;
            }
        }
        pi = next;
    }
    pi
}

fn sample(rng: &mut StdRng, dist: &[f64]) -> usize {
    let mut u: f64 = rng.random();
    dist.iter()
        .position(|p| {
            u -= p;
            u <= 0.0
        })
        .unwrap_or(dist.len() - 1)
}

/// Gemma's initial weights, made once so that every run of a seed starts from them: candle-nn's own
/// initializers drawn from `seed` (`amp::varmap::SeededInit`; candle's CPU generator cannot be seeded),
/// so that a run is the same every time.
pub fn initial_weights(seed: u64) -> candle_core::Result<VarMap> {
    let varmap = VarMap::new();
    let vb = SeededInit::new(seed).var_builder(&varmap, DType::F32, &Device::Cpu);
    gemma::Model::new(false, &gemma_config(), vb)?;
    Ok(varmap)
}

/// What one run did.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// Training loss of every step.
    pub losses: Vec<f32>,
    /// Mean loss on the held-out batches after training.
    pub eval_loss: f32,
    /// Steps the scaler skipped.
    pub skipped: u64,
    /// The loss scale at the end.
    pub scale: f32,
    /// Median milliseconds per step.
    pub step_ms: f64,
    /// The parameters the first step found without a gradient.
    pub frozen: Vec<String>,
    /// Trainable parameter values.
    pub params: usize,
}

/// Trains Gemma under `config` from `initial` on `train`, then evaluates on `eval`.
pub fn train(
    config: AmpConfig,
    initial: &VarMap,
    train: &[(Tensor, Tensor)],
    eval: &[(Tensor, Tensor)],
) -> amp::Result<Outcome> {
    let varmap = AmpVarMap::new(config).with_initial_from_varmap(initial)?;
    let mut model = gemma::Model::new(false, &gemma_config(), varmap.var_builder(&Device::Cpu))?;
    let frozen = frozen_by_candle(&varmap, &mut model, &train[0])?;
    let adam = AdamConfig { lr: 3e-3, weight_decay: 0.0, ..AdamConfig::default() };
    let mut optimizer = FusedAdamW::new(ParamGroups::from_model(&varmap)?, adam)?;
    let mut scaler =
        GradScaler::for_model(&varmap, ScalerConfig::default())?.on_missing_gradients(MissingGradients::Warn);
    let (mut losses, mut times) = (Vec::new(), Vec::new());
    for batch in train {
        let start = Instant::now();
        let loss = loss(&mut model, batch)?;
        scaler.step_fused(&loss, &mut optimizer, Some(1.0))?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
        losses.push(loss.to_scalar::<f32>()?);
    }
    let eval_loss =
        eval.iter().map(|b| Ok(loss(&mut model, b)?.to_scalar::<f32>()?)).sum::<amp::Result<f32>>()?
            / eval.len() as f32;
    times.sort_by(f64::total_cmp);
    Ok(Outcome {
        losses,
        eval_loss,
        skipped: scaler.state().skipped,
        scale: scaler.scale(),
        step_ms: times[times.len() / 2],
        frozen,
        params: varmap.precision_plan().params(),
    })
}

/// Cross-entropy of the token after each sequence, in f32.
fn loss(model: &mut gemma::Model, (ids, next): &(Tensor, Tensor)) -> candle_core::Result<Tensor> {
    model.clear_kv_cache();
    let logits = model.forward(ids, 0)?.squeeze(1)?.to_dtype(DType::F32)?;
    candle_nn::loss::cross_entropy(&logits, next)
}

/// The parameters amp's default first-step check refuses, by name (no weight changes).
fn frozen_by_candle(
    varmap: &AmpVarMap,
    model: &mut gemma::Model,
    batch: &(Tensor, Tensor),
) -> amp::Result<Vec<String>> {
    let mut optimizer = FusedAdamW::new(ParamGroups::from_model(varmap)?, AdamConfig::default())?;
    let mut scaler = GradScaler::for_model(varmap, ScalerConfig::default())?;
    match scaler.step_fused(&loss(model, batch)?, &mut optimizer, None) {
        Err(amp::Error::NoGradient { params }) => Ok(params.paths().iter().map(|p| p.to_string()).collect()),
        Err(other) => Err(other),
        Ok(_) => Err(amp::Error::Internal { what: "expected candle to drop the q/k gradients".into() }),
    }
}

/// The three runs of the comparison.
pub fn runs() -> [(&'static str, AmpConfig); 3] {
    let cpu = Device::Cpu;
    [
        ("fp32 O0", AmpConfig::new(OptLevel::O0, &cpu)),
        ("bf16 O2", AmpConfig::new(OptLevel::O2, &cpu).with_half(Precision::Bf16)),
        ("fp16 O2", AmpConfig::new(OptLevel::O2, &cpu).with_half(Precision::Fp16)),
    ]
}

/// Mean of the last `n` values.
pub fn tail_mean(values: &[f32], n: usize) -> f32 {
    let n = n.min(values.len()).max(1);
    values[values.len() - n..].iter().sum::<f32>() / n as f32
}

/// candle-transformers' Gemma trained as fp32, bf16 O2 and fp16 O2 through amp's VarBuilder.
#[derive(Debug, clap::Parser)]
#[command(name = "bring_your_own")]
struct Args {
    /// Optimizer steps per run
    #[arg(long, value_name = "N", default_value_t = 300, value_parser = clap::value_parser!(u32).range(1..))]
    steps: u32,
    /// Seeds (each: its own initial weights and training batches; the chain and held-out set stay)
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    seeds: u64,
}

/// Mean and sample standard deviation.
fn mean_std(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    (mean, (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0)).sqrt())
}

#[allow(dead_code)]
fn main() -> amp::Result<()> {
    let args = <Args as clap::Parser>::parse();
    let (steps, markov) = (args.steps as usize, Markov::new(7));
    let eval_set = markov.batches(2, 8)?;
    println!(
        "candle-transformers Gemma, {steps} AdamW steps, batch {BATCH}, seeded random weights, {} seed(s)",
        args.seeds
    );
    let runs = runs();
    let mut outcomes: Vec<Vec<Outcome>> = vec![Vec::new(); runs.len()];
    for seed in 0..args.seeds {
        let (train_set, initial) = (markov.batches(1 + 10 * seed, steps)?, initial_weights(3 + seed)?);
        for ((_, config), outcomes) in runs.iter().zip(&mut outcomes) {
            outcomes.push(train(*config, &initial, &train_set, &eval_set)?);
        }
    }
    let frozen = &outcomes[0][0].frozen;
    println!("no gradient in candle ({} tensors, frozen in every run): {}", frozen.len(), frozen.join(", "));
    println!("mean +- standard deviation across seeds; \"- fp32\" paired by seed");
    println!(
        "{:<8} {:>10} {:>17} {:>17} {:>18} {:>8} {:>8}",
        "run", "first loss", "train loss", "eval loss", "eval - fp32", "skipped", "step ms"
    );
    let eval = |o: &[Outcome]| o.iter().map(|o| f64::from(o.eval_loss)).collect::<Vec<_>>();
    let reference = eval(&outcomes[0]);
    for ((name, _), o) in runs.iter().zip(&outcomes) {
        let first = mean_std(&o.iter().map(|o| f64::from(o.losses[0])).collect::<Vec<_>>()).0;
        let (train, train_sd) =
            mean_std(&o.iter().map(|o| f64::from(tail_mean(&o.losses, 20))).collect::<Vec<_>>());
        let (loss, loss_sd) = mean_std(&eval(o));
        let paired: Vec<f64> = eval(o).iter().zip(&reference).map(|(a, b)| a - b).collect();
        let (gap, gap_sd) = mean_std(&paired);
        let skipped: u64 = o.iter().map(|o| o.skipped).sum();
        let step_ms = mean_std(&o.iter().map(|o| o.step_ms).collect::<Vec<_>>()).0;
        println!(
            "{name:<8} {first:>10.3} {train:>8.4} +- {train_sd:.4} {loss:>8.4} +- {loss_sd:.4} {gap:>+9.4} +- {gap_sd:.4} {skipped:>8} {step_ms:>8.2}"
        );
    }
    println!("floor (entropy rate) {:.4} nats; {} parameter values", markov.floor, outcomes[0][0].params);
    Ok(())
}
