//! The training half of the GPU check (feature `cuda`; see scripts/gpu-check.sh): GEMM throughput per
//! precision through amp's `Linear`, a projection onto a 50257-word vocabulary with and without the
//! tensor-core padding policy, and a BERT-like encoder's training step under O2 fp16 against fp32
//! and TF32, each measured side by side in one run. Prints one table; skips cleanly without a device.
//!
//! NVIDIA's anchors for the encoder row: 4.48x over fp32 on V100, 1.83x over TF32 on A100.
//!
//! `cargo run --release --features cuda --example gpu_bench -- [--budget-s SECONDS]`

use std::time::{Duration, Instant};

use amp::nn::{layer_norm, linear, multi_head_attention, LayerNorm, Linear, MultiHeadAttention};
use amp::optim::{AdamConfig, FusedAdamW, ParamGroups};
use amp::scaler::ScalerConfig;
use amp::{AmpConfig, AmpModule, GradScaler, OptLevel, Precision};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};

/// BERT-base: 12 layers, d = 768, 12 heads, sequence 128, batch 32.
const LAYERS: usize = 12;
const D: usize = 768;
const HEADS: usize = 12;
const SEQ: usize = 128;
const BATCH: usize = 32;
/// GPT-2's vocabulary: not a multiple of 8.
const VOCAB: usize = 50257;

#[derive(AmpModule)]
struct Mlp {
    up: Linear,
    down: Linear,
}

#[derive(AmpModule)]
struct EncoderLayer {
    attn: MultiHeadAttention,
    #[amp(fp32)]
    ln1: LayerNorm,
    mlp: Mlp,
    #[amp(fp32)]
    ln2: LayerNorm,
}

#[derive(AmpModule)]
struct Encoder {
    layers: Vec<EncoderLayer>,
    head: Linear,
}

impl Encoder {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Self> {
        let layer = |i: usize| -> candle_core::Result<EncoderLayer> {
            let vb = vb.pp(format!("layers.{i}"));
            Ok(EncoderLayer {
                attn: multi_head_attention(D, HEADS, vb.pp("attn"))?,
                ln1: layer_norm(D, 1e-12, vb.pp("ln1"))?,
                mlp: Mlp { up: linear(D, 4 * D, vb.pp("up"))?, down: linear(4 * D, D, vb.pp("down"))? },
                ln2: layer_norm(D, 1e-12, vb.pp("ln2"))?,
            })
        };
        Ok(Encoder {
            layers: (0..LAYERS).map(layer).collect::<Result<_, _>>()?,
            head: linear(D, 2, vb.pp("head"))?,
        })
    }

    /// Post-norm BERT layers, then a 2-way head on every position.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = x.clone();
        for layer in &self.layers {
            x = layer.ln1.forward(&(&x + layer.attn.forward(&x)?)?)?;
            let hidden = layer.mlp.up.forward(&x)?.gelu()?;
            x = layer.ln2.forward(&(&x + layer.mlp.down.forward(&hidden)?)?)?;
        }
        self.head.forward(&x)
    }
}

/// The GPU check's measurements (`scripts/gpu-check.sh run` starts it).
#[derive(Debug, clap::Parser)]
#[command(name = "gpu_bench")]
struct Args {
    /// Seconds the whole bench may take; items that would not fit are skipped
    #[arg(long = "budget-s", value_name = "SECONDS", default_value_t = 300.0, value_parser = parse_budget)]
    budget_s: f64,
}

fn parse_budget(seconds: &str) -> Result<f64, String> {
    match seconds.parse::<f64>().map_err(|e| e.to_string())? {
        s if s.is_finite() && s >= 0.0 => Ok(s),
        _ => Err("a number of seconds, 0 or more".into()),
    }
}

fn budget() -> Duration {
    Duration::from_secs_f64(<Args as clap::Parser>::parse().budget_s)
}

fn row(item: &str, result: &str) {
    println!("| {item:<44} | {result:<60} |");
}

/// TFLOP/s of an n x n x n product through a `Linear` computing in `precision`.
fn gemm(device: &Device, precision: Precision, tf32: bool, n: usize) -> amp::Result<f64> {
    candle_core::cuda::set_gemm_reduced_precision_f32(tf32);
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, device);
    let mut layer = vec![linear(n, n, vb.pp("fc"))?];
    let level = if precision == Precision::Fp32 { OptLevel::O0 } else { OptLevel::O2 };
    amp::initialize(
        &mut layer,
        AmpConfig { opt_level: level, half: if level == OptLevel::O0 { Precision::Bf16 } else { precision } },
    )?;
    let x = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(precision.dtype())?;
    let seconds = seconds_per_call(device, || {
        layer[0].forward(&x)?;
        Ok(())
    });
    candle_core::cuda::set_gemm_reduced_precision_f32(false);
    Ok(2.0 * (n as f64).powi(3) / seconds? / 1e12)
}

/// Seconds per call of `run` on `device`, the mean of 10 after one to warm up.
fn seconds_per_call(device: &Device, mut run: impl FnMut() -> amp::Result<()>) -> amp::Result<f64> {
    run()?;
    device.synchronize()?;
    let iterations = 10;
    let start = Instant::now();
    for _ in 0..iterations {
        run()?;
    }
    device.synchronize()?;
    Ok(start.elapsed().as_secs_f64() / f64::from(iterations))
}

/// Seconds per forward and backward of a bf16 projection onto GPT-2's vocabulary, `(tokens, D)` times
/// `(D, 50257)`, with the padding policy on or off (n padded to 50264 when on).
fn vocab_projection(device: &Device, pad: bool, tokens: usize) -> amp::Result<f64> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, device);
    let mut layer = vec![linear(D, VOCAB, vb.pp("head"))?];
    amp::initialize(&mut layer, AmpConfig { opt_level: OptLevel::O2, half: Precision::Bf16 })?;
    let x = candle_core::Var::from_tensor(
        &Tensor::randn(0f32, 1.0, (tokens, D), device)?.to_dtype(DType::BF16)?,
    )?;
    let before = amp::dispatch::pad_for_tensor_cores(pad);
    let seconds = seconds_per_call(device, || {
        layer[0].forward(&x)?.to_dtype(DType::F32)?.sum_all()?.backward()?;
        Ok(())
    });
    amp::dispatch::pad_for_tensor_cores(before);
    seconds
}

/// How the scaler's verdict reaches the optimizer.
#[derive(Clone, Copy, PartialEq)]
enum Verdict {
    /// `step_fused_deferred`: on the device, read once after the timed steps.
    Deferred,
    /// `step_fused`: read back by the host every step.
    EveryStep,
}

/// Seconds per training step of the encoder at `level` (fp16 halves under O2).
fn encoder_step(
    device: &Device,
    level: OptLevel,
    tf32: bool,
    verdict: Verdict,
    steps: usize,
) -> amp::Result<f64> {
    candle_core::cuda::set_gemm_reduced_precision_f32(tf32);
    let varmap = VarMap::new();
    let mut model = Encoder::new(VarBuilder::from_varmap(&varmap, DType::F32, device))?;
    amp::initialize(&mut model, AmpConfig { opt_level: level, half: Precision::Fp16 })?;
    let mut optimizer = FusedAdamW::new(ParamGroups::from_model(&model)?, AdamConfig::default())?;
    let mut scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
    let x = Tensor::randn(0f32, 1.0, (BATCH, SEQ, D), device)?;
    let target = Tensor::zeros((BATCH, SEQ, 2), DType::F32, device)?;
    let mut step = || -> amp::Result<()> {
        let out = model.forward(&x)?.to_dtype(DType::F32)?;
        let loss = (out - &target)?.sqr()?.mean_all()?;
        match verdict {
            Verdict::Deferred => scaler.step_fused_deferred(&loss, &mut optimizer, None),
            Verdict::EveryStep => scaler.step_fused(&loss, &mut optimizer, None).map(|_| ()),
        }
    };
    step()?;
    device.synchronize()?;
    let start = Instant::now();
    for _ in 0..steps {
        step()?;
    }
    device.synchronize()?;
    let seconds = start.elapsed().as_secs_f64() / steps as f64;
    scaler.settle()?;
    candle_core::cuda::set_gemm_reduced_precision_f32(false);
    Ok(seconds)
}

fn main() -> amp::Result<()> {
    let start = Instant::now();
    let budget = budget();
    if !amp::cuda::is_available() {
        println!("skipped: no CUDA device");
        return Ok(());
    }
    let device = Device::new_cuda(0)?;
    let gpu = amp::cuda::prepare(&device)?;
    println!(
        "# amp GPU training check: {} (sm_{}{})",
        gpu.name, gpu.compute_capability.0, gpu.compute_capability.1
    );
    println!();
    println!("| {:<44} | {:<60} |", "item", "result");
    println!("|{}|{}|", "-".repeat(46), "-".repeat(62));

    let n = 8192;
    let bf16 = gemm(&device, Precision::Bf16, false, n)?;
    row(&format!("GEMM {n}^3 bf16 (the measured peak)"), &format!("{bf16:.0} TFLOP/s"));
    for (name, precision, tf32) in [
        ("fp16", Precision::Fp16, false),
        ("fp32, TF32 tensor cores", Precision::Fp32, true),
        ("fp32", Precision::Fp32, false),
    ] {
        let tflops = gemm(&device, precision, tf32, n)?;
        row(
            &format!("GEMM {n}^3 {name}"),
            &format!("{tflops:.0} TFLOP/s = {:.0} % of bf16", 100.0 * tflops / bf16),
        );
    }

    let tokens = BATCH * SEQ;
    let unpadded = vocab_projection(&device, false, tokens)?;
    let padded = vocab_projection(&device, true, tokens)?;
    row(
        &format!("bf16 ({tokens}, {D}) x ({D}, {VOCAB}) fwd + bwd"),
        &format!(
            "{:.2} ms; padded to {} (pad_for_tensor_cores) {:.2} ms: {:.2}x",
            1e3 * unpadded,
            VOCAB.next_multiple_of(8),
            1e3 * padded,
            unpadded / padded
        ),
    );

    if start.elapsed() > budget {
        row("BERT-like encoder step", "skipped: time budget spent");
        return Ok(());
    }
    let steps = 10;
    let fp16 = encoder_step(&device, OptLevel::O2, false, Verdict::Deferred, steps)?;
    let synced = encoder_step(&device, OptLevel::O2, false, Verdict::EveryStep, steps)?;
    let tf32 = encoder_step(&device, OptLevel::O0, true, Verdict::Deferred, steps)?;
    let fp32 = encoder_step(&device, OptLevel::O0, false, Verdict::Deferred, steps)?;
    let name = format!("BERT-base-like step, batch {BATCH} x {SEQ}");
    row(&format!("{name}, O2 fp16"), &format!("{:.1} ms (deferred steps, no wait)", 1e3 * fp16));
    row(
        &format!("{name}, O2 fp16, step_fused"),
        &format!(
            "{:.1} ms: a read-back per step costs {:+.1} %",
            1e3 * synced,
            100.0 * (synced / fp16 - 1.0)
        ),
    );
    row(
        &format!("{name}, O0 TF32"),
        &format!("{:.1} ms; O2 fp16 is {:.2}x faster (A100 anchor 1.83x)", 1e3 * tf32, tf32 / fp16),
    );
    row(
        &format!("{name}, O0 fp32"),
        &format!("{:.1} ms; O2 fp16 is {:.2}x faster (V100 anchor 4.48x)", 1e3 * fp32, fp32 / fp16),
    );
    println!();
    println!("{} s in all", start.elapsed().as_secs());
    Ok(())
}
