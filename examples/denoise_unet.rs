//! A small U-Net learns to remove noise from synthetic images, as fp32, bf16 O2 and fp16 O2 from the same
//! seeded weights and data: convolutions with batch norm, overlapping max pooling (3 x 3, stride 2,
//! padding 1), a transposed convolution and bilinear upsampling on the way back up, skip connections.
//! candle 0.11.1 cannot train this network with its own ops: its pooling refuses overlapping windows in
//! the backward, and its bilinear upsampling has no backward at all; amp's have both.
//!
//! Each image is 32 x 32: a rectangle and a disc of random sizes, places and brightnesses on a dark
//! ground, plus Gaussian noise of deviation 0.3. The network predicts the clean image; the loss is the
//! mean squared error. Held-out error is reported against the noise's own (0.09, what returning the
//! noisy input scores).
//!
//! Writes `out/denoise_unet.png`: eight held-out images noisy, denoised by the bf16 run, and clean.
//!
//! Run: `cargo run --release --example denoise_unet` (`-- --steps N --seeds N --out PATH`)

use amp::nn::{
    batch_norm, conv2d, conv_transpose2d, BatchNorm, BatchNormConfig, Conv2d, Conv2dConfig, ConvTranspose2d,
    ConvTranspose2dConfig,
};
use amp::ops;
use amp::optim::{AdamConfig, FusedAdamW, ParamGroups};
use amp::scaler::ScalerConfig;
use amp::varmap::SeededInit;
use amp::{AmpConfig, AmpModule, GradScaler, OptLevel, Precision};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{ModuleT, VarBuilder, VarMap};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Image side.
pub const SIDE: usize = 32;
/// Deviation of the noise added to the clean images.
pub const NOISE: f32 = 0.3;

/// Encoder: two convolution + batch norm stages, each followed by a 3 x 3 max pool at stride 2; a
/// middle convolution at 8 x 8; decoder: a transposed convolution back to 16 x 16 and bilinear
/// upsampling to 32 x 32, each joined with the encoder's map of that size.
#[derive(Debug, AmpModule)]
pub struct UNet {
    enc1: Conv2d,
    norm1: BatchNorm,
    enc2: Conv2d,
    norm2: BatchNorm,
    middle: Conv2d,
    up: ConvTranspose2d,
    dec2: Conv2d,
    dec1: Conv2d,
}

impl UNet {
    pub fn new(vb: VarBuilder<'_>) -> candle_core::Result<Self> {
        let same = Conv2dConfig { padding: 1, ..Default::default() };
        let norm = BatchNormConfig::default();
        Ok(UNet {
            enc1: conv2d(1, 16, 3, same, vb.pp("enc1"))?,
            norm1: batch_norm(16, norm, vb.pp("norm1"))?,
            enc2: conv2d(16, 32, 3, same, vb.pp("enc2"))?,
            norm2: batch_norm(32, norm, vb.pp("norm2"))?,
            middle: conv2d(32, 32, 3, same, vb.pp("middle"))?,
            up: conv_transpose2d(
                32,
                32,
                2,
                ConvTranspose2dConfig { stride: 2, ..Default::default() },
                vb.pp("up"),
            )?,
            dec2: conv2d(64, 16, 3, same, vb.pp("dec2"))?,
            dec1: conv2d(32, 1, 3, same, vb.pp("dec1"))?,
        })
    }

    /// The clean image predicted from the noisy `x` `(batch, 1, 32, 32)`, as a correction added to `x`.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let e1 = ops::relu(&self.norm1.forward_t(&self.enc1.forward(x)?, train)?)?;
        let e2 = self.enc2.forward(&ops::max_pool2d(&e1, 3, 2, 1)?)?;
        let e2 = ops::relu(&self.norm2.forward_t(&e2, train)?)?;
        let m = ops::relu(&self.middle.forward(&ops::max_pool2d(&e2, 3, 2, 1)?)?)?;
        let u = ops::relu(&self.up.forward(&m)?)?;
        let d2 = ops::relu(&self.dec2.forward(&ops::cat(&[&u, &e2], 1)?)?)?;
        let d1 = ops::upsample_bilinear2d(&d2, SIDE, SIDE, false)?;
        let correction = self.dec1.forward(&ops::cat(&[&d1, &e1], 1)?)?;
        ops::add(x, &correction)
    }
}

/// `count` clean images `(count, 1, 32, 32)` and their noisy copies, from `seed`.
pub fn images(count: usize, seed: u64) -> candle_core::Result<(Tensor, Tensor)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut clean = vec![0f32; count * SIDE * SIDE];
    for image in clean.chunks_exact_mut(SIDE * SIDE) {
        let (x0, y0) = (rng.random_range(0..SIDE - 8), rng.random_range(0..SIDE - 8));
        let (w, h) = (rng.random_range(6..SIDE - x0), rng.random_range(6..SIDE - y0));
        let rect = rng.random_range(0.4f32..1.0);
        let (cx, cy, r) =
            (rng.random_range(6.0f32..26.0), rng.random_range(6.0f32..26.0), rng.random_range(3.0f32..8.0));
        let disc = rng.random_range(-1.0f32..-0.3);
        for (i, v) in image.iter_mut().enumerate() {
            let (x, y) = (i % SIDE, i / SIDE);
            if (x0..x0 + w).contains(&x) && (y0..y0 + h).contains(&y) {
                *v += rect;
            }
            if (x as f32 - cx).powi(2) + (y as f32 - cy).powi(2) < r * r {
                *v += disc;
            }
        }
    }
    let noise: Vec<f32> = (0..clean.len()).map(|_| gaussian(&mut rng) * NOISE).collect();
    let noisy: Vec<f32> = clean.iter().zip(&noise).map(|(c, n)| c + n).collect();
    let shape = (count, 1, SIDE, SIDE);
    Ok((Tensor::from_vec(clean, shape, &Device::Cpu)?, Tensor::from_vec(noisy, shape, &Device::Cpu)?))
}

/// A standard normal draw (Box-Muller).
fn gaussian(rng: &mut StdRng) -> f32 {
    let (u, v) = (rng.random_range(f32::EPSILON..1.0), rng.random_range(0.0f32..1.0));
    (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
}

/// One training run's result.
#[derive(Debug, Clone, Copy)]
pub struct Outcome {
    /// Mean squared error on the last training batch.
    pub train_loss: f32,
    /// Mean squared error on the held-out images (the network in evaluation mode).
    pub test_loss: f32,
    /// Steps the loss scaler skipped.
    pub skipped: u64,
    /// Mean wall time of a training step, in milliseconds.
    pub step_ms: f64,
}

/// `steps` AdamW steps on batches of 16 of `train`, from the weights `seed` draws, at `config`; the
/// outcome, and the trained network's output for the held-out images.
pub fn train(
    seed: u64,
    config: AmpConfig,
    train: &(Tensor, Tensor),
    test: &(Tensor, Tensor),
    steps: usize,
) -> amp::Result<(Outcome, Tensor)> {
    let varmap = VarMap::new();
    let mut model = UNet::new(SeededInit::new(seed).var_builder(&varmap, DType::F32, &Device::Cpu))?;
    amp::initialize(&mut model, config)?;
    let adam = AdamConfig { lr: 2e-3, ..AdamConfig::default() };
    let mut optimizer = FusedAdamW::new(ParamGroups::from_model(&model)?, adam)?;
    let mut scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
    let (clean, noisy) = train;
    let batches = clean.dim(0)? / 16;
    let mut train_loss = f32::NAN;
    let start = std::time::Instant::now();
    for step in 0..steps {
        let at = step % batches * 16;
        let (target, input) = (clean.narrow(0, at, 16)?, noisy.narrow(0, at, 16)?);
        let loss = ops::loss::mse(&model.forward_t(&input, true)?, &target)?;
        train_loss = loss.to_scalar()?;
        scaler.step_fused(&loss, &mut optimizer, None)?;
    }
    let step_ms = start.elapsed().as_secs_f64() * 1e3 / steps as f64;
    let denoised = model.forward_t(&test.1, false)?.to_dtype(DType::F32)?;
    let test_loss = ops::loss::mse(&denoised, &test.0)?.to_scalar()?;
    Ok((Outcome { train_loss, test_loss, skipped: scaler.state().skipped, step_ms }, denoised))
}

/// The runs compared: fp32, bf16 O2, fp16 O2.
pub fn runs() -> [(&'static str, AmpConfig); 3] {
    [
        ("fp32", AmpConfig { opt_level: OptLevel::O0, half: Precision::Bf16 }),
        ("bf16 O2", AmpConfig { opt_level: OptLevel::O2, half: Precision::Bf16 }),
        ("fp16 O2", AmpConfig { opt_level: OptLevel::O2, half: Precision::Fp16 }),
    ]
}

#[derive(Debug, clap::Parser)]
#[command(name = "denoise_unet")]
struct Args {
    /// AdamW steps per run (batches of 16)
    #[arg(long, value_name = "N", default_value_t = 300, value_parser = clap::value_parser!(u32).range(1..))]
    steps: u32,
    /// Seeds (each its own initial weights)
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    seeds: u64,
    /// Where to write the picture of noisy, denoised and clean held-out images
    #[arg(long, value_name = "PATH", default_value = "out/denoise_unet.png")]
    out: std::path::PathBuf,
}

#[allow(dead_code)]
fn main() -> amp::Result<()> {
    // As the main job: candle's worker threads park between its ops, freed buffers are kept for the next
    // step's, and the loop runs on rayon's pool (see `amp::threads`, `amp::memory`).
    let _candle_threads = amp::threads::candle_pool_that_parks();
    amp::memory::retain_freed_memory();
    let args = <Args as clap::Parser>::parse();
    amp::threads::run_on_rayon_pool(|| compare(&args))
}

fn compare(args: &Args) -> amp::Result<()> {
    let (train_set, test_set) = (images(512, 1)?, images(128, 2)?);
    println!(
        "U-Net denoising 32 x 32 images (noise deviation {NOISE}: returning the input scores {:.4}), {} steps of \
         16, {} seed(s)",
        NOISE * NOISE,
        args.steps,
        args.seeds
    );
    println!(
        "{:<8} {:>6} {:>12} {:>12} {:>8} {:>8}",
        "run", "seed", "train MSE", "held-out MSE", "skipped", "step ms"
    );
    for seed in 0..args.seeds {
        for (name, config) in runs() {
            let (o, denoised) = train(seed, config, &train_set, &test_set, args.steps as usize)?;
            if seed == 0 && name == "bf16 O2" {
                write_png(&args.out, &[&test_set.1, &denoised, &test_set.0])?;
            }
            println!(
                "{name:<8} {seed:>6} {:>12.5} {:>12.5} {:>8} {:>8.2}",
                o.train_loss, o.test_loss, o.skipped, o.step_ms
            );
        }
    }
    println!(
        "{}: held-out images, noisy (top), denoised by the bf16 O2 run of seed 0, clean",
        args.out.display()
    );
    Ok(())
}

/// Eight held-out images of each of `rows` (`(n, 1, 32, 32)` tensors) side by side, a row each, each
/// pixel drawn 3 x 3, as an 8-bit grey PNG (values clamped to [-1.2, 1.2]).
fn write_png(path: &std::path::Path, rows: &[&Tensor]) -> amp::Result<()> {
    const SHOWN: usize = 8;
    const ZOOM: usize = 3;
    const CELL: usize = SIDE * ZOOM + 4;
    let (width, height) = (SHOWN * CELL, rows.len() * CELL);
    let mut pixels = vec![255u8; width * height];
    for (r, images) in rows.iter().enumerate() {
        let values = images.narrow(0, 0, SHOWN)?.flatten_all()?.to_vec1::<f32>()?;
        for (i, v) in values.iter().enumerate() {
            let (image, y, x) = (i / (SIDE * SIDE), i / SIDE % SIDE, i % SIDE);
            let grey = ((v.clamp(-1.2, 1.2) + 1.2) / 2.4 * 255.0).round() as u8;
            for (dy, dx) in (0..ZOOM).flat_map(|dy| (0..ZOOM).map(move |dx| (dy, dx))) {
                pixels[(r * CELL + y * ZOOM + dy) * width + image * CELL + x * ZOOM + dx] = grey;
            }
        }
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| amp::Error::Candle(e.into()))?;
    }
    let file = std::fs::File::create(path).map_err(|e| amp::Error::Candle(e.into()))?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), width as u32, height as u32);
    encoder.set_color(png::ColorType::Grayscale);
    encoder.set_depth(png::BitDepth::Eight);
    let written = encoder.write_header().and_then(|mut w| w.write_image_data(&pixels));
    written.map_err(|e| amp::Error::Candle(candle_core::Error::wrap(e)))
}
