//! A layer norm at the head of a chain of ops ([`mod@super::self_attention`], [`super::mlp`]): the
//! pre-norm transformer's `chain(norm(x))` with the norm's output handed to the chain outside
//! candle's graph.
//!
//! Written as the norm's op and the chain, the norm's output is a node of the graph: stored in f32
//! although every product that reads it rounds it to its compute precision (the q, k and v
//! projections, the MLP's up-projection, each forward and again for its weight's gradient), and
//! candle's backward pass gives it a zero-filled gradient to add the chain's into. Here the norm's op
//! ([`NormOp`]) keeps its output in a [`Link`], in the precision the chain's products read (bf16 under
//! O2: half the bytes written, and the products read it without rounding), and returns a one-element
//! token in its place; the chain's first op takes the token and reads the output from the link, and
//! its backward pass leaves the output's gradient there for the norm's, which candle runs next.
//!
//! With [`Norm::residual`] the chain is a pre-norm residual sublayer, `x + chain(norm(x))`: its last
//! op adds `x` to its f32 result in place ([`Link::add_residual`]), so neither the chain's result nor
//! the sum's new tensor is a node of the graph, and its backward pass leaves the result's gradient in
//! the link for the norm's op, which adds it to the norm's gradient of `x` (the sum candle forms of
//! x's two consumers' gradients, in whichever order: two terms).
//!
//! The values are those of the norm followed by the chain, bit for bit: the kept output is what the
//! products read (each row computed in f32 as the norm's op computes it, then rounded once), and the
//! gradient is the one the chain would have added to a zero.

use std::sync::{Arc, Mutex, MutexGuard};

use amp_kernels::Dtype;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::elementwise::{add_into, elements_mut, new_storage, sum_into, tensor_of};
use super::layer_norm::{gradients, inputs, operands, Inputs};

/// A layer norm's operands: `weight` (f32), `bias` and `eps`; with `residual`, the chain's result is
/// `x + chain(norm(x))`, the pre-norm residual sublayer.
pub(crate) struct Norm<'a> {
    pub weight: &'a Tensor,
    pub bias: Option<&'a Tensor>,
    pub eps: f64,
    pub residual: bool,
}

/// What a chain reads as its input and leaves as the input's gradient.
#[derive(Default)]
pub(super) struct Link {
    /// The input, `(.., features)`.
    pub value: Option<Tensor>,
    /// Its gradient, in the dtype the input has in the composition.
    pub gradient: Option<Tensor>,
    /// The norm's input, which the chain's last op adds to its result (a residual sublayer).
    pub residual: Option<Tensor>,
    /// The result's gradient, from the last op's backward pass: the residual's share of x's gradient.
    pub residual_gradient: Option<Tensor>,
}

impl Link {
    /// `y += x` for the chain's f32 result `y` where the chain adds its input (`x + f(x)`, as candle's
    /// add computes it); nothing where it does not.
    pub fn add_residual(&self, y: &mut CpuStorage) -> Result<()> {
        let Some(x) = &self.residual else { return Ok(()) };
        let CpuStorage::F32(y) = y else { candle_core::bail!("amp chain: a residual sum that is not f32") };
        let (guard, layout) = x.storage_and_layout();
        let (candle_core::Storage::Cpu(CpuStorage::F32(xs)), Some((start, end))) =
            (&*guard, layout.contiguous_offsets())
        else {
            candle_core::bail!("amp chain: the residual is not a contiguous f32 CPU tensor");
        };
        let xs = &xs[start..end];
        if xs.len() != y.len() {
            candle_core::bail!(
                "amp chain: the residual's {} values do not match the result's {}",
                xs.len(),
                y.len()
            );
        }
        add_into(y, xs);
        Ok(())
    }
}

/// The shared [`Link`] of a chain's ops.
pub(super) type SharedLink = Arc<Mutex<Link>>;

pub(super) fn lock(link: &Mutex<Link>) -> Result<MutexGuard<'_, Link>> {
    link.lock().map_err(|_| candle_core::Error::Msg("amp chain: a panic poisoned the shared input".into()))
}

/// The token of `norm(x)` kept in `link` in `kept` (the dtype the chain's products read; the
/// gradient the chain leaves there is f32, the norm's output dtype); `None` where the norm's op does
/// not run (off the CPU, an `x` that is not f32, f16 or bf16). Refuses a weight or bias of another
/// length than x's features.
pub(super) fn normed(x: &Tensor, norm: &Norm<'_>, kept: Dtype, link: SharedLink) -> Result<Option<Tensor>> {
    let Some((weight, bias, has_bias)) = operands("layer_norm", x, norm.weight, norm.bias)? else {
        return Ok(None);
    };
    let x = x.contiguous()?;
    if norm.residual {
        lock(&link)?.residual = Some(x.clone());
    }
    let op = NormOp { eps: norm.eps as f32, has_bias, kept, link };
    Ok(Some(x.apply_op3(&weight, &bias, op)?))
}

/// `(x, weight, bias) -> token`: the layer norm of `x`, kept in the link in `kept`.
struct NormOp {
    eps: f32,
    has_bias: bool,
    kept: Dtype,
    link: SharedLink,
}

impl CustomOp3 for NormOp {
    fn name(&self) -> &'static str {
        "amp-layer-norm-head"
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
        let Inputs { rows, d, x, weight, bias } = inputs((s1, l1), (s2, l2), (s3, l3), self.has_bias)?;
        let mut y = new_storage(self.kept, rows * d, |_, _| {});
        amp_kernels::layer_norm::forward_into(x, d, weight, bias, self.eps, elements_mut(&mut y, rows * d)?);
        lock(&self.link)?.value = Some(tensor_of(y, l1.shape().clone())?);
        Ok((CpuStorage::F32(vec![0.0]), Shape::from(1)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _bias: &Tensor,
        _token: &Tensor,
        _token_grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = lock(&self.link)?.gradient.take().ok_or_else(|| {
            candle_core::Error::Msg(
                "amp chain: the norm's output gradient is missing (ran out of order)".into(),
            )
        })?;
        let (dx, dweight, dbias) = gradients(x, weight, &grad.to_dtype(DType::F32)?, self.eps)?;
        // x's two consumers in the composition, the norm and the residual's add: their gradients'
        // sum, which candle forms the same whichever it adds to zero first.
        let dx = match lock(&self.link)?.residual_gradient.take() {
            Some(residual) => sum_into(dx, &residual)?,
            None => dx,
        };
        Ok((Some(dx), Some(dweight), self.has_bias.then_some(dbias)))
    }
}
