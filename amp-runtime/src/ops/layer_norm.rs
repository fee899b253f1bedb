//! Layer normalisation as one candle op on the CPU: forward in one pass, backward in one pass that
//! returns all three gradients ([`amp_kernels::layer_norm`]), in f32 with f64 row statistics. RMS
//! normalisation is the same op without the mean ([`amp_kernels::rms_norm`]).
//!
//! Written with candle's tensor ops, a layer norm is ten ops forward and about twenty backward, each a
//! pass over the activations with a fresh buffer, and candle's backward adds every gradient into a
//! fresh zero tensor; the weight's and bias's gradients come from reductions over the rows that candle
//! runs with a strided inner loop. Off the CPU, [`crate::nn::LayerNorm`] keeps the tensor-op version.

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::elementwise::elements;

/// `layer_norm(x) * weight + bias` over the last dimension, in f32 (`x` of any float dtype, widened
/// exactly; `weight` and `bias` f32 vectors), or `None` off the CPU.
pub(crate) fn layer_norm(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Option<Tensor>> {
    row_norm(RowNorm::Layer, x, weight, bias, eps)
}

/// `x / sqrt(mean(x^2) + eps) * weight` over the last dimension, in f32 (`x` of any float dtype, widened
/// exactly; `weight` an f32 vector), or `None` off the CPU.
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Option<Tensor>> {
    row_norm(RowNorm::Rms, x, weight, None, eps)
}

/// `x` viewed as `rows` rows, each normalised by its own statistics without weight or bias, in f32:
/// less its mean and over its standard deviation (`remove_mean`), or over its root mean square; the
/// result has `x`'s shape. `None` off the CPU (nothing allocated there).
pub(crate) fn normalise_rows(x: &Tensor, rows: usize, remove_mean: bool, eps: f64) -> Result<Option<Tensor>> {
    if !x.device().is_cpu() {
        return Ok(None);
    }
    let matrix = x.reshape((rows, ()))?;
    let unit_weight = Tensor::ones(matrix.dim(1)?, DType::F32, x.device())?;
    let norm = if remove_mean { RowNorm::Layer } else { RowNorm::Rms };
    row_norm(norm, &matrix, &unit_weight, None, eps)?.map(|y| y.reshape(x.shape())).transpose()
}

fn row_norm(
    norm: RowNorm,
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Option<Tensor>> {
    let Some((weight, bias, has_bias)) = operands(norm.name(), x, weight, bias)? else { return Ok(None) };
    // The op folds x's leading dimensions into rows itself: a reshape each way would be two more graph
    // nodes, each a zero-filled sum of its size in candle's backward pass.
    Ok(Some(x.contiguous()?.apply_op3(&weight, &bias, LayerNormOp { norm, eps: eps as f32, has_bias })?))
}

/// The weight and the bias (zeros, untracked, where there is none) as the op takes them, and whether
/// there is a bias; `None` off the CPU or for an `x` that is not f32, f16 or bf16. Refuses a weight or
/// bias of another length than x's features, naming the norm as `what`.
pub(super) fn operands(
    what: &str,
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Option<(Tensor, Tensor, bool)>> {
    if !x.device().is_cpu() || !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Ok(None);
    }
    let Some(&features) = x.dims().last() else {
        candle_core::bail!("{what}: x has no dimensions");
    };
    for (name, t) in [("weight", Some(weight)), ("bias", bias)] {
        if let Some(t) = t.filter(|t| t.dims() != [features]) {
            candle_core::bail!(
                "{what}: the input has {features} features (its last dimension) but the {name} has \
                 shape {:?}: give the input shape (.., {}), or build the layer for {features} features",
                t.dims(),
                t.dims().first().copied().unwrap_or(1)
            );
        }
    }
    let weight = weight.to_dtype(DType::F32)?;
    let (bias, has_bias) = match bias {
        Some(b) => (b.to_dtype(DType::F32)?, true),
        None => (weight.zeros_like()?.detach(), false),
    };
    Ok(Some((weight, bias, has_bias)))
}

/// The rows and the row length of a contiguous `(.., d)` layout.
fn rows(layout: &Layout) -> (usize, usize) {
    let d = layout.dims().last().copied().unwrap_or(1);
    (super::rows_before_last(layout.dims()), d)
}

/// Which normalisation an op computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RowNorm {
    /// The row's mean subtracted, its variance dividing ([`amp_kernels::layer_norm`]).
    Layer,
    /// Its mean square dividing ([`amp_kernels::rms_norm`]); never with a bias.
    Rms,
}

impl RowNorm {
    /// The name errors give it.
    fn name(self) -> &'static str {
        match self {
            RowNorm::Layer => "layer_norm",
            RowNorm::Rms => "rms_norm",
        }
    }
}

/// The forward op: `(x, weight, bias) -> y`.
#[derive(Clone, Copy, Debug)]
struct LayerNormOp {
    norm: RowNorm,
    eps: f32,
    has_bias: bool,
}

/// The backward op: `(x, weight, dy) -> [dx; dweight; dbias]`, one `(rows + 2, d)` f32 matrix (`dbias`
/// zeros for an RMS norm).
#[derive(Clone, Copy, Debug)]
struct LayerNormBackward {
    norm: RowNorm,
    eps: f32,
}

/// What a norm op's forward pass reads: the rows and row length of x, its elements, the weight and
/// the bias.
pub(super) struct Inputs<'a> {
    pub rows: usize,
    pub d: usize,
    pub x: amp_kernels::GradSlice<'a>,
    pub weight: &'a [f32],
    pub bias: Option<&'a [f32]>,
}

/// The [`Inputs`] in an op's storages of `(x, weight, bias)` (the bias none where `has_bias` is false:
/// its storage holds untracked zeros).
pub(super) fn inputs<'a>(
    (s1, l1): (&'a CpuStorage, &Layout),
    (s2, l2): (&'a CpuStorage, &Layout),
    (s3, l3): (&'a CpuStorage, &Layout),
    has_bias: bool,
) -> Result<Inputs<'a>> {
    let (rows, d) = rows(l1);
    let (x, weight) = (elements(s1, l1)?, vector(s2, l2)?);
    let bias = if has_bias { Some(vector(s3, l3)?) } else { None };
    debug_assert_eq!(x.len(), rows * d);
    Ok(Inputs { rows, d, x, weight, bias })
}

/// A contiguous f32 vector (a weight or a bias).
fn vector<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    super::elementwise::f32_elements(storage, layout, "amp layer_norm's weight and bias")
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        match self.norm {
            RowNorm::Layer => "amp-layer-norm",
            RowNorm::Rms => "amp-rms-norm",
        }
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let Inputs { d, x, weight, bias, .. } = inputs((s1, l1), (s2, l2), (s3, l3), self.has_bias)?;
        let y = match self.norm {
            RowNorm::Layer => amp_kernels::layer_norm::forward_new(x, d, weight, bias, self.eps),
            RowNorm::Rms => amp_kernels::rms_norm::forward_new(x, d, weight, self.eps),
        };
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _bias: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let backward = LayerNormBackward { norm: self.norm, eps: self.eps };
        let (dx, dweight, dbias) = backward.gradients(x, weight, grad)?;
        Ok((Some(dx), Some(dweight), self.has_bias.then_some(dbias)))
    }
}

/// The gradients of the layer norm of `x` (`weight` f32, `eps`) from its output's gradient `grad`:
/// x's (in x's dtype), the weight's and the bias's.
pub(super) fn gradients(
    x: &Tensor,
    weight: &Tensor,
    grad: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    LayerNormBackward { norm: RowNorm::Layer, eps }.gradients(x, weight, grad)
}

impl LayerNormBackward {
    /// The gradients of x (in x's dtype), the weight and the bias from the output's gradient `grad`.
    fn gradients(self, x: &Tensor, weight: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (rows, _) = rows(x.layout());
        let all = x.apply_op3_no_bwd(weight, &grad.contiguous()?, &self)?;
        let dx = all.narrow(0, 0, rows)?.reshape(x.dims())?.to_dtype(x.dtype())?;
        Ok((dx, all.get(rows)?, all.get(rows + 1)?))
    }
}

impl CustomOp3 for LayerNormBackward {
    fn name(&self) -> &'static str {
        match self.norm {
            RowNorm::Layer => "amp-layer-norm-backward",
            RowNorm::Rms => "amp-rms-norm-backward",
        }
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, d) = rows(l1);
        let (x, weight, dy) = (elements(s1, l1)?, vector(s2, l2)?, elements(s3, l3)?);
        let mut all = vec![0f32; (rows + 2) * d];
        let (dx, sums) = all.split_at_mut(rows * d);
        let (dweight, dbias) = sums.split_at_mut(d);
        match self.norm {
            RowNorm::Layer => {
                amp_kernels::layer_norm::backward(x, dy, d, weight, self.eps, dx, dweight, dbias)
            }
            RowNorm::Rms => amp_kernels::rms_norm::backward(x, dy, d, weight, self.eps, dx, dweight),
        }
        Ok((CpuStorage::F32(all), (rows + 2, d).into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var, D};

    /// The tensor-op layer norm (what runs off the CPU).
    fn composed(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
        let x = x.to_dtype(DType::F32)?;
        let centered = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
        let variance = centered.sqr()?.mean_keepdim(D::Minus1)?;
        centered.broadcast_div(&(variance + eps)?.sqrt()?)?.broadcast_mul(w)?.broadcast_add(b)
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }

    #[test]
    fn agrees_with_the_tensor_op_version_forward_and_backward() -> Result<()> {
        let dev = Device::Cpu;
        for dtype in [DType::F32, DType::BF16] {
            let x = Var::from_tensor(&(Tensor::randn(0f32, 2.0, (3, 9, 48), &dev)? + 0.5)?.to_dtype(dtype)?)?;
            let w = Var::from_tensor(&Tensor::randn(1f32, 0.3, 48, &dev)?)?;
            let b = Var::from_tensor(&Tensor::randn(0f32, 0.3, 48, &dev)?)?;
            let r = Tensor::randn(0f32, 1.0, (3, 9, 48), &dev)?;
            let ours =
                layer_norm(x.as_tensor(), w.as_tensor(), Some(b.as_tensor()), 1e-5)?.expect("on the CPU");
            let theirs = composed(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5)?;
            assert_eq!((ours.dims(), ours.dtype()), (theirs.dims(), DType::F32));
            assert!(max_diff(&ours, &theirs)? < 1e-5, "{dtype:?} forward");
            let (g1, g2) = ((ours * &r)?.sum_all()?.backward()?, (theirs * &r)?.sum_all()?.backward()?);
            for (name, v) in [("x", &x), ("weight", &w), ("bias", &b)] {
                let (a, c) = (g1.get(v.as_tensor()).expect("ours"), g2.get(v.as_tensor()).expect("theirs"));
                assert_eq!(a.dtype(), v.dtype(), "{name}");
                let tol = if dtype == DType::BF16 && name == "x" { 2e-2 } else { 1e-4 };
                assert!(max_diff(a, c)? < tol, "{dtype:?} d{name}: {}", max_diff(a, c)?);
            }
        }
        // Without a bias: no gradient for the stand-in zeros.
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 16), &dev)?)?;
        let w = Var::from_tensor(&Tensor::ones(16, DType::F32, &dev)?)?;
        let y = layer_norm(x.as_tensor(), w.as_tensor(), None, 1e-5)?.expect("on the CPU");
        let grads = y.sqr()?.sum_all()?.backward()?;
        assert!(grads.get(x.as_tensor()).is_some() && grads.get(w.as_tensor()).is_some());
        Ok(())
    }
}
