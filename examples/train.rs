//! The first training run: a residual MLP learns a fixed random "teacher" network on generated data,
//! under an Apex-style optimisation level, and the loss falls.
//!
//! What it shows: `#[derive(AmpModule)]` with per-layer precision attributes, the precision plan the
//! derive and `amp::initialize` produce, and O2 training (bf16 working copies, fp32 master weights
//! updated by candle-nn's AdamW) with no manual casts in the model.
//!
//! Run: `cargo run --release --example train -- [--opt-level O0|O1|O2|O3] [--steps N]`

use amp::nn::{layer_norm, linear, LayerNorm, Linear};
use amp::{AmpConfig, AmpModule, AmpModuleExt, OptLevel};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};

const WIDTH: usize = 64;
const HIDDEN: usize = 256;
const DEPTH: usize = 3;
const BATCH: usize = 128;

/// `x + down(relu(up(norm(x))))`: the norm stays fp32, the projections take the level's half type.
#[derive(AmpModule)]
struct Residual {
    #[amp(fp32)]
    norm: LayerNorm,
    up: Linear,
    down: Linear,
}

impl Residual {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Self> {
        Ok(Residual {
            norm: layer_norm(WIDTH, 1e-5, vb.pp("norm"))?,
            up: linear(WIDTH, HIDDEN, vb.pp("up"))?,
            down: linear(HIDDEN, WIDTH, vb.pp("down"))?,
        })
    }
}

impl Module for Residual {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x + self.down.forward(&self.up.forward(&self.norm.forward(x)?)?.relu()?)?
    }
}

#[derive(AmpModule)]
struct Model {
    blocks: Vec<Residual>,
    #[amp(fp32)]
    norm: LayerNorm,
    head: Linear,
}

impl Model {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Self> {
        let blocks =
            (0..DEPTH).map(|i| Residual::new(vb.pp(format!("blocks.{i}")))).collect::<Result<_, _>>()?;
        Ok(Model {
            blocks,
            norm: layer_norm(WIDTH, 1e-5, vb.pp("norm"))?,
            head: linear(WIDTH, 1, vb.pp("head"))?,
        })
    }
}

impl Module for Model {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = self.blocks.iter().try_fold(x.clone(), |x, block| block.forward(&x))?;
        self.head.forward(&self.norm.forward(&x)?)
    }
}

struct Args {
    opt_level: OptLevel,
    steps: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args { opt_level: OptLevel::O2, steps: 300 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--opt-level" => args.opt_level = value()?.parse().map_err(|e| format!("{e}"))?,
            "--steps" => args.steps = value()?.parse().map_err(|e| format!("--steps: {e}"))?,
            "--help" | "-h" => return Err("usage: train [--opt-level O0|O1|O2|O3] [--steps N]".to_string()),
            other => return Err(format!("unknown flag {other}; try --help")),
        }
    }
    Ok(args)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let device = Device::Cpu;

    // A fixed random teacher defines the task; the student learns to imitate it.
    let teacher_map = VarMap::new();
    let teacher = Model::new(VarBuilder::from_varmap(&teacher_map, DType::F32, &device))?;
    let varmap = VarMap::new();
    let mut model = Model::new(VarBuilder::from_varmap(&varmap, DType::F32, &device))?;

    let config = AmpConfig::new(args.opt_level, &device);
    amp::initialize(&mut model, config)?;
    println!(
        "opt level {} (half = {}), static plan of `Model`:\n{}",
        args.opt_level,
        config.half,
        Model::PLAN
    );
    println!("precision plan:\n{}\n", model.precision_plan());

    let mut optimizer = AdamW::new(model.master_vars(), ParamsAdamW { lr: 1e-3, ..Default::default() })?;
    let activations = config.activation_precision().dtype();
    let mut first = None;
    for step in 1..=args.steps {
        let x = Tensor::randn(0f32, 1.0, (BATCH, WIDTH), &device)?;
        let target = teacher.forward(&x)?.detach();
        let prediction = model.forward(&x.to_dtype(activations)?)?.to_dtype(DType::F32)?;
        let loss = (prediction - target)?.sqr()?.mean_all()?;
        let mut grads = loss.backward()?;
        amp::grads_to_masters(&model, &mut grads)?;
        optimizer.step(&grads)?;
        amp::refresh_working_copies(&model)?;
        let loss = loss.to_scalar::<f32>()?;
        first.get_or_insert(loss);
        if step % 50 == 0 || step == 1 {
            println!("step {step:>4}  loss {loss:.5}");
        }
    }
    println!("loss fell from {:.5}", first.unwrap_or(f32::NAN));
    Ok(())
}
