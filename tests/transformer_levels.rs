//! A small decoder-only transformer (token and position embeddings, two blocks of causal attention and
//! MLP with residuals and norms, an untied head), written once with attributes and no casts, trains
//! under O0, O1, O2 and O3 on CPU from the same initial weights.

use std::collections::HashMap;

use amp::nn::{
    embedding, layer_norm, linear, multi_head_attention, Embedding, LayerNorm, Linear, MultiHeadAttention,
};
use amp::optim::{AdamConfig, FusedAdam, FusedOptimizer, ParamGroups};
use amp::{AmpConfig, AmpModule, AmpModuleExt, OptLevel, Precision};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Optimizer, VarBuilder, VarMap};

const VOCAB: usize = 16;
const EMBED: usize = 32;
const SEQ: usize = 8;
const BATCH: usize = 16;

#[derive(AmpModule)]
struct Mlp {
    up: Linear,
    down: Linear,
}

#[derive(AmpModule)]
struct Block {
    #[amp(fp32)]
    ln1: LayerNorm,
    attn: MultiHeadAttention,
    #[amp(fp32)]
    ln2: LayerNorm,
    mlp: Mlp,
}

#[derive(AmpModule)]
struct Gpt {
    tokens: Embedding,
    positions: Embedding,
    blocks: Vec<Block>,
    #[amp(fp32)]
    ln_f: LayerNorm,
    head: Linear,
}

impl Block {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Self> {
        Ok(Block {
            ln1: layer_norm(EMBED, 1e-5, vb.pp("ln1"))?,
            attn: multi_head_attention(EMBED, 4, vb.pp("attn"))?.with_causal(true),
            ln2: layer_norm(EMBED, 1e-5, vb.pp("ln2"))?,
            mlp: Mlp {
                up: linear(EMBED, 4 * EMBED, vb.pp("mlp.up"))?,
                down: linear(4 * EMBED, EMBED, vb.pp("mlp.down"))?,
            },
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = (x + self.attn.forward(&self.ln1.forward(x)?)?)?;
        let hidden = self.mlp.up.forward(&self.ln2.forward(&x)?)?.gelu()?;
        x + self.mlp.down.forward(&hidden)?
    }
}

impl Gpt {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Self> {
        Ok(Gpt {
            tokens: embedding(VOCAB, EMBED, vb.pp("tokens"))?,
            positions: embedding(SEQ, EMBED, vb.pp("positions"))?,
            blocks: (0..2).map(|i| Block::new(vb.pp(format!("blocks.{i}")))).collect::<Result<_, _>>()?,
            ln_f: layer_norm(EMBED, 1e-5, vb.pp("ln_f"))?,
            head: linear(EMBED, VOCAB, vb.pp("head"))?,
        })
    }

    fn loss(&self, ids: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        let positions = Tensor::arange(0u32, SEQ as u32, ids.device())?;
        let mut x = self.tokens.forward(ids)?.broadcast_add(&self.positions.forward(&positions)?)?;
        for block in &self.blocks {
            x = block.forward(&x)?;
        }
        let logits = self.head.forward(&self.ln_f.forward(&x)?)?;
        amp::ops::loss::cross_entropy(&logits.reshape((BATCH * SEQ, VOCAB))?, &targets.flatten_all()?)
    }
}

/// Sequences counting up by a per-sequence stride modulo the vocabulary; the target is the next token.
fn batch() -> candle_core::Result<(Tensor, Tensor)> {
    let ids: Vec<u32> =
        (0..BATCH).flat_map(|b| (0..=SEQ).map(move |t| ((b + t * (1 + b % 3)) % VOCAB) as u32)).collect();
    let all = Tensor::from_vec(ids, (BATCH, SEQ + 1), &Device::Cpu)?;
    Ok((all.narrow(D::Minus1, 0, SEQ)?, all.narrow(D::Minus1, 1, SEQ)?))
}

fn train(weights: &HashMap<String, Tensor>, config: AmpConfig) -> amp::Result<(f32, f32)> {
    let mut model = Gpt::new(VarBuilder::from_tensors(weights.clone(), DType::F32, &Device::Cpu))?;
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
        let loss = model.loss(&ids, &targets)?;
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
    let varmap = VarMap::new();
    Gpt::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
    let weights: HashMap<String, Tensor> = varmap
        .data()
        .lock()
        .map_err(|_| candle_core::Error::Msg("poisoned".into()))?
        .iter()
        .map(|(name, var)| (name.clone(), var.as_tensor().copy().expect("copy")))
        .collect();
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
