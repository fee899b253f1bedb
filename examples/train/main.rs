//! The main job: fp32, bf16 and fp16 training of the same small decoder-only transformer, compared.
//!
//! What it shows: a GPT-style model written once with `#[derive(AmpModule)]` and precision attributes
//! (fp32 LayerNorms, everything else in the level's half type, no casts in the model), trained from the
//! SAME initial weights on the SAME data order with the same hyper-parameters as fp32 (O0), bf16 (O2)
//! and fp16 (O2 with dynamic loss scaling), each with the fused AdamW and `GradScaler::step_fused`.
//! The task is next-token prediction on a generated first-order Markov source whose entropy rate is
//! computed exactly, so every final loss can be read against the best possible loss (the floor), and
//! every accuracy against the best achievable one (always guessing the likeliest successor).
//!
//! Prints the precision plan, progress lines and a final table; writes `results.json`,
//! `loss_curves.csv` and `loss_curves.png` (every run on one plot, with the entropy floor) into the
//! output folder.
//!
//! Run: `cargo run --release --example train` (all three runs of the default size, interleaved step
//! by step: about a minute on 2 cores), `-- --size tiny` for the small model, or e.g.
//! `cargo run --release --example train -- --precision fp32,fp16 --opt-level O1 --steps 200 --out out/`.
//! `--help` lists every flag.
//!
//! Data-parallel (built with `--features mpi`): `mpirun -np 2 target/release/examples/train --data-parallel`
//! trains the same runs with each rank on its share of every batch, the gradients averaged over the
//! ranks (`distributed.rs`; docs/DISTRIBUTED.md).

mod distributed;
mod gpt;
mod markov;
mod plot;
mod report;

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use amp::distributed::{DataParallel, Wire};
use amp::optim::{AdamConfig, FusedAdamW, FusedOptimizer, ParamGroups};
use amp::scaler::ScalerConfig;
use amp::{AmpConfig, AmpModuleExt, GradScaler, OptLevel, Precision};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;
use distributed::Group;
use gpt::{Gpt, GptShape};
use markov::{split, Markov, SUCCESSORS, VOCAB};
use rand::rngs::StdRng;
use rand::SeedableRng;

const EVAL_SEQS: usize = 64;
const SEED: u64 = 2026;

/// The model and batch the runs train, chosen with `--size`.
#[derive(Clone, Copy, Debug)]
struct Size {
    name: &'static str,
    shape: GptShape,
    batch: usize,
    steps: usize,
    lr: f64,
}

/// d_model 256, 4 layers, 128 positions, 8 sequences a step: matrix products are most of the work
/// (21 GFLOP a step, see `Size::flops_per_step`).
const DEFAULT: Size = Size {
    name: "default",
    shape: GptShape { vocab: VOCAB, embed: 256, heads: 4, layers: 4, seq: 128 },
    batch: 8,
    steps: 100,
    lr: 3e-3,
};

/// The earlier main job: d_model 64, 2 layers, 32 positions; seconds to run, dominated by overheads.
const TINY: Size = Size {
    name: "tiny",
    shape: GptShape { vocab: VOCAB, embed: 64, heads: 4, layers: 2, seq: 32 },
    batch: 16,
    steps: 300,
    lr: 1e-2,
};

impl Size {
    fn tokens(&self) -> usize {
        self.batch * self.shape.seq
    }

    /// Floating-point operations of one training step's matrix products: forward per token per layer
    /// `24 d^2` (q, k, v, out projections and a 4d MLP) plus `4 T d` (scores and mixing), plus the head's
    /// `2 d V`; backward twice the forward.
    fn flops_per_step(&self) -> f64 {
        let GptShape { vocab, embed: d, layers, seq, .. } = self.shape;
        let per_token = layers * (24 * d * d + 4 * seq * d) + 2 * d * vocab;
        3.0 * (per_token * self.tokens()) as f64
    }
}

/// fp32, bf16 and fp16 training of the same small transformer, compared (the main job).
#[derive(Debug, clap::Parser)]
#[command(name = "train")]
struct Args {
    /// Which runs, comma separated, from fp32,bf16,fp16. fp32 is O0; bf16 and fp16 use --opt-level;
    /// fp16 adds dynamic loss scaling
    #[arg(long = "precision", value_name = "LIST", value_delimiter = ',', default_value = "fp32,bf16,fp16",
          value_parser = parse_precision)]
    runs: Vec<Precision>,
    /// The level of the mixed (bf16, fp16) runs: O2 (fp32 masters + half copies) or O1 (fp32 params
    /// cast at use)
    #[arg(long, value_name = "LEVEL", default_value = "O2", value_parser = parse_mixed_level)]
    opt_level: OptLevel,
    /// The model: `default` (d_model 256, 4 layers, 128 positions, 8 sequences a step: 21 GFLOP a step,
    /// 100 steps, about a minute for all three runs on 2 cores) or `tiny` (d_model 64, 2 layers, 32
    /// positions: 300 steps, about 20 seconds)
    #[arg(long, value_name = "SIZE", default_value = "default", value_parser = parse_size)]
    size: Size,
    /// Optimizer steps per run (default: the size's), at least 20
    #[arg(long, value_name = "N", value_parser = parse_steps)]
    steps: Option<usize>,
    /// The device; only cpu in this build (CUDA needs the `cuda` feature, not built here)
    #[arg(long, default_value = "cpu", value_parser = ["cpu"])]
    device: String,
    /// Seeds: each its own initial weights, data order and held-out set (the task stays the same); with
    /// more than one, a final table gives each run's mean and spread across seeds, paired with fp32
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    seeds: u64,
    /// Where results.json, loss_curves.csv and loss_curves.png go
    #[arg(long, value_name = "DIR", default_value = "out")]
    out: PathBuf,
    /// Train as one rank of an MPI job, each rank on its share of every batch with the gradients
    /// averaged over the ranks: `mpirun -np 2 target/release/examples/train --data-parallel` (needs a
    /// build with `--features mpi`). Logs and files from rank 0 only
    #[arg(long)]
    data_parallel: bool,
    /// With --data-parallel, the dtype gradients travel in between ranks: f32 (exact), bf16 or f16 (half
    /// the bytes)
    #[arg(long, value_name = "DTYPE", default_value = "f32", value_parser = parse_wire, requires = "data_parallel")]
    wire: Wire,
    /// Run as a CPU with AVX2, FMA and F16C but no AVX-512 would: every product on amp's AVX2 kernel,
    /// amp's vector loops 8 floats wide (to see an AVX2-only CPU's ratios on a CPU with AVX-512)
    #[arg(long)]
    avx2_only: bool,
}

fn parse_precision(name: &str) -> Result<Precision, String> {
    name.parse().map_err(|e: amp::Error| e.to_string())
}

fn parse_mixed_level(level: &str) -> Result<OptLevel, String> {
    match level.parse().map_err(|e: amp::Error| e.to_string())? {
        level @ (OptLevel::O1 | OptLevel::O2) => Ok(level),
        other => Err(format!("{other}: the mixed runs take O1 or O2 (fp32 is O0)")),
    }
}

fn parse_size(name: &str) -> Result<Size, String> {
    match name {
        "default" => Ok(DEFAULT),
        "tiny" => Ok(TINY),
        other => Err(format!("{other}: expected default or tiny")),
    }
}

fn parse_wire(name: &str) -> Result<Wire, String> {
    match name {
        "f32" => Ok(Wire::F32),
        "bf16" => Ok(Wire::Bf16),
        "f16" => Ok(Wire::F16),
        other => Err(format!("{other}: expected f32, bf16 or f16")),
    }
}

fn parse_steps(steps: &str) -> Result<usize, String> {
    match steps.parse::<usize>().map_err(|e| e.to_string())? {
        n if n >= 20 => Ok(n),
        _ => Err("at least 20".into()),
    }
}

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

fn config_for(precision: Precision, opt_level: OptLevel) -> AmpConfig {
    match precision {
        Precision::Fp32 => AmpConfig { opt_level: OptLevel::O0, half: Precision::Bf16 },
        half => AmpConfig::new(opt_level, &Device::Cpu).with_half(half),
    }
}

fn run_name(precision: Precision, opt_level: OptLevel) -> String {
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
        let adam = AdamConfig { lr: size.lr, weight_decay: 0.01, ..AdamConfig::default() };
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
struct SeedData {
    batches: Vec<(Tensor, Tensor)>,
    eval: (Tensor, Tensor),
    oracle: f64,
}

impl SeedData {
    /// Draws `steps` batches and the held-out set from one stream seeded by `seed`.
    fn draw(
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
fn train_runs(
    args: &Args,
    weights: &HashMap<String, Tensor>,
    data: &SeedData,
    group: Option<Group<'_>>,
) -> Result<Vec<Run>, Box<dyn std::error::Error + Send + Sync>> {
    let size = args.size;
    let steps = data.batches.len();
    let mut trainers = args
        .runs
        .iter()
        .map(|p| {
            let (name, config) = (run_name(*p, args.opt_level), config_for(*p, args.opt_level));
            Trainer::new(size, name, weights, config, group)
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

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    // candle's elementwise ops on the calling thread: its own pool's idle workers spin on the cores
    // amp's GEMM needs (see `amp::threads`; 14-25% shorter steps for fp32, bf16 and fp16 alike). First
    // thing, before candle's first op; an explicit CANDLE_NUM_THREADS wins.
    let candle_threads = amp::threads::single_candle_thread();
    // Freed buffers stay in the process for the next step's ops (see `amp::memory`).
    amp::memory::retain_freed_memory();
    let mut args = <Args as clap::Parser>::parse();
    args.runs =
        args.runs.iter().enumerate().filter(|(i, p)| !args.runs[..*i].contains(p)).map(|(_, p)| *p).collect();
    if args.avx2_only {
        as_avx2_only()?;
    }
    if !args.data_parallel {
        // On a thread of rayon's pool, so that each step's parallel ops fork from there rather than
        // wake the pool from outside at every op (see `amp::threads`: steps about 5% shorter). A rank of
        // a data-parallel group stays on the thread that initialized MPI, which makes its collectives.
        return amp::threads::run_on_rayon_pool(|| train(&args, None, &candle_threads));
    }
    if !cfg!(feature = "mpi") {
        <Args as clap::CommandFactory>::command()
            .error(
                clap::error::ErrorKind::InvalidValue,
                "--data-parallel needs MPI, which this build does not have: build with `cargo build \
                 --release --features mpi --example train` (needs an MPI library and libclang; \
                 docs/DISTRIBUTED.md), then launch with `mpirun -np 2 target/release/examples/train \
                 --data-parallel`",
            )
            .exit();
    }
    distributed::launch(args.wire, args.size.batch, |group| train(&args, Some(group), &candle_threads))
}

/// The main job: on one process (`group` None), or as one rank of a data-parallel group, where only
/// rank 0 prints and writes.
fn train(
    args: &Args,
    group: Option<Group<'_>>,
    candle_threads: &amp::threads::CandleThreads,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let root = group.is_none_or(|g| g.rank() == 0);
    let device = Device::Cpu;
    let started = Instant::now();

    let source = Markov::generate(SEED);
    let floor = source.entropy_rate();
    let (_, best_accuracy) = source.best_guess();
    let (size, steps) = (args.size, args.steps.unwrap_or(args.size.steps));
    if root {
        header(args, &source, steps, group, candle_threads)?;
    }

    let mut seeds = Vec::new();
    let mut per_rank = Vec::new();
    for seed in 0..args.seeds {
        if args.seeds > 1 && root {
            println!("seed {seed} of {}: its own initial weights, data order and held-out set", args.seeds);
        }
        let data = SeedData::draw(&source, size, steps, seed, &device)?;
        let weights = Gpt::initial_weights(size.shape, seed, &device)?;
        let runs = train_runs(args, &weights, &data, group)?;
        if root {
            report::table(&runs, size.tokens(), floor, best_accuracy, data.oracle);
        }
        if let Some(group) = &group {
            let ranks = group.gather(&runs)?;
            if root {
                distributed::rank_table(group, &runs, &ranks, steps);
            }
            per_rank
                .push(serde_json::json!({ "seed": seed, "ranks": distributed::ranks_json(&runs, &ranks) }));
        }
        seeds.push(report::Seed { seed, runs, oracle: data.oracle });
    }
    if !root {
        return Ok(());
    }
    if seeds.len() > 1 {
        report::across_seeds(&seeds, floor);
    }

    std::fs::create_dir_all(&args.out)?;
    let (GptShape { embed, layers, heads, seq, .. }, batch) = (size.shape, size.batch);
    let data_parallel =
        group.map(|g| serde_json::json!({ "ranks": g.world(), "wire": g.wire(), "per_rank": per_rank }));
    let results = serde_json::json!({
        "task": { "vocab": VOCAB, "successors": SUCCESSORS, "entropy_floor": floor, "best_accuracy": best_accuracy },
        "size": size.name, "d_model": embed, "layers": layers, "heads": heads,
        "flops_per_step": size.flops_per_step(), "matmul_bf16": bf16_kernel(size, &device),
        "steps": steps, "batch": batch, "seq": seq, "lr": size.lr, "opt_level": args.opt_level.to_string(),
        "data_parallel": data_parallel, "avx2_only": args.avx2_only,
        "seeds": seeds.iter().map(|s| report::seed_json(s, size.tokens(), floor)).collect::<Vec<_>>(),
    });
    std::fs::write(args.out.join("results.json"), serde_json::to_string_pretty(&results)?)?;
    // The curves of the first seed.
    let runs = &seeds[0].runs;
    let mut csv = csv::Writer::from_path(args.out.join("loss_curves.csv"))?;
    csv.write_record(std::iter::once("step").chain(runs.iter().map(|r| r.name.as_str())))?;
    for i in 0..steps {
        let losses = runs.iter().map(|r| r.curve[i].1.to_string());
        csv.write_record(std::iter::once((i + 1).to_string()).chain(losses))?;
    }
    csv.flush()?;
    let curves: Vec<(&str, &[(usize, f32)])> =
        runs.iter().map(|r| (r.name.as_str(), r.curve.as_slice())).collect();
    plot::loss_curves(&args.out.join("loss_curves.png"), &curves, floor)?;
    println!(
        "wrote results.json, loss_curves.csv and loss_curves.png{} to {} ({:.0} s)",
        if seeds.len() > 1 { " (curves of seed 0)" } else { "" },
        args.out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Every product on amp's AVX2 kernel, amp's vector loops capped at AVX2 (`--avx2-only`).
fn as_avx2_only() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    if !amp_kernels::Isa::Avx2.is_supported() {
        return Err("--avx2-only: this CPU has no AVX2 (and FMA, F16C)".into());
    }
    amp::dispatch::set_override(amp::dispatch::Override::Path(amp::dispatch::GemmPath::Avx2))?;
    amp_kernels::vectorise::limit_width(Some(amp_kernels::Isa::Avx2));
    Ok(())
}

/// The kernel amp's dispatch picks for the size's bf16 MLP product.
fn bf16_kernel(size: Size, device: &Device) -> String {
    let dims = amp::dispatch::Dims::new(size.tokens(), 4 * size.shape.embed, size.shape.embed);
    amp::dispatch::explain(device, Precision::Bf16, dims).kernel.to_string()
}

/// What is trained and how: the task, the precision plan of the first mixed run, the model and the
/// schedule, which GEMM runs, and the data-parallel group.
fn header(
    args: &Args,
    source: &Markov,
    steps: usize,
    group: Option<Group<'_>>,
    candle_threads: &amp::threads::CandleThreads,
) -> amp::Result<()> {
    let device = Device::Cpu;
    let (_, best_accuracy) = source.best_guess();
    println!(
        "task: next token of a {VOCAB}-token Markov source ({SUCCESSORS} likely successors per token)\n  \
         entropy rate (the floor) {:.4} nats/token; uniform guess ln V = {:.4}; best accuracy {:.1}%",
        source.entropy_rate(),
        (VOCAB as f64).ln(),
        100.0 * best_accuracy
    );
    let size = args.size;
    if let Some(half) = args.runs.iter().find(|p| **p != Precision::Fp32) {
        let weights = Gpt::initial_weights(size.shape, 0, &device)?;
        let mut model = Gpt::new(size.shape, VarBuilder::from_tensors(weights, DType::F32, &device))?;
        amp::initialize(&mut model, config_for(*half, args.opt_level))?;
        println!(
            "\nprecision plan of the {} run:\n{}\n",
            run_name(*half, args.opt_level),
            model.precision_plan()
        );
    }
    let (GptShape { embed, layers, heads, seq, .. }, batch, lr) = (size.shape, size.batch, size.lr);
    println!(
        "size {}: d_model {embed}, {layers} layers, {heads} heads, {seq} positions; {steps} steps of {batch}x{seq} \
         tokens ({:.1} GFLOP of matrix products a step), AdamW lr {lr} (warm-up + cosine), clip 1.0",
        size.name,
        size.flops_per_step() / 1e9
    );
    let dims = amp::dispatch::Dims::new(batch * seq, 4 * embed, embed);
    let f32_path = amp::dispatch::explain(&device, Precision::Fp32, dims);
    println!("matrix products: fp32 on {}; bf16 and fp16 on {}", f32_path.kernel, bf16_kernel(size, &device));
    let allocator = if cfg!(feature = "mimalloc") { "mimalloc" } else { "the system's" };
    println!("allocator: {allocator}, freed memory kept for reuse (amp::memory::retain_freed_memory)");
    println!("threads: {candle_threads}");
    if let Some(group) = group {
        let world = group.world();
        println!(
            "data-parallel: {world} ranks, {} sequences each per step (rank r: rows [r*{batch}/{world}, \
             (r+1)*{batch}/{world}) of every batch), gradients averaged on the {} wire; {} rayon threads a rank",
            batch / world,
            group.wire(),
            rayon::current_num_threads()
        );
    }
    println!();
    Ok(())
}
