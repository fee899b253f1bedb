//! The runs of one seed: each run's model, optimizer and scaler, stepped in lockstep.

use std::collections::HashMap;
use std::time::Instant;

use amp::optim::{AdamConfig, FusedAdamW, FusedOptimizer, ParamGroups, StateDtype};
use amp::scaler::ScalerConfig;
use amp::{AmpConfig, AmpModuleExt, GradScaler, OptLevel, Precision};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::args::{Args, Size};
use crate::distributed::Group;
use crate::gpt::Gpt;
use crate::markov::{split, Markov};
use crate::{Error, SEED};
use amp::distributed::DataParallel;

const EVAL_SEQS: usize = 64;

/// What one run of one seed did.
#[derive(Debug)]
pub struct Run {
    pub name: String,
    pub curve: Vec<(usize, f32)>,
    pub step_ms: Vec<f64>,
    pub skipped: u64,
    pub scale: f32,
    pub accuracy: f64,
    pub bytes: usize,
    /// Payload bytes this rank handed to collectives during the steps (0 on one process).
    pub sent: u64,
}

impl Run {
    pub fn median_ms(&self) -> f64 {
        let mut t = self.step_ms.clone();
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    }

    /// Mean training loss over the last 5% of steps (fresh samples each step: an unbiased estimate).
    pub fn final_loss(&self) -> f64 {
        let tail = &self.curve[self.curve.len() - (self.curve.len() / 20).max(1)..];
        tail.iter().map(|(_, l)| f64::from(*l)).sum::<f64>() / tail.len() as f64
    }
}

pub(crate) fn config_for(precision: Precision, opt_level: OptLevel) -> AmpConfig {
    match precision {
        Precision::Fp32 => AmpConfig { opt_level: OptLevel::O0, half: Precision::Bf16 },
        half => AmpConfig::new(opt_level, &Device::Cpu).with_half(half),
    }
}

pub(crate) fn run_name(precision: Precision, opt_level: OptLevel) -> String {
    match precision {
        Precision::Fp32 => "fp32 O0".into(),
        half => format!("{half} {opt_level}"),
    }
}

/// One run's model, optimizer and scaler. The runs step in lockstep (step i of every run, then step
/// i + 1), so load from other processes on a shared machine slows them all alike. In a data-parallel
/// job, each run steps through its own `DataParallel` over the group.
struct Trainer<'c> {
    size: Size,
    run: Run,
    model: Gpt,
    optimizer: FusedAdamW,
    scaler: GradScaler,
    window: (f64, usize), // ms and steps since the last progress line
    group: Option<(Group<'c>, DataParallel<'c>)>,
}

impl<'c> Trainer<'c> {
    fn new(
        size: Size,
        name: String,
        weights: &HashMap<String, Tensor>,
        config: AmpConfig,
        state_dtype: StateDtype,
        group: Option<Group<'c>>,
    ) -> amp::Result<Self> {
        let vb = VarBuilder::from_tensors(weights.clone(), DType::F32, &Device::Cpu);
        let mut model = Gpt::new(size.shape, vb)?;
        amp::initialize(&mut model, config)?;
        let group = match group {
            Some(group) => {
                let dp = group.data_parallel()?;
                dp.broadcast_masters(&model)?;
                Some((group, dp))
            }
            None => None,
        };
        let adam = AdamConfig { lr: size.lr, weight_decay: 0.01, state_dtype, ..AdamConfig::default() };
        let optimizer = FusedAdamW::new(ParamGroups::from_model(&model)?, adam)?;
        let scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
        let run = Run {
            name,
            curve: vec![],
            step_ms: vec![],
            skipped: 0,
            scale: 1.0,
            accuracy: 0.0,
            bytes: 0,
            sent: 0,
        };
        Ok(Trainer { size, run, model, optimizer, scaler, window: (0.0, 0), group })
    }

    /// One step on `ids` and `targets` (this rank's rows of the batch in a data-parallel job).
    fn step(&mut self, step: usize, lr: f64, (ids, targets): &(Tensor, Tensor)) -> amp::Result<()> {
        self.optimizer.set_learning_rate(lr);
        let sent_before = self.group.as_ref().map_or(0, |(g, _)| g.bytes_sent());
        let start = Instant::now();
        let loss = amp::ops::loss::cross_entropy(&self.model.logits(ids)?, targets)?;
        match &mut self.group {
            Some((_, dp)) => dp.step_fused(&mut self.scaler, &loss, &mut self.optimizer, Some(1.0))?,
            None => self.scaler.step_fused(&loss, &mut self.optimizer, Some(1.0))?,
        };
        let ms = start.elapsed().as_secs_f64() * 1e3;
        let mut loss = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        if let Some((group, _)) = &self.group {
            loss = group.mean(loss)?; // the whole batch's loss, outside the step's time
            self.run.sent += group.bytes_sent() - sent_before;
        }
        self.run.step_ms.push(ms);
        self.run.curve.push((step, loss));
        self.window = (self.window.0 + ms, self.window.1 + 1);
        Ok(())
    }

    fn progress(&mut self, step: usize, steps: usize) {
        let recent = &self.run.curve[self.run.curve.len() - self.window.1..];
        let mean = recent.iter().map(|(_, l)| l).sum::<f32>() / recent.len() as f32;
        let tokens_s = (self.window.1 * self.size.tokens()) as f64 / (self.window.0 / 1e3);
        println!(
            "  {:<9} step {step:>5}/{steps}  loss {mean:.4}  {tokens_s:>8.0} tokens/s  scale {:<8}  skipped {}",
            self.run.name,
            self.scaler.scale(),
            self.scaler.state().skipped
        );
        self.window = (0.0, 0);
    }

    /// The run's state for the progress bar: last loss, recent speed, scale and skips.
    fn status(&self) -> String {
        let (ms, steps) = self.window;
        let tokens_s = if steps == 0 { 0.0 } else { (steps * self.size.tokens()) as f64 / (ms / 1e3) };
        let loss = self.run.curve.last().map_or(f32::NAN, |p| p.1);
        let (scale, skipped) = (self.scaler.scale(), self.scaler.state().skipped);
        format!("{} loss {loss:.3} {tokens_s:.0} tok/s scale {scale} skips {skipped}", self.run.name)
    }

    fn finish(mut self, eval: &(Tensor, Tensor)) -> amp::Result<Run> {
        let predicted = self.model.logits(&eval.0)?.argmax(D::Minus1)?;
        let hits = predicted.eq(&eval.1)?.to_dtype(DType::F32)?.mean_all()?.to_scalar::<f32>()?;
        self.run.accuracy = f64::from(hits);
        self.run.skipped = self.scaler.state().skipped;
        self.run.scale = self.scaler.scale();
        self.run.bytes = self.model.precision_plan().bytes_planned() + self.optimizer.state_bytes();
        Ok(self.run)
    }
}

/// Linear warm-up over the first 5% of steps, then cosine decay to a tenth of the rate.
fn learning_rate(lr: f64, step: usize, steps: usize) -> f64 {
    let warmup = (steps / 20).max(1);
    if step <= warmup {
        return lr * step as f64 / warmup as f64;
    }
    let t = (step - warmup) as f64 / (steps - warmup).max(1) as f64;
    lr * (0.1 + 0.45 * (1.0 + (std::f64::consts::PI * t).cos()))
}

/// One seed's data: the training batches, the held-out set and the oracle's accuracy on it.
pub(crate) struct SeedData {
    pub(crate) batches: Vec<(Tensor, Tensor)>,
    pub(crate) eval: (Tensor, Tensor),
    pub(crate) oracle: f64,
}

impl SeedData {
    /// Draws `steps` batches and the held-out set from one stream seeded by `seed`.
    pub(crate) fn draw(
        source: &Markov,
        size: Size,
        steps: usize,
        seed: u64,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let mut rng = StdRng::seed_from_u64(SEED + 1 + 1000 * seed);
        let (batch, seq) = (size.batch, size.shape.seq);
        let batches = (0..steps)
            .map(|_| split(source.sequences(batch, seq, &mut rng), batch, seq, device))
            .collect::<Result<Vec<_>, _>>()?;
        let eval = split(source.sequences(EVAL_SEQS, seq, &mut rng), EVAL_SEQS, seq, device)?;
        let (guesses, _) = source.best_guess();
        let ids = eval.0.flatten_all()?.to_vec1::<u32>()?;
        let targets = eval.1.to_vec1::<u32>()?;
        let hits = ids.iter().zip(&targets).filter(|(i, t)| guesses[**i as usize] == **t).count();
        Ok(SeedData { batches, eval, oracle: hits as f64 / targets.len() as f64 })
    }
}

/// Trains every run of `args` from `weights` on `data`, in lockstep, with a live bar and a progress line
/// every 10% of the steps (on rank 0 only in a data-parallel job, where each rank trains on its rows).
pub(crate) fn train_runs(
    args: &Args,
    weights: &HashMap<String, Tensor>,
    data: &SeedData,
    group: Option<Group<'_>>,
) -> Result<Vec<Run>, Error> {
    let size = args.size;
    let steps = data.batches.len();
    let mut trainers = args
        .runs
        .iter()
        .map(|p| {
            let (name, config) = (run_name(*p, args.opt_level), config_for(*p, args.opt_level));
            Trainer::new(size, name, weights, config, args.optimizer_state, group)
        })
        .collect::<amp::Result<Vec<_>>>()?;
    let every = (steps / 10).max(1);
    let root = group.is_none_or(|g| g.rank() == 0);
    // A live bar on a terminal (hidden when output is redirected), plus a line every 10% for logs.
    let bar = if root { indicatif::ProgressBar::new(steps as u64) } else { indicatif::ProgressBar::hidden() };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:24} {pos}/{len} {msg}")
            .map_err(|e| format!("progress bar template: {e}"))?,
    );
    for (step, batch) in data.batches.iter().enumerate().map(|(i, b)| (i + 1, b)) {
        let rows = group.map(|g| g.rows(batch)).transpose()?;
        for trainer in &mut trainers {
            trainer.step(step, learning_rate(size.lr, step, steps), rows.as_ref().unwrap_or(batch))?;
        }
        bar.set_position(step as u64);
        bar.set_message(trainers.iter().map(Trainer::status).collect::<Vec<_>>().join(" | "));
        if root && (step % every == 0 || step == steps) {
            bar.suspend(|| trainers.iter_mut().for_each(|t| t.progress(step, steps)));
        }
    }
    bar.finish_and_clear();
    Ok(trainers.into_iter().map(|t| t.finish(&data.eval)).collect::<amp::Result<Vec<_>>>()?)
}
