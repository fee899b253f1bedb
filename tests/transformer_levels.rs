//! A small decoder-only transformer (token and position embeddings, two blocks of causal attention and
//! MLP with residuals and norms, an untied head), written once with attributes and no casts, trains
//! under O0, O1, O2 and O3 on CPU from the same initial weights.

use std::collections::HashMap;

#[path = "../examples/train/gpt.rs"]
mod gpt;

use amp::optim::{AdamConfig, FusedAdam, FusedOptimizer, ParamGroups};
use amp::{AmpConfig, AmpModuleExt, OptLevel, Precision};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::{Optimizer, VarBuilder};
use gpt::{Gpt, GptShape};

const VOCAB: usize = 16;
const EMBED: usize = 32;
const SEQ: usize = 8;
const BATCH: usize = 16;

const SHAPE: GptShape = GptShape { vocab: VOCAB, embed: EMBED, heads: 4, layers: 2, seq: SEQ };

/// Sequences counting up by a per-sequence stride modulo the vocabulary; the target is the next token.
fn batch() -> candle_core::Result<(Tensor, Tensor)> {
    let ids: Vec<u32> =
        (0..BATCH).flat_map(|b| (0..=SEQ).map(move |t| ((b + t * (1 + b % 3)) % VOCAB) as u32)).collect();
    let all = Tensor::from_vec(ids, (BATCH, SEQ + 1), &Device::Cpu)?;
    Ok((all.narrow(D::Minus1, 0, SEQ)?, all.narrow(D::Minus1, 1, SEQ)?))
}

fn train(weights: &HashMap<String, Tensor>, config: AmpConfig) -> amp::Result<(f32, f32)> {
    let mut model = Gpt::new(SHAPE, VarBuilder::from_tensors(weights.clone(), DType::F32, &Device::Cpu))?;
    amp::initialize(&mut model, config)?;
    let (ids, targets) = batch()?;
    let adam = AdamConfig { lr: 3e-3, weight_decay: 0.0, ..AdamConfig::default() };
    // O3 keeps no fp32 master, so it trains its half parameters directly (Apex O3), with candle-nn.
    let mut fused = match config.opt_level {
        OptLevel::O3 => None,
        _ => Some(FusedAdam::new(ParamGroups::from_model(&model)?, adam)?),
    };
    let params = candle_nn::ParamsAdamW { lr: 3e-3, weight_decay: 0.0, ..Default::default() };
    let mut pure_half = candle_nn::AdamW::new(model.trainable_vars(), params)?;
    let mut losses = Vec::new();
    for _ in 0..80 {
        let loss = amp::ops::loss::cross_entropy(&model.logits(&ids)?, &targets.flatten_all()?)?;
        losses.push(loss.to_scalar::<f32>()?);
        let grads = loss.backward()?;
        match fused.as_mut() {
            Some(optimizer) => optimizer.step(&grads)?,
            None => pure_half.step(&grads)?,
        }
    }
    Ok((losses[0], losses[losses.len() - 1]))
}

#[test]
fn a_small_transformer_trains_under_every_level() -> amp::Result<()> {
    let weights = Gpt::initial_weights(SHAPE, 5, &Device::Cpu)?;
    let mut finals = Vec::new();
    for opt_level in OptLevel::ALL {
        let (first, last) = train(&weights, AmpConfig { opt_level, half: Precision::Bf16 })?;
        assert!(last.is_finite() && last < 0.3 * first, "{opt_level}: loss {first} -> {last}");
        finals.push(last);
    }
    // Mixed precision lands near fp32 from the same start with the same hyper-parameters.
    for (level, last) in OptLevel::ALL.iter().zip(&finals).skip(1) {
        assert!(
            (last - finals[0]).abs() < 0.25 * finals[0].max(0.05),
            "{level}: {last} vs fp32 {}",
            finals[0]
        );
    }
    Ok(())
}
