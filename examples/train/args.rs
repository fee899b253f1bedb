//! The main job's command line and the model sizes it picks from.

use std::path::PathBuf;

use amp::distributed::Wire;
use amp::optim::StateDtype;
use amp::{OptLevel, Precision};

use crate::gpt::GptShape;
use crate::markov::VOCAB;

/// The model and batch the runs train, chosen with `--size`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Size {
    pub(crate) name: &'static str,
    pub(crate) shape: GptShape,
    pub(crate) batch: usize,
    pub(crate) steps: usize,
    pub(crate) lr: f64,
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

/// Twice the default's width: d_model 512 in 8 heads, 4 layers, 128 positions, 8 sequences a step
/// (80 GFLOP a step): the products a larger share of the step.
const WIDE: Size = Size {
    name: "wide",
    shape: GptShape { vocab: VOCAB, embed: 512, heads: 8, layers: 4, seq: 128 },
    batch: 8,
    steps: 100,
    lr: 2e-3,
};

impl Size {
    pub(crate) fn tokens(&self) -> usize {
        self.batch * self.shape.seq
    }

    /// Floating-point operations of one training step's matrix products: forward per token per layer
    /// `24 d^2` (q, k, v, out projections and a 4d MLP) plus `4 T d` (scores and mixing), plus the head's
    /// `2 d V`; backward twice the forward.
    pub(crate) fn flops_per_step(&self) -> f64 {
        let GptShape { vocab, embed: d, layers, seq, .. } = self.shape;
        let per_token = layers * (24 * d * d + 4 * seq * d) + 2 * d * vocab;
        3.0 * (per_token * self.tokens()) as f64
    }
}

/// fp32, bf16 and fp16 training of the same small transformer, compared (the main job).
#[derive(Debug, clap::Parser)]
#[command(name = "train")]
pub(crate) struct Args {
    /// Which runs, comma separated, from fp32,bf16,fp16. fp32 is O0; bf16 and fp16 use --opt-level;
    /// fp16 adds dynamic loss scaling
    #[arg(long = "precision", value_name = "LIST", value_delimiter = ',', default_value = "fp32,bf16,fp16",
          value_parser = parse_precision)]
    pub(crate) runs: Vec<Precision>,
    /// The level of the mixed (bf16, fp16) runs: O2 (fp32 masters + half copies) or O1 (fp32 params
    /// cast at use)
    #[arg(long, value_name = "LEVEL", default_value = "O2", value_parser = parse_mixed_level)]
    pub(crate) opt_level: OptLevel,
    /// The model: `default` (d_model 256, 4 layers, 128 positions, 8 sequences a step: 21 GFLOP a step,
    /// 100 steps, about a minute for all three runs on 2 cores), `wide` (d_model 512 in 8 heads, the
    /// rest as the default: 80 GFLOP a step, about a minute and a half with AMX, more without) or
    /// `tiny` (d_model 64, 2 layers, 32 positions: 300 steps, about 20 seconds)
    #[arg(long, value_name = "SIZE", default_value = "default", value_parser = parse_size)]
    pub(crate) size: Size,
    /// Optimizer steps per run (default: the size's), at least 20
    #[arg(long, value_name = "N", value_parser = parse_steps)]
    pub(crate) steps: Option<usize>,
    /// The device; only cpu in this build (CUDA needs the `cuda` feature, not built here)
    #[arg(long, default_value = "cpu", value_parser = ["cpu"])]
    pub(crate) device: String,
    /// Seeds: each its own initial weights, data order and held-out set (the task stays the same); with
    /// more than one, a final table gives each run's mean and spread across seeds, paired with fp32
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) seeds: u64,
    /// Where results.json, loss_curves.csv and loss_curves.png go
    #[arg(long, value_name = "DIR", default_value = "out")]
    pub(crate) out: PathBuf,
    /// Train as one rank of an MPI job, each rank on its share of every batch with the gradients
    /// averaged over the ranks: `mpirun -np 2 target/release/examples/train --data-parallel` (needs a
    /// build with `--features mpi`). Logs and files from rank 0 only
    #[arg(long)]
    pub(crate) data_parallel: bool,
    /// With --data-parallel, the dtype gradients travel in between ranks: f32 (exact), bf16 or f16 (half
    /// the bytes)
    #[arg(long, value_name = "DTYPE", default_value = "f32", value_parser = parse_wire, requires = "data_parallel")]
    pub(crate) wire: Wire,
    /// The dtype of AdamW's moments in every run: f32 (8 bytes of state per parameter) or bf16 (4 bytes,
    /// rounded stochastically: `amp::optim::StateDtype`)
    #[arg(long, value_name = "DTYPE", default_value = "f32", value_parser = parse_state_dtype)]
    pub(crate) optimizer_state: StateDtype,
    /// Run as a CPU with AVX2, FMA and F16C but no AVX-512 would: every product on amp's AVX2 kernel,
    /// amp's vector loops 8 floats wide (to see an AVX2-only CPU's ratios on a CPU with AVX-512)
    #[arg(long)]
    pub(crate) avx2_only: bool,
}

fn parse_precision(name: &str) -> Result<Precision, String> {
    name.parse().map_err(|e: amp::Error| e.to_string())
}

fn parse_state_dtype(name: &str) -> Result<StateDtype, String> {
    match name {
        "f32" => Ok(StateDtype::F32),
        "bf16" => Ok(StateDtype::Bf16),
        other => Err(format!("{other}: expected f32 or bf16")),
    }
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
        "wide" => Ok(WIDE),
        other => Err(format!("{other}: expected default, wide or tiny")),
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
