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
//! by step: about a minute on 2 cores), `-- --size tiny` for the small model, `-- --size wide` for
//! twice the default's width, or e.g.
//! `cargo run --release --example train -- --precision fp32,fp16 --opt-level O1 --steps 200 --out out/`.
//! `--help` lists every flag.
//!
//! Data-parallel (built with `--features mpi`): `mpirun -np 2 target/release/examples/train --data-parallel`
//! trains the same runs with each rank on its share of every batch, the gradients averaged over the
//! ranks (`distributed.rs`; docs/DISTRIBUTED.md).

mod args;
mod distributed;
mod gpt;
mod markov;
mod plot;
mod report;
mod trainer;

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use amp::{AmpModuleExt, Precision};
use candle_core::{DType, Device};
use candle_nn::VarBuilder;

use args::{Args, Size};
use distributed::Group;
use gpt::{Gpt, GptShape};
use markov::{Markov, SUCCESSORS, VOCAB};
pub use trainer::Run;
use trainer::{config_for, run_name, train_runs, SeedData};

/// The seed of the Markov source, and the base of each seed's data stream.
const SEED: u64 = 2026;

/// Whatever stops the main job, printed as `error: ...` (its message, not its `Debug` form).
pub(crate) type Error = Box<dyn std::error::Error + Send + Sync>;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Error> {
    // candle's pool parks its idle workers after a few spins instead of a millisecond's, during which
    // they held the cores amp's GEMM needs (see `amp::threads`: steps 3-6% shorter than with candle's
    // ops on this thread alone, 14-25% than with its default pool). First thing, before candle's first
    // op; an explicit CANDLE_BARRIER_POOL_SPIN_LIMIT wins.
    let candle_threads = amp::threads::candle_pool_that_parks();
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
) -> Result<(), Error> {
    let root = group.is_none_or(|g| g.rank() == 0);
    if root {
        prepare_out(&args.out)?;
    }
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

    let (GptShape { embed, layers, heads, seq, .. }, batch) = (size.shape, size.batch);
    let data_parallel =
        group.map(|g| serde_json::json!({ "ranks": g.world(), "wire": g.wire(), "per_rank": per_rank }));
    let results = serde_json::json!({
        "task": { "vocab": VOCAB, "successors": SUCCESSORS, "entropy_floor": floor, "best_accuracy": best_accuracy },
        "size": size.name, "d_model": embed, "layers": layers, "heads": heads,
        "flops_per_step": size.flops_per_step(), "matmul_bf16": bf16_kernel(size, &device).kernel.to_string(),
        "steps": steps, "batch": batch, "seq": seq, "lr": size.lr, "opt_level": args.opt_level.to_string(),
        "data_parallel": data_parallel, "avx2_only": args.avx2_only,
        "optimizer_state": format!("{:?}", args.optimizer_state),
        "seeds": seeds.iter().map(|s| report::seed_json(s, size.tokens(), floor)).collect::<Vec<_>>(),
    });
    let path = args.out.join("results.json");
    std::fs::write(&path, serde_json::to_string_pretty(&results)?).map_err(writing(&path))?;
    // The curves of the first seed.
    let runs = &seeds[0].runs;
    let path = args.out.join("loss_curves.csv");
    let write_csv = || -> Result<(), csv::Error> {
        let mut csv = csv::Writer::from_path(&path)?;
        csv.write_record(std::iter::once("step").chain(runs.iter().map(|r| r.name.as_str())))?;
        for i in 0..steps {
            let losses = runs.iter().map(|r| r.curve[i].1.to_string());
            csv.write_record(std::iter::once((i + 1).to_string()).chain(losses))?;
        }
        Ok(csv.flush()?)
    };
    write_csv().map_err(writing(&path))?;
    let curves: Vec<(&str, &[(usize, f32)])> =
        runs.iter().map(|r| (r.name.as_str(), r.curve.as_slice())).collect();
    let path = args.out.join("loss_curves.png");
    plot::loss_curves(&path, &curves, floor).map_err(writing(&path))?;
    println!(
        "wrote results.json, loss_curves.csv and loss_curves.png{} to {} ({:.0} s)",
        if seeds.len() > 1 { " (curves of seed 0)" } else { "" },
        args.out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Creates the output folder (and its parents) and checks that files can be written there, before any
/// training: a bad `--out` then fails at once instead of after the runs, whose results it would lose.
fn prepare_out(dir: &Path) -> Result<(), Error> {
    let problem = |what: &str, e: std::io::Error| format!("--out {}: {what}: {e}", dir.display());
    std::fs::create_dir_all(dir).map_err(|e| problem("cannot create the folder", e))?;
    let probe = dir.join(".amp-write-check");
    std::fs::write(&probe, b"")
        .and_then(|()| std::fs::remove_file(&probe))
        .map_err(|e| problem("cannot write files there", e))?;
    Ok(())
}

/// The error of writing `path`, naming it.
fn writing<E: std::fmt::Display>(path: &Path) -> impl FnOnce(E) -> Error + '_ {
    move |e| format!("writing {}: {e}", path.display()).into()
}

/// Every product on amp's AVX2 kernel, amp's vector loops capped at AVX2 (`--avx2-only`).
fn as_avx2_only() -> Result<(), Error> {
    if !amp_kernels::Isa::Avx2.is_supported() {
        return Err("--avx2-only: this CPU has no AVX2 (and FMA, F16C)".into());
    }
    amp::dispatch::set_override(amp::dispatch::Override::Path(amp::dispatch::GemmPath::Avx2))?;
    amp_kernels::vectorise::limit_width(Some(amp_kernels::Isa::Avx2));
    Ok(())
}

/// The kernel amp's dispatch picks for the size's bf16 MLP product.
fn bf16_kernel(size: Size, device: &Device) -> amp::dispatch::Choice {
    let dims = amp::dispatch::Dims::new(size.tokens(), 4 * size.shape.embed, size.shape.embed);
    amp::dispatch::explain(device, Precision::Bf16, dims)
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
    let bf16 = bf16_kernel(size, &device);
    println!("matrix products: fp32 on {}; bf16 and fp16 on {}", f32_path.kernel, bf16.kernel);
    if bf16.kernel == f32_path.kernel {
        // No faster bf16 product on this CPU: say so before the speed-up column does.
        println!(
            "  bf16: {}; so bf16 multiplies no faster than fp32 here (expect about fp32's speed; bf16 is \
             faster on AMX or on a vdpbf16ps that outruns the FMA)",
            bf16.reason
        );
    }
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
