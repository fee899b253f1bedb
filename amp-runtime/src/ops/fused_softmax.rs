//! Softmax over the last dimension as one op each way on the CPU ([`amp_kernels::softmax`]), with
//! attention's scale and causal mask folded in.
//!
//! Written with candle's tensor ops, `softmax(scale * s + mask)` is seven passes forward (scale, mask,
//! max, subtract, exp, sum, divide), each into a fresh buffer, and about twice as many backward, where
//! candle also adds every gradient into a fresh zero tensor. Off the CPU (and for f64) the tensor-op
//! version runs.

use amp_kernels::softmax::{self, Mask};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Device, Layout, Result, Shape, Tensor, D};

/// `softmax(x)` over the last dimension, f32 in and out, as one op each way; `None` off the CPU or
/// unless `x` is f32.
pub(crate) fn last_dim(x: &Tensor) -> Result<Option<Tensor>> {
    fused(x, 1.0, Mask::None)
}

/// Attention's probabilities `softmax(scale * scores + mask)` over the last dimension of f32
/// `scores` `(.., t_q, t_k)`, the causal mask hiding key `j > i` from query `i`: fused on the CPU,
/// candle's tensor ops elsewhere.
pub(crate) fn attention_probs(scores: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    let t_q = scores.dim(D::Minus2)?;
    let mask = if causal { Mask::Causal { rows_per_matrix: t_q } } else { Mask::None };
    if let Some(probs) = fused(scores, scale as f32, mask)? {
        return Ok(probs);
    }
    let mut scores = (scores * scale)?;
    if causal {
        scores = scores.broadcast_add(&causal_mask(t_q, scores.dim(D::Minus1)?, scores.device())?)?;
    }
    super::softmax(&scores, D::Minus1)
}

/// `(t_q, t_k)` f32: 0 where `j <= i`, `-inf` where `j > i`.
fn causal_mask(t_q: usize, t_k: usize, device: &Device) -> Result<Tensor> {
    let mask: Vec<f32> =
        (0..t_q).flat_map(|i| (0..t_k).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 })).collect();
    Tensor::from_vec(mask, (t_q, t_k), device)
}

fn fused(x: &Tensor, scale: f32, mask: Mask) -> Result<Option<Tensor>> {
    if !x.device().is_cpu() || x.dtype() != DType::F32 || x.rank() == 0 {
        return Ok(None);
    }
    Ok(Some(x.contiguous()?.apply_op1(SoftmaxOp { scale, mask })?))
}

/// The forward op: `x -> y`.
#[derive(Clone, Copy, Debug)]
struct SoftmaxOp {
    scale: f32,
    mask: Mask,
}

/// The backward op: `(y, dy) -> dx`.
#[derive(Clone, Copy, Debug)]
struct SoftmaxBackward {
    scale: f32,
}

/// A contiguous f32 tensor's elements.
fn elements<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    super::elementwise::f32_elements(storage, layout, "amp softmax")
}

impl CustomOp1 for SoftmaxOp {
    fn name(&self) -> &'static str {
        "amp-softmax"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = elements(storage, layout)?;
        let cols = layout.shape().dims().last().copied().unwrap_or(1);
        let mut y = vec![0f32; x.len()];
        softmax::forward(x, cols, self.scale, self.mask, &mut y);
        Ok((CpuStorage::F32(y), layout.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let dy = dy.to_dtype(DType::F32)?.contiguous()?;
        Ok(Some(y.apply_op2_no_bwd(&dy, &SoftmaxBackward { scale: self.scale })?))
    }
}

impl CustomOp2 for SoftmaxBackward {
    fn name(&self) -> &'static str {
        "amp-softmax-backward"
    }

    fn cpu_fwd(
        &self,
        ys: &CpuStorage,
        yl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (y, dy) = (elements(ys, yl)?, elements(gs, gl)?);
        let cols = yl.shape().dims().last().copied().unwrap_or(1);
        let mut dx = vec![0f32; y.len()];
        softmax::backward(y, dy, cols, self.scale, &mut dx);
        Ok((CpuStorage::F32(dx), yl.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    /// The tensor-op version (what runs off the CPU).
    fn composed(scores: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
        let mut s = (scores * scale)?;
        if causal {
            s = s.broadcast_add(&causal_mask(s.dim(D::Minus2)?, s.dim(D::Minus1)?, s.device())?)?;
        }
        let e = s.broadcast_sub(&s.max_keepdim(D::Minus1)?.detach())?.exp()?;
        e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }

    #[test]
    fn agrees_with_the_tensor_op_version_forward_and_backward() -> Result<()> {
        let dev = Device::Cpu;
        // (batch, heads, t_q, t_k), cross-attention shapes included (t_q != t_k).
        for (shape, scale, causal) in [
            ((2, 3, 9, 9), 0.25, true),
            ((2, 3, 9, 9), 0.25, false),
            ((1, 2, 5, 12), 0.4, true),
            ((4, 7, 3, 2), 1.0, true),
        ] {
            let s = Var::from_tensor(&Tensor::randn(0f32, 3.0, shape, &dev)?)?;
            let r = Tensor::randn(0f32, 1.0, shape, &dev)?;
            let ours = attention_probs(s.as_tensor(), scale, causal)?;
            let theirs = composed(s.as_tensor(), scale, causal)?;
            assert!(max_diff(&ours, &theirs)? < 1e-6, "{shape:?} forward: {}", max_diff(&ours, &theirs)?);
            let g1 = (ours * &r)?.sum_all()?.backward()?;
            let g2 = (theirs * &r)?.sum_all()?.backward()?;
            let (a, b) = (g1.get(s.as_tensor()).expect("ours"), g2.get(s.as_tensor()).expect("theirs"));
            assert!(max_diff(a, b)? < 1e-5, "{shape:?} backward: {}", max_diff(a, b)?);
        }
        Ok(())
    }

    #[test]
    fn runs_only_where_its_kernel_does() -> Result<()> {
        let dev = Device::Cpu;
        assert!(last_dim(&Tensor::zeros((2, 3), DType::F64, &dev)?)?.is_none(), "f64 keeps candle's ops");
        assert!(last_dim(&Tensor::zeros((2, 3), DType::BF16, &dev)?)?.is_none(), "halves are widened first");
        // A strided input is made contiguous: the transpose's rows, not its storage's.
        let x = Tensor::arange(0f32, 6.0, &dev)?.reshape((2, 3))?.t()?;
        let y = last_dim(&x)?.expect("f32 on the CPU");
        assert!(max_diff(&y, &composed(&x, 1.0, false)?)? < 1e-7);
        Ok(())
    }
}
