//! A two-layer perceptron, `down(gelu(up(x)))`, as two candle ops that hand the hidden activation to
//! each other outside candle's graph.
//!
//! Written as a Linear with a GELU epilogue and a second Linear ([`super::gemm`]), the hidden activation
//! (`rows x hidden`, the widest tensor of a transformer block) is a node of the graph: it is stored in
//! its activation dtype (f32 under O2) although the down-projection rounds it to its compute precision
//! as it reads it, and candle's backward pass gives it a zero-filled gradient and adds the
//! down-projection's `dX` into it (two passes over `rows x hidden` floats, and a third buffer). Here the
//! up op ([`UpOp`]) keeps GELU's output in the dtype the down-projection's GEMM reads and returns a
//! one-element token in its place; the down op ([`DownOp`]) takes the token as its first argument, so
//! candle runs its backward pass first, and reads the hidden activation from the state the two share.
//! Its backward pass takes the gradient back through GELU and leaves it there for the up op's, in the
//! precision the up-projection's backward products read (bf16 under O2 bf16: half the bytes written
//! and read twice), with the up bias's gradient summed from the f32 values in the same pass
//! ([`amp_kernels::gelu::backward_with_column_sums`]).
//!
//! The values are those of the unfused layers, bit for bit: the stored activation and the stored
//! gradient are the values the GEMMs read either way (the unfused ones round them while packing), the
//! bias gradient is summed in the order [`super::column_sums`] sums, and the gradients pass through the
//! same kernels in the same order, without the zero that candle adds them to.

use std::sync::{Arc, Mutex, MutexGuard};

use amp_kernels::Dtype;
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Storage, Tensor};

use super::elementwise::{elements, new_storage, part, tensor_of};
use super::gelu::{gelu_gradient, gelu_gradient_with_column_sums};
use super::gemm::{needs_gradient, rows_of, LinearOp};
use super::norm_head::{self as chain, normed, Norm, SharedLink};
use super::projection::{as_read, gradient_as_read, Projection};
use crate::Precision;

/// `down(gelu(x up^T + b_up))`, of `norm(x)` where a layer norm is given ([`super::norm_head`]),
/// fused as the module says where the dispatcher picks amp's GEMM for both products; `None` otherwise
/// (the caller runs the layers one by one).
pub(crate) fn gelu_mlp(
    x: &Tensor,
    norm: Option<&Norm<'_>>,
    up: Projection<'_>,
    down: Projection<'_>,
) -> Result<Option<Tensor>> {
    if norm.is_some() && x.dtype() != DType::F32 {
        // The norm's output would be cast to x's dtype between the norm and the up-projection.
        return Ok(None);
    }
    let features = x.dims().last().copied().unwrap_or(0);
    if norm.is_some_and(|n| n.residual) && (down.out != DType::F32 || down.outputs()? != features) {
        // The composition's `x + y` fails on a result of another dtype or width: let it say so.
        return Ok(None);
    }
    let rows = super::rows_before_last(x.dims());
    let device = x.device();
    let Some((up_op, up_bias)) = up.op((rows, x.dtype(), device), up.out)? else {
        return Ok(None);
    };
    let Some((down_op, down_bias)) = down.op((rows, up.out, device), down.out)? else {
        return Ok(None);
    };
    let (first, head) = match norm {
        None => (if x.rank() == 2 { x.clone() } else { x.contiguous()? }, None),
        Some(norm) => {
            let link = SharedLink::default();
            let Some(token) = normed(x, norm, as_read(DType::F32, up.compute), link.clone())? else {
                return Ok(None);
            };
            (token, Some(link))
        }
    };
    let shared = Arc::new(Mutex::new(Shared::default()));
    let hidden_dtype = as_read(up.out, down.compute);
    let up_op = UpOp { linear: up_op, hidden_dtype, head: head.clone(), shared: shared.clone() };
    let token = first.apply_op3(&up.weight.differentiated, &up_bias, up_op)?;
    let gradient_dtype = (up.out, as_read(up.out, up.compute));
    let down_op = DownOp { linear: down_op, gradient_dtype, compute: down.compute, head, shared };
    Ok(Some(token.apply_op3(&down.weight.differentiated, &down_bias, down_op)?))
}

/// What the two ops of one call share.
#[derive(Default)]
struct Shared {
    /// x's dimensions but the last.
    leading: Vec<usize>,
    /// The up-projection's product, GELU's input (in the up-projection's output dtype), for GELU's
    /// slope in the backward pass.
    pre_activation: Option<CpuStorage>,
    /// GELU's output, `rows x hidden`, in the dtype the down-projection's GEMM reads.
    hidden: Option<Tensor>,
    /// The gradient of the up-projection's product, from the down op's backward pass to the up op's, in
    /// the dtype the up-projection's backward products read, and where it is kept rounded from f32,
    /// the f32 values' column sums (the up bias's gradient).
    pre_activation_gradient: Option<(Tensor, Option<Tensor>)>,
}

fn lock(shared: &Mutex<Shared>) -> Result<MutexGuard<'_, Shared>> {
    shared.lock().map_err(|_| candle_core::Error::Msg("amp-mlp: a panic poisoned the shared state".into()))
}

/// An internal error: `what` is not where the other op of the pair leaves it.
fn missing(what: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!("amp-mlp: {what} is missing (the pair's ops ran out of order)"))
}

fn off_the_cpu() -> candle_core::Error {
    candle_core::Error::Msg("amp-mlp: a tensor of the pair is off the CPU".into())
}

/// `(x or a norm's token, W_up, b_up) -> token`: the up-projection and GELU, the activation kept in
/// [`Shared`].
struct UpOp {
    linear: LinearOp,
    hidden_dtype: Dtype,
    /// Where the input is read and its gradient left when a norm's op heads the pair (its first
    /// argument is then the norm's token); `None` when the first argument is x itself.
    head: Option<SharedLink>,
    shared: Arc<Mutex<Shared>>,
}

impl CustomOp3 for UpOp {
    fn name(&self) -> &'static str {
        "amp-mlp-up"
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
        let linked = match &self.head {
            Some(link) => Some(chain::lock(link)?.value.clone().ok_or_else(|| missing("the norm's output"))?),
            None => None,
        };
        let guard = linked.as_ref().map(Tensor::storage_and_layout);
        let (s1, l1) = match &guard {
            Some((guard, layout)) => match &**guard {
                Storage::Cpu(storage) => (storage, *layout),
                _ => return Err(off_the_cpu()),
            },
            None => (s1, l1),
        };
        let (x, [rows, inputs]) = rows_of(s1, l1)?;
        let (product, hidden) = self.linear.product_of_rows((x, [rows, inputs]), (s2, l2), (s3, l3))?;
        let len = rows * hidden;
        let z = elements(&product, &Layout::contiguous(len))?;
        let activation =
            new_storage(self.hidden_dtype, len, |at, y| amp_kernels::gelu::forward(part(z, at, y.len()), y));
        let mut shared = lock(&self.shared)?;
        shared.leading = l1.dims()[..l1.dims().len() - 1].to_vec();
        shared.hidden = Some(tensor_of(activation, (rows, hidden))?);
        shared.pre_activation = Some(product);
        Ok((CpuStorage::F32(vec![0.0]), Shape::from(1)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: &Tensor,
        _token: &Tensor,
        _token_grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // Taken, not kept: the down op's backward pass leaves it again before each pass reaches this one.
        let (grad, summed) = lock(&self.shared)?
            .pre_activation_gradient
            .take()
            .ok_or_else(|| missing("the hidden activation's gradient"))?;
        let Some(link) = &self.head else {
            let dx_dtype = needs_gradient(x).then_some(x.dtype());
            let (dx, dw, db) = self.linear.gradients((x, dx_dtype), w, (bias, summed), &grad)?;
            return Ok((super::gemm::deposit(x, dx)?, dw, db));
        };
        // The norm's output's gradient (f32, the output's dtype in the composition), for its op.
        let normed = chain::lock(link)?.value.clone().ok_or_else(|| missing("the norm's output"))?;
        let (dx, dw, db) = self.linear.gradients((&normed, Some(DType::F32)), w, (bias, summed), &grad)?;
        chain::lock(link)?.gradient = dx;
        Ok((Some(x.zeros_like()?), dw, db))
    }
}

/// `(token, W_down, b_down) -> y`: the down-projection of the activation in [`Shared`].
struct DownOp {
    linear: LinearOp,
    /// The dtypes of the hidden activation's gradient, the unfused activation's (the up-projection's
    /// output dtype), and of the up-projection's product's, as the up-projection's backward products
    /// read it.
    gradient_dtype: (DType, Dtype),
    /// The down-projection's compute precision.
    compute: Precision,
    /// The norm's link where a norm's op heads the pair: the result adds its input where it holds one
    /// (a residual sublayer).
    head: Option<SharedLink>,
    shared: Arc<Mutex<Shared>>,
}

impl CustomOp3 for DownOp {
    fn name(&self) -> &'static str {
        "amp-mlp-down"
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
        let shared = lock(&self.shared)?;
        let hidden = shared.hidden.as_ref().ok_or_else(|| missing("the hidden activation"))?;
        let (guard, layout) = hidden.storage_and_layout();
        let Storage::Cpu(storage) = &*guard else { return Err(off_the_cpu()) };
        let (h, dims) = rows_of(storage, layout)?;
        let (mut y, outputs) = self.linear.product_of_rows((h, dims), (s2, l2), (s3, l3))?;
        if let Some(link) = &self.head {
            chain::lock(link)?.add_residual(&mut y)?;
        }
        let mut shape = shared.leading.clone();
        shape.push(outputs);
        Ok((y, shape.into()))
    }

    fn bwd(
        &self,
        token: &Tensor,
        w: &Tensor,
        bias: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let hidden = lock(&self.shared)?.hidden.clone().ok_or_else(|| missing("the hidden activation"))?;
        let (dh_dtype, dz_dtype) = self.gradient_dtype;
        let wanted = needs_gradient(token).then_some(dh_dtype);
        // The result's gradient as the down-projection's two backward products read it, the bias's
        // summed.
        let (grad_read, summed) = gradient_as_read(grad, self.compute)?;
        let (dh, dw, db) = self.linear.gradients((&hidden, wanted), w, (bias, summed), &grad_read)?;
        if let Some(link) = &self.head {
            let mut link = chain::lock(link)?;
            if link.residual.is_some() {
                // The residual's share of x's gradient, for the norm's op.
                link.residual_gradient = Some(grad.clone());
            }
        }
        let Some(dh) = dh else { return Ok((None, dw, db)) };
        // Back through GELU, for the up op's backward pass, which candle runs next (it takes the token).
        let mut shared = lock(&self.shared)?;
        let z = shared.pre_activation.as_ref().ok_or_else(|| missing("the pre-activation"))?;
        let width = dh.dims().last().copied().unwrap_or(1);
        let (dz, summed) = {
            let (guard, layout) = dh.storage_and_layout();
            let Storage::Cpu(dh_storage) = &*guard else { return Err(off_the_cpu()) };
            if dh_dtype == DType::F32 {
                // The up bias's gradient summed from the f32 values, as the unfused layer sums its
                // f32 gradient, while the gradient is kept as its products read it.
                let (dz, sums) = gelu_gradient_with_column_sums(z, dh_storage, layout, dz_dtype, width)?;
                (dz, Some(Tensor::from_vec(sums, width, &Device::Cpu)?))
            } else {
                (gelu_gradient(z, dh_storage, layout)?, None)
            }
        };
        shared.pre_activation_gradient = Some((tensor_of(dz, dh.shape().clone())?, summed));
        Ok((Some(token.zeros_like()?), dw, db))
    }
}
