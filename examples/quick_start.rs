//! The README's quick start: a block with per-layer precisions, O2, the fused AdamW and the loss scaler.
//!
//! What it shows: an fp16 layer makes the model need loss scaling, `GradScaler::for_model` turns the
//! scaler on, and `step_fused` runs the whole step (backward on the scaled loss, overflow check, fused
//! update with inline unscale and clipping).
//!
//! Run: `cargo run --release --example quick_start`

use amp::nn::{layer_norm, linear, LayerNorm, Linear};
use amp::optim::{AdamConfig, FusedAdamW, ParamGroups};
use amp::{scaler::ScalerConfig, AmpConfig, AmpModule, GradScaler, OptLevel};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};

#[derive(AmpModule)]
#[amp(default = bf16)] // fields without an attribute compute in bf16
struct Block {
    #[amp(fp32)]
    norm: LayerNorm, // reductions stay fp32
    fc1: Linear, // bf16 matmul, f32 accumulation
    #[amp(fp16)]
    fc2: Linear, // fp16: this model now needs a loss scaler
}

fn train(mut block: Block, x: &Tensor, device: &Device) -> amp::Result<()> {
    amp::initialize(&mut block, AmpConfig::new(OptLevel::O2, device))?; // fp32 masters + half copies
    let mut optimizer = FusedAdamW::new(ParamGroups::from_model(&block)?, AdamConfig::default())?;
    let mut scaler = GradScaler::for_model(&block, ScalerConfig::default())?;
    for _ in 0..100 {
        let y = block.fc2.forward(&block.fc1.forward(&block.norm.forward(x)?)?)?;
        let report = scaler.step_fused(&y.sqr()?.mean_all()?, &mut optimizer, Some(1.0))?;
        if !report.applied() {
            println!("{report}"); // skipped: which parameter overflowed, the scale before and after
        }
    }
    println!("loss scale after 100 steps: {}", scaler.scale());
    Ok(())
}

fn main() -> amp::Result<()> {
    const { assert!(Block::NEEDS_LOSS_SCALING) };
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &device);
    let block = Block {
        norm: layer_norm(16, 1e-5, vb.pp("norm"))?,
        fc1: linear(16, 64, vb.pp("fc1"))?,
        fc2: linear(64, 16, vb.pp("fc2"))?,
    };
    train(block, &Tensor::randn(0f32, 1.0, (32, 16), &device)?, &device)
}
