//! Multi-head attention: `y = out_proj(concat_h softmax(q_h k_h^T / sqrt(d) + mask) v_h)`, with
//! `q = q_proj(query)`, `k = k_proj(context)`, `v = v_proj(context)` split into `h` heads of `d` values.
//!
//! Shapes: `query` is `(batch, t_q, embed)`, `context` `(batch, t_k, embed)`, the result
//! `(batch, t_q, embed)`; every projection is an `(embed, embed)` [`Linear`] with bias.
//!
//! Precision: the attention block is a composite, not a [`crate::Layer`]; `amp::initialize` reaches its
//! four projections (`q_proj`, `k_proj`, `v_proj`, `out_proj`), which inherit the precision requested
//! for the block. Each projection computes in its own compute precision; the block's own two products,
//! `q k^T` and `probs v`, run in **`q_proj`'s compute precision** (f32 accumulation), as
//! [`crate::ops::scaled_dot_product_attention`]: on amp's GEMM one op each way, with the scale
//! `1/sqrt(d)`, the mask and the softmax in f32 between the products. Between products the activations
//! stay f32: each product rounds its operands to the compute precision as it reads them (on the CPU
//! while packing, so no cast pass and no half-precision elementwise op runs, and candle's half
//! elementwise ops and gradient sums are slow on CPU). On amp's GEMM the products read each head where
//! its projection wrote it and write the result's heads side by side, ready for `out_proj`: no split
//! into heads or merge back. Elsewhere those are one permuted copy each way on the CPU (`ops::heads`),
//! candle's reshape, transpose and copy on other devices.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;

use super::{linear, LayerNorm, Linear};
use crate::{
    ops, AmpModule, Cursor, HalfSafe, Layer, Plan, PlanField, PlanNode, Precision, Visitor, VisitorMut,
};

/// Multi-head attention with projections named as PyTorch's and most checkpoints name them: `q_proj`,
/// `k_proj`, `v_proj`, `out_proj`. Half-safe.
#[derive(Clone, Debug)]
pub struct MultiHeadAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    out_proj: Linear,
    num_heads: usize,
    causal: bool,
}

/// Self-attention over `embed_dim` features in `num_heads` heads (which must divide `embed_dim`), its
/// projections created or loaded through `vb.pp("q_proj")` etc. like `candle_nn::linear`. Not causal;
/// see [`MultiHeadAttention::with_causal`].
pub fn multi_head_attention(
    embed_dim: usize,
    num_heads: usize,
    vb: VarBuilder<'_>,
) -> Result<MultiHeadAttention> {
    let proj = |name: &str| linear(embed_dim, embed_dim, vb.pp(name));
    MultiHeadAttention::new([proj("q_proj")?, proj("k_proj")?, proj("v_proj")?, proj("out_proj")?], num_heads)
}

impl MultiHeadAttention {
    /// Attention from existing projections `[q, k, v, out]`: `(embed, embed)` each in the usual case;
    /// in general `q` and `k` of one width, which the heads divide, and `out` reading what `v` writes.
    ///
    /// # Errors
    /// Projections that do not fit together, each named with the widths found: heads that do not
    /// divide `q`'s or `v`'s features, `k` of another width than `q` (their rows are multiplied), `k`
    /// and `v` reading inputs of different widths (both read the context), `out` not reading `v`'s.
    pub fn new(projections: [Linear; 4], num_heads: usize) -> Result<Self> {
        let [q_proj, k_proj, v_proj, out_proj] = projections;
        let dims = |p: &Linear| p.weight().trainable().dims2();
        let [(q, _), (k, k_in), (v, v_in), (_, out_in)] =
            [dims(&q_proj)?, dims(&k_proj)?, dims(&v_proj)?, dims(&out_proj)?];
        if num_heads == 0 || q % num_heads != 0 {
            candle_core::bail!("attention: {num_heads} heads do not divide {q} features");
        }
        if k != q {
            candle_core::bail!(
                "attention: k_proj writes {k} features and q_proj {q}: queries and keys are multiplied \
                 feature by feature, so they must be as wide"
            );
        }
        if v % num_heads != 0 {
            candle_core::bail!("attention: {num_heads} heads do not divide v_proj's {v} features");
        }
        if k_in != v_in {
            candle_core::bail!(
                "attention: k_proj reads {k_in} features and v_proj {v_in}: both read the context"
            );
        }
        if out_in != v {
            candle_core::bail!("attention: out_proj reads {out_in} features, but v_proj writes {v}");
        }
        Ok(MultiHeadAttention { q_proj, k_proj, v_proj, out_proj, num_heads, causal: false })
    }

    /// The same attention, masking (`causal = true`) or not the future in [`Module::forward`]: position
    /// `i` attends to positions `j <= i` only.
    pub fn with_causal(self, causal: bool) -> Self {
        MultiHeadAttention { causal, ..self }
    }

    /// Whether [`Module::forward`] masks the future.
    pub fn is_causal(&self) -> bool {
        self.causal
    }

    /// The number of heads.
    pub fn num_heads(&self) -> usize {
        self.num_heads
    }

    /// The projections `[q_proj, k_proj, v_proj, out_proj]`.
    pub fn projections(&self) -> [&Linear; 4] {
        [&self.q_proj, &self.k_proj, &self.v_proj, &self.out_proj]
    }

    /// The precision of the attention products: `q_proj`'s compute precision.
    pub fn compute_precision(&self) -> Precision {
        self.q_proj.precision().compute
    }

    /// Attention of `query` `(batch, t_q, embed)` over `context` `(batch, t_k, embed)` (cross-attention;
    /// self-attention when both are the same tensor), masking `j > i` when `causal`. The result has the
    /// output precision of `out_proj`, or `query`'s dtype.
    pub fn attend(&self, query: &Tensor, context: &Tensor, causal: bool) -> Result<Tensor> {
        sequences("query", query)?;
        sequences("context", context)?;
        if query.id() == context.id() {
            if let Some(y) = self.fused_self_attention(query, None, causal)? {
                return super::cast_output(y, self.out_proj.precision(), query.dtype());
            }
        }
        self.composed(query, context, causal)
    }

    /// Self-attention of `norm(x)`, causal if [`MultiHeadAttention::with_causal`] said so: the values and
    /// gradients of `self.forward(&norm.forward(x)?)` bit for bit, the pre-norm transformer's block.
    /// On amp's CPU GEMM the norm's output stays out of candle's graph as `q`, `k` and `v` do, kept in
    /// the precision the projections read it in (bf16 under O2): one f32 activation less to store, and
    /// none for candle's backward pass to zero-fill and add into.
    ///
    /// # Errors
    /// As the norm's and the attention's: an `x` whose last dimension is not the norm's size or the
    /// projections' input features.
    pub fn forward_normed(&self, norm: &LayerNorm, x: &Tensor) -> Result<Tensor> {
        if let Some(y) = self.fused_self_attention(x, Some((norm, false)), self.causal)? {
            return super::cast_output(y, self.out_proj.precision(), x.dtype());
        }
        self.forward(&norm.forward(x)?)
    }

    /// The pre-norm transformer's attention sublayer, `x + self.forward_normed(norm, x)`: its values and
    /// gradients bit for bit. On amp's CPU GEMM the output projection's op adds `x` to its product, so
    /// the attention's result is not a node of candle's graph either (one zero-filled gradient and one
    /// add fewer in candle's backward pass, and no new tensor for the sum).
    ///
    /// # Errors
    /// As [`MultiHeadAttention::forward_normed`]'s, and the add's: a result whose dtype or width is not
    /// x's.
    ///
    /// ```
    /// use amp_runtime::nn::{layer_norm, multi_head_attention};
    /// use candle_core::{DType, Device, Module, Tensor};
    /// use candle_nn::{VarBuilder, VarMap};
    ///
    /// let varmap = VarMap::new();
    /// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    /// let norm = layer_norm(16, 1e-5, vb.pp("ln"))?;
    /// let attn = multi_head_attention(16, 2, vb.pp("attn"))?.with_causal(true);
    /// let x = Tensor::randn(0f32, 1.0, (2, 6, 16), &Device::Cpu)?;
    /// let y = attn.forward_residual(&norm, &x)?;
    /// let composed = (&x + attn.forward(&norm.forward(&x)?)?)?;
    /// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, composed.flatten_all()?.to_vec1::<f32>()?);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn forward_residual(&self, norm: &LayerNorm, x: &Tensor) -> Result<Tensor> {
        if self.out_proj.output_dtype(x.dtype()) == x.dtype() {
            if let Some(y) = self.fused_self_attention(x, Some((norm, true)), self.causal)? {
                return Ok(y);
            }
        }
        x + self.forward_normed(norm, x)?
    }

    /// [`MultiHeadAttention::attend`] composed of the projections' and the attention's ops.
    fn composed(&self, query: &Tensor, context: &Tensor, causal: bool) -> Result<Tensor> {
        let compute = self.compute_precision();
        let q = project(&self.q_proj, query)?;
        let k = project(&self.k_proj, context)?;
        let v = project(&self.v_proj, context)?;
        let mixed = ops::attention_of_heads([&q, &k, &v], self.num_heads, causal, compute)?;
        let y = project(&self.out_proj, &mixed)?;
        super::cast_output(y, self.out_proj.precision(), query.dtype())
    }
}

impl MultiHeadAttention {
    /// Self-attention of `x` as four ops with `q`, `k`, `v` and the heads' mix outside candle's graph
    /// ([`ops::self_attention`]: the same values, fewer passes over memory), or `None` where that
    /// does not apply (not amp's CPU GEMM). With a norm, of `norm(x)`, and where its flag says, with `x`
    /// added to the result.
    fn fused_self_attention(
        &self,
        x: &Tensor,
        norm: Option<(&LayerNorm, bool)>,
        causal: bool,
    ) -> Result<Option<Tensor>> {
        sequences("input", x)?;
        let operands = self.projections().map(|p| p.product_operands(x.device()));
        let [q, k, v, out] = operands;
        let operands = [q?, k?, v?, out?];
        let projections = [0, 1, 2, 3].map(|i| {
            let (weight, bias) = &operands[i];
            let compute = self.projections()[i].precision().compute;
            ops::Projection { weight, bias: bias.as_ref(), compute, out: DType::F32 }
        });
        let norm_operands = norm.map(|(norm, _)| norm.operands()).transpose()?;
        let norm = norm.zip(norm_operands.as_ref()).map(|((norm, residual), (weight, bias))| ops::Norm {
            weight,
            bias: bias.as_ref(),
            eps: norm.eps(),
            residual,
        });
        ops::self_attention(x, norm.as_ref(), projections, self.num_heads, causal, self.compute_precision())
    }
}

/// Refuses an input that is not a batch of sequences, `(batch, t, features)`, saying how to make one.
fn sequences(name: &str, t: &Tensor) -> Result<()> {
    if t.rank() != 3 {
        candle_core::bail!(
            "attention: the {name} must be (batch, t, features), got shape {:?}; a single sequence is a \
             batch of one: `.unsqueeze(0)`",
            t.dims()
        );
    }
    Ok(())
}

/// `x W^T + b` in the projection's compute precision, the f32 sum left in f32 (the next product rounds
/// it as it reads it).
fn project(proj: &Linear, x: &Tensor) -> Result<Tensor> {
    let (weight, bias) = proj.product_operands(x.device())?;
    let compute = proj.precision().compute;
    ops::linear_to(x, &weight, bias.as_ref(), compute, DType::F32, ops::Epilogue::Identity)
}

impl Module for MultiHeadAttention {
    /// Self-attention of `x` `(batch, t, embed)`, causal if [`MultiHeadAttention::with_causal`] said so.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.attend(x, x, self.causal)
    }
}

const PROJECTIONS: [&str; 4] = ["q_proj", "k_proj", "v_proj", "out_proj"];

const fn projection_field(name: &'static str) -> PlanField {
    PlanField { name, ty: "Linear", precision: None, plan: &<Linear as AmpModule>::PLAN }
}

#[diagnostic::do_not_recommend]
impl AmpModule for MultiHeadAttention {
    type Module = Self;
    const PLAN: Plan = Plan {
        type_name: "MultiHeadAttention",
        node: PlanNode::Struct {
            default: None,
            fields: &[
                projection_field(PROJECTIONS[0]),
                projection_field(PROJECTIONS[1]),
                projection_field(PROJECTIONS[2]),
                projection_field(PROJECTIONS[3]),
            ],
        },
    };

    fn visit(&self, cursor: &mut Cursor, visitor: &mut dyn Visitor) {
        for (name, proj) in PROJECTIONS.into_iter().zip(self.projections()) {
            cursor.push(name, None);
            proj.visit(cursor, visitor);
            cursor.pop();
        }
    }

    fn visit_mut(&mut self, cursor: &mut Cursor, visitor: &mut dyn VisitorMut) {
        let projections = [&mut self.q_proj, &mut self.k_proj, &mut self.v_proj, &mut self.out_proj];
        for (name, proj) in PROJECTIONS.into_iter().zip(projections) {
            cursor.push(name, None);
            proj.visit_mut(cursor, visitor);
            cursor.pop();
        }
    }
}

#[diagnostic::do_not_recommend]
impl HalfSafe for MultiHeadAttention {}

// Its projections take the request made for the block, as a half-capable leaf does.
#[diagnostic::do_not_recommend]
impl crate::NoFp16Under<crate::Inherit> for MultiHeadAttention {}
#[diagnostic::do_not_recommend]
impl crate::NoFp16Under<crate::AskWide> for MultiHeadAttention {}

#[cfg(test)]
mod tests;
