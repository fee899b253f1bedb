//! Layers and ops amp computes in one pass each way, against candle's, forward and backward, measured
//! side by side in one run: `LayerNorm` and `RmsNorm` over (4096, 1024) (a transformer's tokens),
//! `GroupNorm` with 32 groups over (8, 256, 32, 32) and `BatchNorm` in training over (32, 64, 32, 32)
//! (a convnet's maps), SiLU over (4096, 2816) (a SwiGLU block's gate, f32 and bf16) and rotary
//! embeddings over (8, 12, 512, 64) (queries of BERT-base's shape, f32 and bf16), and max and
//! average pooling 2 x 2 at stride 2 over (8, 64, 112, 112) (the windows candle can differentiate:
//! its backward refuses any other; f32, and max in bf16).
//!
//! candle's contender is `candle_nn`'s layer where it has a backward (`GroupNorm`, `BatchNorm`),
//! `Tensor::silu`, candle-nn's differentiable `rope_slow` for the rotation (its `rope` kernel has no
//! backward), and the same formula written with candle's tensor ops where candle-nn's norm runs a fused
//! kernel without one (`LayerNorm`, `RmsNorm`: their gradients would be missing). The input is a
//! variable, the parameters too, and each step is `sum(y * r).backward()` with a fixed random `r`, so
//! the backward computes every gradient. The contenders run in turn per round
//! (`amp_kernels::timing`) on a 2-thread rayon pool; medians.
//!
//! Run: `cargo bench --bench ops_step` (about 30 s once built).

use amp::nn::{BatchNorm, BatchNormConfig, GroupNorm, LayerNorm, RmsNorm};
use amp::Param;
use amp_kernels::timing::Interleaved;
use candle_core::{DType, Device, Module, Result, Tensor, Var, D};
use candle_nn::ModuleT;

const ROUNDS: usize = 15;
const EPS: f64 = 1e-5;

/// One step of a contender: the forward pass on `x` and the backward of `sum(y * r)`.
type Step = Box<dyn Fn() -> Result<()>>;

/// A case of the sweep: its name, and amp's and candle's steps.
struct Case {
    name: &'static str,
    amp: Step,
    candle: Step,
}

/// `f(x)` then the backward of `sum(f(x) * r)`, the loss in f32 (`r` is f32; a half `y` is widened
/// first: candle's own half products and sums would cost more than the ops measured).
fn step(x: &Var, r: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor> + 'static) -> Step {
    let (x, r) = (x.clone(), r.clone());
    Box::new(move || {
        let y = f(x.as_tensor())?.contiguous()?.to_dtype(DType::F32)?;
        (y * &r)?.sum_all()?.backward()?;
        Ok(())
    })
}

fn variable(dims: &[usize], mean: f32, std: f32) -> Result<Var> {
    Var::from_tensor(&Tensor::randn(mean, std, dims, &Device::Cpu)?)
}

/// An input variable in `dtype` and the fixed f32 `r`.
fn input_in(dims: &[usize], dtype: DType) -> Result<(Var, Tensor)> {
    let x = Var::from_tensor(&Tensor::randn(0f32, 2.0, dims, &Device::Cpu)?.to_dtype(dtype)?)?;
    Ok((x, Tensor::randn(0f32, 1.0, dims, &Device::Cpu)?))
}

/// SiLU over (4096, 2816) and rotary embeddings over (8, 12, 512, 64), f32 and bf16.
fn pointwise() -> Result<Vec<Case>> {
    let mut cases = Vec::new();
    let (cos, sin) = amp::ops::rope_tables(512, 64, 10_000.0, &Device::Cpu)?;
    for (dtype, silu_name, rope_name) in [
        (DType::F32, "SiLU (4096, 2816)", "RoPE (8, 12, 512, 64)"),
        (DType::BF16, "SiLU (4096, 2816) bf16", "RoPE (8, 12, 512, 64) bf16"),
    ] {
        let (x, r) = input_in(&[4096, 2816], dtype)?;
        cases.push(Case {
            name: silu_name,
            amp: step(&x, &r, amp::ops::silu),
            candle: step(&x, &r, |x| x.silu()),
        });
        let (x, r) = input_in(&[8, 12, 512, 64], dtype)?;
        let (c, s) = (cos.clone(), sin.clone());
        let (ch, sh) = (cos.to_dtype(dtype)?, sin.to_dtype(dtype)?);
        cases.push(Case {
            name: rope_name,
            amp: step(&x, &r, move |x| amp::ops::rope(x, &c, &s)),
            candle: step(&x, &r, move |x| candle_nn::rotary_emb::rope_slow(x, &ch, &sh)),
        });
    }
    Ok(cases)
}

/// Layer and RMS norm over the last dimension of (4096, 1024).
fn row_norms() -> Result<[Case; 2]> {
    let dims = [4096, 1024];
    let (x, r) = (variable(&dims, 0.5, 2.0)?, Tensor::randn(0f32, 1.0, &dims[..], &Device::Cpu)?);
    let (w, b) = (variable(&[1024], 1.0, 0.2)?, variable(&[1024], 0.0, 0.2)?);
    let layer = LayerNorm::new(Param::new(w.clone()), Some(Param::new(b.clone())), EPS);
    let (wc, bc) = (w.as_tensor().clone(), b.as_tensor().clone());
    let layer_ops = move |x: &Tensor| {
        let centred = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
        let variance = centred.sqr()?.mean_keepdim(D::Minus1)?;
        centred.broadcast_div(&(variance + EPS)?.sqrt()?)?.broadcast_mul(&wc)?.broadcast_add(&bc)
    };
    let rms = RmsNorm::new(Param::new(w.clone()), EPS);
    let wc = w.as_tensor().clone();
    let rms_ops = move |x: &Tensor| {
        let mean_square = x.sqr()?.mean_keepdim(D::Minus1)?;
        x.broadcast_div(&(mean_square + EPS)?.sqrt()?)?.broadcast_mul(&wc)
    };
    Ok([
        Case {
            name: "LayerNorm (4096, 1024)",
            amp: step(&x, &r, move |x| layer.forward(x)),
            candle: step(&x, &r, layer_ops),
        },
        Case {
            name: "RmsNorm (4096, 1024)",
            amp: step(&x, &r, move |x| rms.forward(x)),
            candle: step(&x, &r, rms_ops),
        },
    ])
}

/// Group norm (32 groups) over (8, 256, 32, 32) and batch norm in training over (32, 64, 32, 32).
fn channel_norms() -> Result<[Case; 2]> {
    let dims = [8, 256, 32, 32];
    let (x, r) = (variable(&dims, 0.5, 2.0)?, Tensor::randn(0f32, 1.0, &dims[..], &Device::Cpu)?);
    let (w, b) = (variable(&[256], 1.0, 0.2)?, variable(&[256], 0.0, 0.2)?);
    let ours = GroupNorm::new(Param::new(w.clone()), Param::new(b.clone()), 32, EPS)?;
    let theirs = candle_nn::GroupNorm::new(w.as_tensor().clone(), b.as_tensor().clone(), 256, 32, EPS)?;
    let group = Case {
        name: "GroupNorm /32 (8, 256, 32, 32)",
        amp: step(&x, &r, move |x| ours.forward(x)),
        candle: step(&x, &r, move |x| theirs.forward(x)),
    };
    let dims = [32, 64, 32, 32];
    let (x, r) = (variable(&dims, 0.5, 2.0)?, Tensor::randn(0f32, 1.0, &dims[..], &Device::Cpu)?);
    let (w, b) = (variable(&[64], 1.0, 0.2)?, variable(&[64], 0.0, 0.2)?);
    let statistics = || -> Result<(Var, Var)> {
        Ok((Var::zeros(64, DType::F32, &Device::Cpu)?, Var::ones(64, DType::F32, &Device::Cpu)?))
    };
    let (mean, var) = statistics()?;
    let affine = Some((Param::new(w.clone()), Param::new(b.clone())));
    let ours = BatchNorm::new(mean, var, affine, BatchNormConfig::default())?;
    let (mean, var) = statistics()?;
    let (wc, bc) = (w.as_tensor().clone(), b.as_tensor().clone());
    let theirs =
        candle_nn::BatchNorm::new(64, mean.as_tensor().clone(), var.as_tensor().clone(), wc, bc, EPS)?;
    let batch = Case {
        name: "BatchNorm train (32, 64, 32, 32)",
        amp: step(&x, &r, move |x| ours.forward_t(x, true)),
        candle: step(&x, &r, move |x| theirs.forward_t(x, true)),
    };
    Ok([group, batch])
}

/// Pooling 2 x 2 at stride 2 over (8, 64, 112, 112): max in f32 and bf16, average in f32.
fn pooling() -> Result<Vec<Case>> {
    let mut cases = Vec::new();
    let dims = [8, 64, 112, 112];
    for (name, dtype, max) in [
        ("MaxPool 2x2/2 (8, 64, 112, 112)", DType::F32, true),
        ("MaxPool 2x2/2 (8, 64, 112, 112) bf16", DType::BF16, true),
        ("AvgPool 2x2/2 (8, 64, 112, 112)", DType::F32, false),
    ] {
        let x = Var::from_tensor(&Tensor::randn(0f32, 2.0, &dims[..], &Device::Cpu)?.to_dtype(dtype)?)?;
        let r = Tensor::randn(0f32, 1.0, (8, 64, 56, 56), &Device::Cpu)?;
        let (amp, candle): (Step, Step) = if max {
            (step(&x, &r, |x| amp::ops::max_pool2d(x, 2, 2, 0)), step(&x, &r, |x| x.max_pool2d(2)))
        } else {
            (step(&x, &r, |x| amp::ops::avg_pool2d(x, 2, 2, 0)), step(&x, &r, |x| x.avg_pool2d(2)))
        };
        cases.push(Case { name, amp, candle });
    }
    Ok(cases)
}

fn main() -> Result<()> {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().map_err(candle_core::Error::wrap)?;
    pool.install(run)
}

fn run() -> Result<()> {
    let cases: Vec<Case> =
        row_norms()?.into_iter().chain(channel_norms()?).chain(pointwise()?).chain(pooling()?).collect();
    println!("ops step (forward + backward; f32 unless named), 2 threads, {ROUNDS} rounds, medians in ms");
    let mut harness = Interleaved::new(2 * cases.len(), 1);
    for _ in 0..ROUNDS + 1 {
        let mut round = harness.round();
        for case in &cases {
            round.time(|| (case.amp)())?;
            round.time(|| (case.candle)())?;
        }
    }
    println!("{:<34} {:>9} {:>9} {:>14}", "layer or op", "amp", "candle", "amp speed-up");
    for (i, case) in cases.iter().enumerate() {
        let (ours, theirs) = (harness.median_s(2 * i) * 1e3, harness.median_s(2 * i + 1) * 1e3);
        println!("{:<34} {ours:>9.2} {theirs:>9.2} {:>13.2}x", case.name, theirs / ours);
    }
    Ok(())
}
