//! Normalisation layers, forward and backward, amp's against candle's, measured side by side in one
//! run: `LayerNorm` and `RmsNorm` over (4096, 1024) (a transformer's tokens), `GroupNorm` with 32
//! groups over (8, 256, 32, 32) and `BatchNorm` in training over (32, 64, 32, 32) (a convnet's maps).
//!
//! candle's contender is `candle_nn`'s layer where it has a backward (`GroupNorm`, `BatchNorm`), and the
//! same formula written with candle's tensor ops where candle-nn's runs a fused kernel without one
//! (`LayerNorm`, `RmsNorm`: their gradients would be missing). The input is a variable, the parameters
//! too, and each step is `sum(y * r).backward()` with a fixed random `r`, so the backward computes every
//! gradient. All in f32. The contenders run in turn per round (`amp_kernels::timing`) on a 2-thread
//! rayon pool; medians.
//!
//! Run: `cargo bench --bench norm_step` (about 15 s once built).

use amp::nn::{BatchNorm, BatchNormConfig, GroupNorm, LayerNorm, RmsNorm};
use amp::Param;
use amp_kernels::timing::Interleaved;
use candle_core::{DType, Device, Module, Result, Tensor, Var, D};
use candle_nn::ModuleT;

const ROUNDS: usize = 15;
const EPS: f64 = 1e-5;

/// One step of a contender: the forward pass on `x` and the backward of `sum(y * r)`.
type Step = Box<dyn Fn() -> Result<()>>;

/// A normalisation of the sweep: its name, and amp's and candle's steps.
struct Case {
    name: &'static str,
    amp: Step,
    candle: Step,
}

/// `f(x)` then the backward of `sum(f(x) * r)`.
fn step(x: &Var, r: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor> + 'static) -> Step {
    let (x, r) = (x.clone(), r.clone());
    Box::new(move || {
        let y = f(x.as_tensor())?.contiguous()?;
        (y * &r)?.sum_all()?.backward()?;
        Ok(())
    })
}

fn variable(dims: &[usize], mean: f32, std: f32) -> Result<Var> {
    Var::from_tensor(&Tensor::randn(mean, std, dims, &Device::Cpu)?)
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

fn main() -> Result<()> {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().map_err(candle_core::Error::wrap)?;
    pool.install(run)
}

fn run() -> Result<()> {
    let cases: Vec<Case> = row_norms()?.into_iter().chain(channel_norms()?).collect();
    println!("norm step (forward + backward, f32), 2 threads, {ROUNDS} rounds, medians in ms");
    let mut harness = Interleaved::new(2 * cases.len(), 1);
    for _ in 0..ROUNDS + 1 {
        let mut round = harness.round();
        for case in &cases {
            round.time(|| (case.amp)())?;
            round.time(|| (case.candle)())?;
        }
    }
    println!("{:<34} {:>9} {:>9} {:>14}", "layer", "amp", "candle", "amp speed-up");
    for (i, case) in cases.iter().enumerate() {
        let (ours, theirs) = (harness.median_s(2 * i) * 1e3, harness.median_s(2 * i + 1) * 1e3);
        println!("{:<34} {ours:>9.2} {theirs:>9.2} {:>13.2}x", case.name, theirs / ours);
    }
    Ok(())
}
