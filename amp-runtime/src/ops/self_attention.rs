//! Self-attention, `out(attention(q(x), k(x), v(x)))`, as four candle ops that hand `q`, `k`, `v` and
//! the heads' mix to each other outside candle's graph.
//!
//! Composed of the four projections' ops and the attention op ([`super::attention`]), self-attention
//! puts `q`, `k`, `v` and the heads' mix in candle's graph, each `rows x embed` in f32 although the
//! products that read them round them to their compute precision as they read them; candle's backward
//! pass gives each a zero-filled gradient to add the next op's into, and sums `x`'s three gradients
//! into a fourth (on the main job, five passes over 1 MiB for each of these tensors, per layer and
//! step). Here the `q`, `k` and `v` ops ([`InOp`]) each return a one-element token, and each takes
//! the previous one's token as its first argument (`q`'s takes `x`); the last op ([`OutOp`]) takes
//! `v`'s token, attends and projects. candle runs their backward passes in the reverse order: the
//! last op's first, leaving the gradients of `q`, `k` and `v` for theirs. What the products read is
//! kept as they read it: `q`, `k`, `v`, the mix and the mix's gradient in the compute precision (bf16
//! under O2: half the bytes written and read again), and so are the gradients of `q`, `k` and `v`,
//! rounded from f32 in one pass that also sums their columns, the biases' gradients
//! ([`amp_kernels::reduce::rounded_with_column_sums`]).
//!
//! With a layer norm ([`super::norm_head`]) the chain starts with the norm's op, whose output the
//! projections read from the chain's link (kept as they read it), and as a residual sublayer the last
//! op adds the norm's input to its result.
//!
//! The values are those of the composition, bit for bit: the kept tensors are the values its products
//! read (rounded once from the same f32 sums), the same kernels run in the same order, and `x`'s
//! gradient is summed in the order candle sums it there.

use std::sync::{Arc, Mutex, MutexGuard};

use amp_kernels::Dtype;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor};

use super::attention::{AttentionOp, Heads};
use super::elementwise::{kernel_dtype, sum_into, tensor_of};
use super::gemm::{deposit, needs_gradient, rows_of, LinearOp};
use super::norm_head::{self as chain, normed, Norm, SharedLink};
use super::projection::{as_read, candle_dtype, gradient_as_read, Projection};
use crate::storage::with_slices;
use crate::Precision;

/// `out(attention(q(x), k(x), v(x)))` for `x` `(batch, t, embed)` in `heads` heads (causal or not), the
/// attention's products in `compute`, of `norm(x)` where a norm is given (plus `x` where it says
/// `residual`), fused as the module says where the dispatcher picks amp's GEMM for every product;
/// `None` otherwise (the caller composes the layers). The result is `out`'s product in its output
/// dtype, `(batch, t, out features)`.
pub(crate) fn self_attention(
    x: &Tensor,
    norm: Option<&Norm<'_>>,
    [q, k, v, out]: [Projection<'_>; 4],
    heads: usize,
    causal: bool,
    compute: Precision,
) -> Result<Option<Tensor>> {
    let &[batch, t, _] = x.dims() else { return Ok(None) };
    if norm.is_some() && x.dtype() != DType::F32 {
        // The norm's output would be cast to x's dtype between the norm and the projections.
        return Ok(None);
    }
    let (rows, device) = (batch * t, x.device());
    let widths = [q.outputs()?, k.outputs()?, v.outputs()?];
    let shapes = widths.map(|w| [batch, t, w]);
    let Some(heads) = Heads::side_by_side(&shapes[0], &shapes[1], &shapes[2], heads) else {
        return Ok(None);
    };
    let Some(attention) = AttentionOp::on_amp_gemm(heads, causal, compute, device) else {
        return Ok(None);
    };
    // The norm's output has x's dtype (f32) in the composition; the projections read it in their
    // compute precision.
    let input_gradient = match norm {
        Some(_) => Some(DType::F32),
        None => needs_gradient(x).then_some(x.dtype()),
    };
    let link = SharedLink::default();
    let mut projections = Vec::with_capacity(3);
    for (role, p) in [&q, &k, &v].into_iter().enumerate() {
        let kept = candle_dtype(as_read(p.out, compute));
        let Some((linear, bias)) = p.op((rows, x.dtype(), device), kept)? else { return Ok(None) };
        let op = InOp {
            role,
            linear,
            direct: norm.is_none(),
            input_gradient,
            link: link.clone(),
            shared: Arc::default(),
        };
        projections.push((op, p.weight.differentiated.clone(), bias));
    }
    let mixed = as_read(DType::F32, out.compute);
    let Some((linear, out_bias)) = out.op((rows, candle_dtype(mixed), device), out.out)? else {
        return Ok(None);
    };
    if norm.is_some_and(|n| n.residual) && (out.out != DType::F32 || out.outputs()? != x.dim(2)?) {
        // The composition's `x + y` fails on a result of another dtype or width: let it say so.
        return Ok(None);
    }
    let mut token = match norm {
        None => {
            let x = x.contiguous()?;
            chain::lock(&link)?.value = Some(x.clone());
            x
        }
        Some(norm) => {
            let computes = [q.compute, k.compute, v.compute];
            let read_as = if computes.iter().all(|&c| c == q.compute) { q.compute } else { Precision::Fp32 };
            let Some(token) = normed(x, norm, as_read(DType::F32, read_as), link.clone())? else {
                return Ok(None);
            };
            token
        }
    };
    let shared = Arc::new(Mutex::new(Shared::default()));
    for (op, weight, bias) in projections {
        token = token.apply_op3(&weight, &bias, InOp { shared: shared.clone(), ..op })?;
    }
    let out_op = OutOp {
        attention,
        linear,
        link,
        shape: (batch, t, widths[2]),
        mixed,
        mixed_gradient: candle_dtype(as_read(DType::F32, compute)),
        out_compute: out.compute,
        gradients: [kernel_dtype(q.out)?, kernel_dtype(k.out)?, kernel_dtype(v.out)?],
        computes: [q.compute, k.compute, v.compute],
        shared,
    };
    Ok(Some(token.apply_op3(&out.weight.differentiated, &out_bias, out_op)?))
}

/// What the four ops of one call share.
#[derive(Default)]
struct Shared {
    /// `q`, `k` and `v`, `rows x features`, as the attention's products read them.
    projected: [Option<Tensor>; 3],
    /// The heads' mix, `rows x features`, as the output projection's products read it.
    mixed: Option<Tensor>,
    /// The gradients of `q`, `k` and `v`, from the last op's backward pass to theirs, as their
    /// projections' backward products read them, and where that rounded them from f32, the f32
    /// values' column sums (the biases' gradients).
    gradients: [Option<(Tensor, Option<Tensor>)>; 3],
}

fn lock(shared: &Mutex<Shared>) -> Result<MutexGuard<'_, Shared>> {
    shared
        .lock()
        .map_err(|_| candle_core::Error::Msg("amp-self-attention: a panic poisoned the shared state".into()))
}

/// An internal error: `what` is not where another op of the chain leaves it.
fn missing(what: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "amp-self-attention: {what} is missing (the chain's ops ran out of order)"
    ))
}

const ROLES: [&str; 3] = ["q", "k", "v"];

/// `(x or the previous token, W, b) -> token`: one of the projections `q`, `k`, `v` (`role` 0, 1, 2)
/// of the input in the link, kept in [`Shared`]. The link's gradient is x's so far: the sum of those
/// of the projections whose backward passes have run.
#[derive(Clone)]
struct InOp {
    role: usize,
    linear: LinearOp,
    /// Whether `q`'s op takes x itself (else a norm's token, the norm's output in the link).
    direct: bool,
    /// The dtype of the input's gradient, where it needs one.
    input_gradient: Option<DType>,
    link: SharedLink,
    shared: Arc<Mutex<Shared>>,
}

impl CustomOp3 for InOp {
    fn name(&self) -> &'static str {
        ["amp-self-attention-q", "amp-self-attention-k", "amp-self-attention-v"][self.role]
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
        let ((product, features), rows) = if self.role == 0 && self.direct {
            // The first argument is x itself (already locked by candle for this op: read it here).
            let (x, dims) = rows_of(s1, l1)?;
            (self.linear.product_of_rows((x, dims), (s2, l2), (s3, l3))?, dims[0])
        } else {
            let x = chain::lock(&self.link)?.value.clone().ok_or_else(|| missing("the input"))?;
            let (guard, layout) = x.storage_and_layout();
            let Storage::Cpu(storage) = &*guard else { return Err(off_the_cpu()) };
            let (x, dims) = rows_of(storage, layout)?;
            (self.linear.product_of_rows((x, dims), (s2, l2), (s3, l3))?, dims[0])
        };
        lock(&self.shared)?.projected[self.role] = Some(tensor_of(product, (rows, features))?);
        Ok((CpuStorage::F32(vec![0.0]), Shape::from(1)))
    }

    fn bwd(
        &self,
        first: &Tensor,
        w: &Tensor,
        bias: &Tensor,
        _token: &Tensor,
        _token_grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = lock(&self.shared)?.gradients[self.role].take();
        let (grad, summed) = grad.ok_or_else(|| missing(&format!("{}'s gradient", ROLES[self.role])))?;
        let x = chain::lock(&self.link)?.value.clone().ok_or_else(|| missing("the input"))?;
        let (dx, dw, db) = self.linear.gradients((&x, self.input_gradient), w, (bias, summed), &grad)?;
        let mut link = chain::lock(&self.link)?;
        // Added to the sum so far as candle adds each consumer's gradient to a node's.
        link.gradient = match (link.gradient.take(), dx) {
            (Some(sum), Some(dx)) => Some(sum_into(sum, &dx)?),
            (sum, dx) => sum.or(dx),
        };
        if self.role == 0 && self.direct {
            Ok((deposit(first, link.gradient.take())?, dw, db))
        } else {
            Ok((Some(first.zeros_like()?), dw, db))
        }
    }
}

/// `(v's token, W_out, b_out) -> y`: the attention of the `q`, `k` and `v` in [`Shared`] and its
/// output projection.
struct OutOp {
    attention: AttentionOp,
    linear: LinearOp,
    /// The chain's input, where the result adds it (a residual sublayer).
    link: SharedLink,
    /// `(batch, t, features)` of the heads' mix.
    shape: (usize, usize, usize),
    /// The dtype the mix is kept in.
    mixed: Dtype,
    /// The dtype the mix's gradient is kept in.
    mixed_gradient: DType,
    /// out_proj's compute precision.
    out_compute: Precision,
    /// The dtypes of the gradients of `q`, `k` and `v`: the projections' outputs' in the composition.
    gradients: [Dtype; 3],
    /// The projections' compute precisions: their backward products read the gradients in them.
    computes: [Precision; 3],
    shared: Arc<Mutex<Shared>>,
}

impl CustomOp3 for OutOp {
    fn name(&self) -> &'static str {
        "amp-self-attention-out"
    }

    fn cpu_fwd(
        &self,
        _token: &CpuStorage,
        _token_layout: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let mut shared = lock(&self.shared)?;
        let [q, k, v] = projected(&shared)?;
        let mixed = with_slices(&[&q, &k, &v], |s| self.attention.attend([s[0], s[1], s[2]], self.mixed))
            .map_err(candle_core::Error::wrap)??;
        let (batch, t, features) = self.shape;
        let layout = Layout::contiguous((batch * t, features));
        let (mut y, outputs) = self.linear.product_of_rows(rows_of(&mixed, &layout)?, (s2, l2), (s3, l3))?;
        chain::lock(&self.link)?.add_residual(&mut y)?;
        shared.mixed = Some(tensor_of(mixed, (batch * t, features))?);
        Ok((y, Shape::from((batch, t, outputs))))
    }

    fn bwd(
        &self,
        token: &Tensor,
        w: &Tensor,
        bias: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (mixed, [q, k, v]) = {
            let shared = lock(&self.shared)?;
            (shared.mixed.clone().ok_or_else(|| missing("the heads' mix"))?, projected(&shared)?)
        };
        // The result's gradient as out_proj's two backward products read it, the bias's summed.
        let (grad_read, summed) = gradient_as_read(grad, self.out_compute)?;
        let (dmixed, dw, db) =
            self.linear.gradients((&mixed, Some(self.mixed_gradient)), w, (bias, summed), &grad_read)?;
        let mut link = chain::lock(&self.link)?;
        if link.residual.is_some() {
            // The residual's share of x's gradient, for the norm's op.
            link.residual_gradient = Some(grad.clone());
        }
        drop(link);
        let dmixed = dmixed.ok_or_else(|| missing("the heads' mix's gradient"))?;
        let grads = with_slices(&[&q, &k, &v, &dmixed], |s| {
            self.attention.gradients([s[0], s[1], s[2], s[3]], self.gradients.map(Some))
        })
        .map_err(candle_core::Error::wrap)??;
        let mut kept = Vec::with_capacity(3);
        for ((grad, like), compute) in grads.into_iter().zip([&q, &k, &v]).zip(self.computes) {
            let grad = grad.map(|g| tensor_of(g, like.shape().clone())).transpose()?;
            kept.push(grad.map(|g| gradient_as_read(&g, compute)).transpose()?);
        }
        let mut shared = lock(&self.shared)?;
        for (slot, grad) in shared.gradients.iter_mut().zip(kept) {
            *slot = grad;
        }
        Ok((Some(token.zeros_like()?), dw, db))
    }
}

/// `q`, `k` and `v` as the in ops left them.
fn projected(shared: &Shared) -> Result<[Tensor; 3]> {
    let [q, k, v] = [0, 1, 2].map(|i| shared.projected[i].clone().ok_or_else(|| missing(ROLES[i])));
    Ok([q?, k?, v?])
}

fn off_the_cpu() -> candle_core::Error {
    candle_core::Error::Msg("amp-self-attention: a tensor of the chain is off the CPU".into())
}
