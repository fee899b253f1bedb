//! A two-layer perceptron with GELU between its Linears: `down(gelu(up(x)))`, the MLP of a transformer
//! block.

use candle_core::{Module, Result, Tensor};

use super::{LayerNorm, Linear};
use crate::ops::{Norm, Projection};
use crate::Layer;

/// `down(gelu(up(x)))` (GELU's tanh approximation): the values and gradients of
/// `down.forward(&up.forward_gelu(x)?)`, bit for bit, with the hidden activation kept out of candle's
/// graph where both products run on amp's CPU GEMM. There it is stored in the precision the
/// down-projection reads it in (bf16 under O2: half the bytes to write and read again), and candle's
/// backward pass no longer gives it a zero-filled gradient to add the down-projection's into (two
/// passes over the widest tensor of a transformer block). Measured on the main job (Xeon, AMX): bf16 O2
/// peak memory 0.91x, step time unchanged. Elsewhere (CUDA, candle's kernel forced) it is the two
/// layers one after the other.
///
/// # Errors
/// As the two layers': an `x` whose last dimension is not `up`'s input features, or a `down` whose input
/// features are not `up`'s outputs.
///
/// ```
/// use amp_runtime::nn::{gelu_mlp, linear};
/// use candle_core::{DType, Device, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
///
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let (up, down) = (linear(8, 32, vb.pp("up"))?, linear(32, 8, vb.pp("down"))?);
/// let x = Tensor::randn(0f32, 1.0, (2, 5, 8), &Device::Cpu)?;
/// let y = gelu_mlp(&x, &up, &down)?;
/// assert_eq!(y.dims(), [2, 5, 8]);
/// let unfused = down.forward(&up.forward_gelu(&x)?)?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, unfused.flatten_all()?.to_vec1::<f32>()?);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn gelu_mlp(x: &Tensor, up: &Linear, down: &Linear) -> Result<Tensor> {
    match fused(x, None, up, down)? {
        Some(y) => Ok(y),
        None => down.forward(&up.forward_gelu(x)?),
    }
}

/// [`gelu_mlp`] of `norm(x)`: the values and gradients of `gelu_mlp(&norm.forward(x)?, up, down)`, bit
/// for bit. On amp's CPU GEMM the norm's output stays out of candle's graph as the hidden activation
/// does, kept in the precision the up-projection reads it in (bf16 under O2), with no gradient for
/// candle's backward pass to zero-fill and add into.
///
/// # Errors
/// As the norm's and [`gelu_mlp`]'s.
pub fn gelu_mlp_normed(norm: &LayerNorm, x: &Tensor, up: &Linear, down: &Linear) -> Result<Tensor> {
    match pre_norm(norm, false, x, up, down)? {
        Some(y) => Ok(y),
        None => gelu_mlp(&norm.forward(x)?, up, down),
    }
}

/// The pre-norm transformer's MLP sublayer, `x + gelu_mlp(norm(x), up, down)`: its values and
/// gradients bit for bit. On amp's CPU GEMM the down-projection's op adds `x` to its product, so the
/// perceptron's result is not a node of candle's graph either (one zero-filled gradient and one add
/// fewer in candle's backward pass, and no new tensor for the sum).
///
/// # Errors
/// As [`gelu_mlp_normed`]'s, and the add's: a result whose dtype or width is not x's.
///
/// ```
/// use amp_runtime::nn::{gelu_mlp, gelu_mlp_residual, layer_norm, linear};
/// use candle_core::{DType, Device, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
///
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let norm = layer_norm(8, 1e-5, vb.pp("ln"))?;
/// let (up, down) = (linear(8, 32, vb.pp("up"))?, linear(32, 8, vb.pp("down"))?);
/// let x = Tensor::randn(0f32, 1.0, (2, 5, 8), &Device::Cpu)?;
/// let y = gelu_mlp_residual(&norm, &x, &up, &down)?;
/// let composed = (&x + gelu_mlp(&norm.forward(&x)?, &up, &down)?)?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, composed.flatten_all()?.to_vec1::<f32>()?);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn gelu_mlp_residual(norm: &LayerNorm, x: &Tensor, up: &Linear, down: &Linear) -> Result<Tensor> {
    match pre_norm(norm, true, x, up, down)? {
        Some(y) => Ok(y),
        None => x + gelu_mlp_normed(norm, x, up, down)?,
    }
}

/// The fused perceptron of `norm(x)` (plus `x` where `residual`), where it runs.
fn pre_norm(
    norm: &LayerNorm,
    residual: bool,
    x: &Tensor,
    up: &Linear,
    down: &Linear,
) -> Result<Option<Tensor>> {
    let (weight, bias) = norm.operands()?;
    let operands = Norm { weight: &weight, bias: bias.as_ref(), eps: norm.eps(), residual };
    fused(x, Some(&operands), up, down)
}

/// The fused perceptron ([`crate::ops::gelu_mlp`]) where it runs.
fn fused(x: &Tensor, norm: Option<&Norm<'_>>, up: &Linear, down: &Linear) -> Result<Option<Tensor>> {
    let (up_weight, up_bias) = up.product_operands(x.device())?;
    let (down_weight, down_bias) = down.product_operands(x.device())?;
    let hidden_dtype = up.output_dtype(x.dtype());
    crate::ops::gelu_mlp(
        x,
        norm,
        Projection {
            weight: &up_weight,
            bias: up_bias.as_ref(),
            compute: up.precision().compute,
            out: hidden_dtype,
        },
        Projection {
            weight: &down_weight,
            bias: down_bias.as_ref(),
            compute: down.precision().compute,
            out: down.output_dtype(hidden_dtype),
        },
    )
}
