//! A full training step of the MLP of `performance-baselines.md` (4 x Linear(1024, 1024) with ReLU,
//! batch 256, MSE loss, fused AdamW through `GradScaler::step_fused`), fp32 against bf16 and fp16 O2,
//! measured side by side in one run.
//!
//! The fp32 baseline is the faster of candle's matmul and amp's f32 GEMM (both are timed); the mixed
//! runs use amp's dispatch (AMX or `vdpbf16ps` for bf16 where the CPU has them). The hidden layers'
//! ReLU is fused into the layer's op (`Linear::forward_relu`) in every run. Every run steps in turn (A,
//! B, C, ... per round) on a 2-thread rayon pool, two steps a turn of which the second is timed: a step
//! that follows a step of the same model, as in training, rather than one that starts with caches
//! full of another model's buffers (measured: the first step after another run's is 10-25% slower, and
//! bf16's the most). Medians.
//!
//! On a CPU with AVX-512, the runs are repeated as an AVX2-only CPU would run them (products on amp's
//! AVX2 kernel, amp's vector loops 8 floats wide: [`amp::dispatch::Override::Path`] and
//! `amp_kernels::vectorise::limit_width`), for the AVX2 goal, measured on the same machine.
//!
//! One more run takes the bf16 O2 step's batch as 4 micro-batches of 64 rows accumulated in f32
//! (`GradScaler::accumulate`, then `step_fused_accumulated`): what gradient accumulation costs against
//! the one-batch step (the products of 64 rows, and one f32 add per parameter per micro-batch).
//!
//! Run: `cargo bench --bench mlp_step` (about a minute; two on a CPU with AVX-512).

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::time::Instant;

use amp::dispatch::{self, GemmPath, Override};
use amp::nn::{linear, Linear};
use amp::optim::{AdamConfig, FusedAdamW, ParamGroups};
use amp::scaler::{GradAccumulator, ScalerConfig};
use amp::{AmpConfig, AmpModule, GradScaler, OptLevel, Precision};
use amp_kernels::{vectorise, Isa};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};

const WIDTH: usize = 1024;
const BATCH: usize = 256;
const ROUNDS: usize = 15;

#[derive(AmpModule)]
struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // ReLU after every layer but the last, fused into the layer's op (`Linear::forward_relu`).
        let (last, hidden) = self.layers.split_last().expect("layers");
        let mut h = x.clone();
        for layer in hidden {
            h = layer.forward_relu(&h)?;
        }
        last.forward(&h)
    }
}

struct Run {
    name: &'static str,
    over: Override,
    /// The widest vector extension amp's loops may use (`None`: the CPU's).
    width: Option<Isa>,
    model: Mlp,
    optimizer: FusedAdamW,
    scaler: GradScaler,
    /// Micro-batches the batch is split into and accumulated (1: one step of the whole batch).
    micro_batches: usize,
    accumulator: GradAccumulator,
    times: Vec<f64>,
}

fn run(name: &'static str, config: AmpConfig, (over, width): (Override, Option<Isa>)) -> amp::Result<Run> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let layers =
        (0..4).map(|i| linear(WIDTH, WIDTH, vb.pp(format!("l{i}")))).collect::<candle_core::Result<_>>()?;
    let mut model = Mlp { layers };
    amp::initialize(&mut model, config)?;
    let optimizer =
        FusedAdamW::new(ParamGroups::from_model(&model)?, AdamConfig { lr: 1e-4, ..AdamConfig::default() })?;
    let scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
    let (micro_batches, accumulator) = (1, GradAccumulator::new());
    Ok(Run { name, over, width, model, optimizer, scaler, micro_batches, accumulator, times: Vec::new() })
}

impl Run {
    fn step(&mut self, x: &Tensor, y: &Tensor) -> amp::Result<f64> {
        let widest = vectorise::limit_width(self.width);
        let start = Instant::now();
        let (model, optimizer, scaler) = (&self.model, &mut self.optimizer, &mut self.scaler);
        let (micro_batches, accumulator) = (self.micro_batches, &mut self.accumulator);
        let stepped = dispatch::with_override(self.over, || -> amp::Result<()> {
            if micro_batches == 1 {
                let loss = amp::ops::loss::mse(&model.forward(x)?, y)?;
                scaler.step_fused(&loss, optimizer, None)?;
                return Ok(());
            }
            let rows = BATCH / micro_batches;
            for part in 0..micro_batches {
                let (x, y) = (x.narrow(0, part * rows, rows)?, y.narrow(0, part * rows, rows)?);
                let loss = (amp::ops::loss::mse(&model.forward(&x)?, &y)? / micro_batches as f64)?;
                scaler.accumulate(model, &loss, accumulator)?;
            }
            scaler.step_fused_accumulated(accumulator, optimizer, None)?;
            Ok(())
        });
        let seconds = start.elapsed().as_secs_f64();
        vectorise::limit_width(widest);
        stepped??;
        Ok(seconds)
    }
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

fn main() -> amp::Result<()> {
    // Freed buffers stay in the process (without it every step faults its buffers in afresh): the
    // setting a CPU training binary wants; see `amp::memory`.
    let retained = amp::memory::retain_freed_memory();
    println!("freed memory retained by the allocator: {retained}");
    // On amp's pool, as a training loop runs (`amp::threads::run_on_rayon_pool`): one thread a core
    // (`RAYON_NUM_THREADS` to change it), the others looking for work between the ops.
    amp::threads::run_on_rayon_pool(bench)
}

fn bench() -> amp::Result<()> {
    let dev = Device::Cpu;
    let fp32 = AmpConfig { opt_level: OptLevel::O0, half: Precision::Bf16 };
    let mixed = |half| AmpConfig::new(OptLevel::O2, &dev).with_half(half);
    let (native, avx2) = ((Override::Auto, None), (Override::Path(GemmPath::Avx2), Some(Isa::Avx2)));
    let mut runs = vec![
        run("fp32, candle matmul", fp32, (Override::Candle, None))?,
        run("fp32, amp gemm", fp32, native)?,
        run("bf16 O2", mixed(Precision::Bf16), native)?,
        run("fp16 O2", mixed(Precision::Fp16), native)?,
    ];
    // As an AVX2-only CPU runs them (candle's kernels choose their own paths: its f32 GEMM uses AVX2
    // and FMA without its `x86-v4` feature, as here).
    let emulated = Isa::Avx512.is_supported();
    if emulated {
        runs.push(run("fp32, amp gemm, avx2", fp32, avx2)?);
        runs.push(run("bf16 O2, avx2", mixed(Precision::Bf16), avx2)?);
        runs.push(run("fp16 O2, avx2", mixed(Precision::Fp16), avx2)?);
    }
    let accumulated = runs.len();
    runs.push(Run { micro_batches: 4, ..run("bf16 O2, 4 x 64 rows", mixed(Precision::Bf16), native)? });
    let x = Tensor::randn(0f32, 1.0, (BATCH, WIDTH), &dev)?;
    let y = Tensor::randn(0f32, 1.0, (BATCH, WIDTH), &dev)?;
    for r in &mut runs {
        r.step(&x, &y)?; // warm-up
    }
    for _ in 0..ROUNDS {
        for r in &mut runs {
            r.step(&x, &y)?; // settles the caches on this run's model
            let t = r.step(&x, &y)?;
            r.times.push(t);
        }
    }
    let bf16 = dispatch::explain(&dev, Precision::Bf16, dispatch::Dims::new(BATCH, WIDTH, WIDTH));
    println!("MLP step: 4 x Linear({WIDTH}, {WIDTH}) + ReLU, batch {BATCH}, MSE, fused AdamW; {} threads, {ROUNDS} rounds", rayon::current_num_threads());
    println!("bf16 products: {bf16}");
    let ms = |i: usize| median(&runs[i].times);
    // The fp32 baseline: the faster of candle's matmul and amp's f32 GEMM on the same CPU (features).
    let fp32_best = ms(0).min(ms(1));
    let fp32_avx2 = if emulated { ms(0).min(ms(4)) } else { fp32_best };
    println!("{:<22} {:>9} {:>16}", "run", "median ms", "of fp32 (best)");
    for (i, r) in runs.iter().enumerate() {
        let baseline = if (4..accumulated).contains(&i) { fp32_avx2 } else { fp32_best };
        println!("{:<22} {:>9.2} {:>15.2}x", r.name, ms(i) * 1e3, ms(i) / baseline);
    }
    let goal = if GemmPath::Avx512Bf16.is_supported() { 0.4 } else { 1.0 };
    println!("goal (issue #12): bf16 O2 step <= {goal}x of the fp32 step: {:.2}x", ms(2) / fp32_best);
    if emulated {
        println!("goal (issue #12) as an AVX2-only CPU: bf16 O2 <= 1.0x of fp32: {:.2}x", ms(5) / fp32_avx2);
    }
    println!(
        "gradient accumulation: the bf16 O2 step as 4 micro-batches of 64 rows takes {:.2}x the one-batch step",
        ms(accumulated) / ms(2)
    );
    Ok(())
}
