//! A small GPT-style decoder, written once with precision attributes and no casts: token and position
//! embeddings, pre-norm blocks of causal attention and MLP with residuals, fp32 LayerNorms, an untied
//! head. The main job trains it; `tests/main_job.rs` and `tests/transformer_levels.rs` include this file.

use amp::nn::{
    embedding, gelu_mlp_residual, layer_norm, linear, multi_head_attention, Embedding, LayerNorm, Linear,
    MultiHeadAttention,
};
use std::collections::HashMap;

use amp::varmap::SeededInit;
use amp::AmpModule;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};

/// The sizes of a [`Gpt`].
#[derive(Clone, Copy, Debug)]
pub struct GptShape {
    pub vocab: usize,
    pub embed: usize,
    pub heads: usize,
    pub layers: usize,
    /// Positions: the sequence length.
    pub seq: usize,
}

#[derive(AmpModule)]
pub struct Mlp {
    up: Linear,
    down: Linear,
}

/// Pre-norm block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`; the norms stay fp32.
#[derive(AmpModule)]
pub struct Block {
    #[amp(fp32)]
    ln1: LayerNorm,
    attn: MultiHeadAttention,
    #[amp(fp32)]
    ln2: LayerNorm,
    mlp: Mlp,
}

#[derive(AmpModule)]
pub struct Gpt {
    tokens: Embedding,
    positions: Embedding,
    blocks: Vec<Block>,
    #[amp(fp32)]
    ln_f: LayerNorm,
    head: Linear,
    #[amp(skip)]
    shape: GptShape,
}

impl Block {
    fn new(shape: &GptShape, vb: VarBuilder<'_>) -> candle_core::Result<Self> {
        let embed = shape.embed;
        Ok(Block {
            ln1: layer_norm(embed, 1e-5, vb.pp("ln1"))?,
            attn: multi_head_attention(embed, shape.heads, vb.pp("attn"))?.with_causal(true),
            ln2: layer_norm(embed, 1e-5, vb.pp("ln2"))?,
            mlp: Mlp {
                up: linear(embed, 4 * embed, vb.pp("mlp.up"))?,
                down: linear(4 * embed, embed, vb.pp("mlp.down"))?,
            },
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // `x + attn(ln1(x))`, then `x + mlp(ln2(x))`: each norm's output, and what the attention and
        // the MLP compute between their products, pass from op to op outside candle's graph, kept in
        // the precision the next product reads, and each sublayer's last op adds its input.
        let x = self.attn.forward_residual(&self.ln1, x)?;
        gelu_mlp_residual(&self.ln2, &x, &self.mlp.up, &self.mlp.down)
    }
}

impl Gpt {
    pub fn new(shape: GptShape, vb: VarBuilder<'_>) -> candle_core::Result<Self> {
        Ok(Gpt {
            tokens: embedding(shape.vocab, shape.embed, vb.pp("tokens"))?,
            positions: embedding(shape.seq, shape.embed, vb.pp("positions"))?,
            blocks: (0..shape.layers)
                .map(|i| Block::new(&shape, vb.pp(format!("blocks.{i}"))))
                .collect::<Result<_, _>>()?,
            ln_f: layer_norm(shape.embed, 1e-5, vb.pp("ln_f"))?,
            head: linear(shape.embed, shape.vocab, vb.pp("head"))?,
            shape,
        })
    }

    /// candle-nn's initialisation drawn from `seed` (reproducible: `amp::varmap::SeededInit`), by
    /// name, to build several models from the same weights with `VarBuilder::from_tensors`.
    pub fn initial_weights(
        shape: GptShape,
        seed: u64,
        device: &Device,
    ) -> candle_core::Result<HashMap<String, Tensor>> {
        let varmap = VarMap::new();
        Gpt::new(shape, SeededInit::new(seed).var_builder(&varmap, DType::F32, device))?;
        let data = varmap.data().lock().map_err(|_| candle_core::Error::Msg("poisoned var map".into()))?;
        data.iter().map(|(name, var)| Ok((name.clone(), var.as_tensor().copy()?))).collect()
    }

    /// Logits `(batch * seq, vocab)` for ids `(batch, seq)`.
    pub fn logits(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let positions = Tensor::arange(0u32, self.shape.seq as u32, ids.device())?;
        let mut x = self.tokens.forward(ids)?.broadcast_add(&self.positions.forward(&positions)?)?;
        for block in &self.blocks {
            x = block.forward(&x)?;
        }
        self.head.forward(&self.ln_f.forward(&x)?)?.reshape(((), self.shape.vocab))
    }
}
