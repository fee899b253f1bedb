//! Matrix products routed by [`crate::dispatch`]: amp's CPU GEMM as a candle op with a backward pass,
//! or candle's matmul.
//!
//! The op reads its operands in place through their strides (a transposed weight, a broadcast batch),
//! rounds them to the compute precision while packing, sums in f32 and writes the requested output
//! dtype once. Its backward runs the same GEMM: `dA = dC·B^T` and `dB = A^T·dC`, each written in its
//! operand's dtype, with `dC` rounded to the compute precision as the forward's operands were; the
//! gradients of variables go to [`crate::gradient_sink`] when amp runs the backward pass.

use amp_kernels::gemm::{
    gemm_new, gemm_new_streamed, gemm_with, Compute, Dims, GemmPath, MatMut, MatRef, NewOutput, OutputType,
    Start,
};
use amp_kernels::GradSliceMut;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use std::sync::{Arc, Mutex, MutexGuard};

use super::padded::candle_product;
use crate::dispatch::{self, compute_of, MatmulKernel};
use crate::{gradient_sink, Precision};

/// `a @ b` (shapes `(.., m, k)` and `(.., k, n)`, batch dimensions broadcast) with the operands rounded
/// to `compute`, products summed in f32, result `(.., m, n)` in `out`.
///
/// # Errors
/// On mismatched shapes, or dtypes the kernel does not take (candle's error).
pub fn matmul_to(a: &Tensor, b: &Tensor, compute: Precision, out: DType) -> Result<Tensor> {
    product_to(a, &Operand::of(b), compute, out)
}

/// A product's `b` operand: the tensor backward differentiates, and the tensor of the same shape whose
/// values the product reads when they are stored apart (the half working copy of an fp32 master: the
/// master rounded to the compute precision, half the bytes to read).
#[derive(Clone, Debug)]
pub(crate) struct Operand {
    pub differentiated: Tensor,
    pub values: Option<Tensor>,
}

impl Operand {
    /// An operand read where it is differentiated.
    pub fn of(t: &Tensor) -> Self {
        Operand { differentiated: t.clone(), values: None }
    }

    /// The operand with a dimension of size 1 inserted at `dim`.
    pub fn unsqueeze(&self, dim: usize) -> Result<Self> {
        Ok(Operand {
            differentiated: self.differentiated.unsqueeze(dim)?,
            values: self.values.as_ref().map(|v| v.unsqueeze(dim)).transpose()?,
        })
    }

    /// The operand transposed (its last two dimensions).
    pub fn t(&self) -> Result<Self> {
        Ok(Operand {
            differentiated: self.differentiated.t()?,
            values: self.values.as_ref().map(Tensor::t).transpose()?,
        })
    }
}

/// [`matmul_to`] with `b` read from [`Operand::values`] where given.
pub(crate) fn product_to(a: &Tensor, b: &Operand, compute: Precision, out: DType) -> Result<Tensor> {
    let b_values = match &b.values {
        Some(values)
            if values.dims() == b.differentiated.dims() && values.device().same_device(a.device()) =>
        {
            Some(values)
        }
        _ => None,
    };
    let b = &b.differentiated;
    let (a, b) = broadcast_batch(a, b)?;
    let dims = dims_of(&a, &b)?;
    let choice = dispatch::explain(a.device(), compute, dims);
    match choice.kernel {
        MatmulKernel::Amp(path) if is_float(a.dtype()) && is_float(b.dtype()) && is_float(out) => {
            let b_values = if b.rank() == 2 { b_values.cloned() } else { None };
            gemm_op(&a, &b, GemmOp { path, compute: compute_of(compute), out, b_values })
        }
        _ => candle_product(&a, &b, compute, out, choice.padded),
    }
}

/// What a Linear's op does to the product before returning it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Epilogue {
    /// `x W^T + b`.
    Identity,
    /// `relu(x W^T + b)`, clamped in place on the product; the backward masks the gradient by the
    /// output first ([`super::relu()`]).
    Relu,
    /// `gelu(x W^T + b)` ([`super::gelu()`]), from the product while it is in cache; the op keeps the
    /// product (as a separate GELU's node would keep its input) and the backward turns the gradient
    /// into the product's first, without a graph node or a zero-filled sum in between.
    Gelu,
}

/// `x W^T + b` for `x` `(.., in)`, `weight` `(out, in)` and `bias` `(out)` (zeros for a Linear
/// without bias: an untracked tensor gets no gradient): one GEMM over the rows of `x` (its leading
/// dimensions folded by the op, a contiguous `x` read in place) that starts every row from the bias
/// (added in f32, rounded once with the sum into `out`), then the epilogue; the result is `(.., out)`.
/// Its backward runs two GEMMs and sums the bias gradient in f32. `None` when the dispatcher does not
/// pick amp's GEMM.
pub(crate) fn linear_bias(
    x: &Tensor,
    weight: &Operand,
    bias: &Tensor,
    compute: Precision,
    out: DType,
    epilogue: Epilogue,
) -> Result<Option<Tensor>> {
    let rows = super::rows_before_last(x.dims());
    let Some((op, bias)) = linear_op((rows, x.dtype(), x.device()), weight, bias, compute, out)? else {
        return Ok(None);
    };
    let op = LinearOp { epilogue, ..op };
    // A matrix is read through its strides; more dimensions are folded, in place when contiguous.
    let x = if x.rank() == 2 { x.clone() } else { x.contiguous()? };
    Ok(Some(x.apply_op3(&weight.differentiated, &bias, op)?))
}

/// The op of a Linear without epilogue, and its bias in f32, when the dispatcher picks amp's GEMM for
/// `x W^T + b` with `rows` rows of x of `x_dtype` on `device`; `None` otherwise.
pub(super) fn linear_op(
    (rows, x_dtype, device): (usize, DType, &candle_core::Device),
    weight: &Operand,
    bias: &Tensor,
    compute: Precision,
    out: DType,
) -> Result<Option<(LinearOp, Tensor)>> {
    let w = &weight.differentiated;
    let (outputs, inputs) = w.dims2()?;
    match dispatch::explain(device, compute, Dims::new(rows, outputs, inputs)).kernel {
        MatmulKernel::Amp(path) if [x_dtype, w.dtype(), out].into_iter().all(is_float) => {
            let bias = bias.to_dtype(DType::F32)?.contiguous()?;
            let gemm = GemmOp { path, compute: compute_of(compute), out, b_values: None };
            let values = weight.values.clone().filter(|v| v.dims() == w.dims());
            let op = LinearOp { gemm, values, epilogue: Epilogue::Identity, pre_activation: Arc::default() };
            Ok(Some((op, bias)))
        }
        _ => Ok(None),
    }
}

pub(super) fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// The product's sizes (batch dimensions folded).
fn dims_of(a: &Tensor, b: &Tensor) -> Result<Dims> {
    let (ad, bd) = (a.dims(), b.dims());
    if ad.len() < 2
        || ad.len() != bd.len()
        || ad[..ad.len() - 2] != bd[..bd.len() - 2]
        || ad[ad.len() - 1] != bd[bd.len() - 2]
    {
        return Err(candle_core::Error::ShapeMismatchBinaryOp {
            lhs: a.shape().clone(),
            rhs: b.shape().clone(),
            op: "matmul",
        });
    }
    let r = ad.len();
    Ok(Dims { batch: ad[..r - 2].iter().product(), m: ad[r - 2], k: ad[r - 1], n: bd[r - 1] })
}

/// Both operands with the same batch dimensions (numpy rules), as views where possible.
fn broadcast_batch(a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    let (ar, br) = (a.rank(), b.rank());
    if ar < 2 || br < 2 {
        return Err(candle_core::Error::ShapeMismatchBinaryOp {
            lhs: a.shape().clone(),
            rhs: b.shape().clone(),
            op: "matmul",
        });
    }
    let rank = ar.max(br);
    let batch_of = |t: &Tensor| -> Vec<usize> {
        let d = t.dims();
        let mut v = vec![1; rank - t.rank()];
        v.extend_from_slice(&d[..d.len() - 2]);
        v
    };
    let (ab, bb) = (batch_of(a), batch_of(b));
    let mut batch = Vec::with_capacity(rank - 2);
    for (&x, &y) in ab.iter().zip(&bb) {
        match (x, y) {
            _ if x == y => batch.push(x),
            (1, _) => batch.push(y),
            (_, 1) => batch.push(x),
            _ => {
                return Err(candle_core::Error::ShapeMismatchBinaryOp {
                    lhs: a.shape().clone(),
                    rhs: b.shape().clone(),
                    op: "matmul",
                })
            }
        }
    }
    let expand = |t: &Tensor| -> Result<Tensor> {
        let d = t.dims();
        let mut shape = batch.clone();
        shape.extend_from_slice(&d[d.len() - 2..]);
        if shape == d {
            Ok(t.clone())
        } else {
            t.broadcast_as(shape)
        }
    };
    Ok((expand(a)?, expand(b)?))
}

/// Applies the GEMM op; batch dimensions beyond one are folded first (a copy only when they cannot be
/// folded in place).
fn gemm_op(a: &Tensor, b: &Tensor, op: GemmOp) -> Result<Tensor> {
    let rank = a.rank();
    if rank <= 3 {
        return a.apply_op2(b, op);
    }
    let fold = |t: &Tensor| -> Result<Tensor> {
        let d = t.dims();
        t.reshape((d[..rank - 2].iter().product::<usize>(), d[rank - 2], d[rank - 1]))
    };
    let y = fold(a)?.apply_op2(&fold(b)?, op)?;
    let mut shape = a.dims()[..rank - 1].to_vec();
    shape.push(b.dim(rank - 1)?);
    y.reshape(shape)
}

/// The candle op: one amp GEMM, with a backward pass of two more.
#[derive(Clone, Debug)]
struct GemmOp {
    path: GemmPath,
    compute: Compute,
    out: DType,
    /// Where `b`'s values are read, when not from `b` itself (a rank-2 tensor of `b`'s shape).
    b_values: Option<Tensor>,
}

/// An operand's elements and strides, from its storage and layout (rank 2 or 3).
fn operand<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<(MatRef<'a>, usize, [usize; 2])> {
    let (dims, strides, start) = (layout.dims(), layout.stride(), layout.start_offset());
    let data: amp_kernels::GradSlice<'a> = match storage {
        CpuStorage::F32(v) => v[start..].into(),
        CpuStorage::F16(v) => v[start..].into(),
        CpuStorage::BF16(v) => v[start..].into(),
        other => {
            return Err(candle_core::Error::UnsupportedDTypeForOp(
                other.dtype(),
                "amp gemm (f32, f16, bf16)",
            ));
        }
    };
    let r = dims.len();
    let (batch, batch_stride) = if r == 3 { (dims[0], strides[0]) } else { (1, 0) };
    let view = MatRef { data, row_stride: strides[r - 2], col_stride: strides[r - 1], batch_stride };
    Ok((view, batch, [dims[r - 2], dims[r - 1]]))
}

/// Runs `f` on the CPU storage and layout of `values` when given, else on `storage` and `layout`.
pub(super) fn read_from<R>(
    values: Option<&Tensor>,
    storage: &CpuStorage,
    layout: &Layout,
    f: impl FnOnce(&CpuStorage, &Layout) -> Result<R>,
) -> Result<R> {
    let Some(values) = values else { return f(storage, layout) };
    let (guard, layout) = values.storage_and_layout();
    match &*guard {
        candle_core::Storage::Cpu(storage) => f(storage, layout),
        _ => Err(candle_core::Error::Msg("amp gemm: operand values off the CPU".into())),
    }
}

impl GemmOp {
    /// The op for one of this op's backward products: output `out`, operands read where they are.
    fn backward(&self, out: DType) -> GemmOp {
        GemmOp { path: self.path, compute: self.compute, out, b_values: None }
    }

    /// `bias + A·B` into new storage of the output dtype ([`new_product`]).
    fn product(&self, dims: Dims, a: MatRef<'_>, b: MatRef<'_>, bias: Option<&[f32]>) -> Result<CpuStorage> {
        new_product((self.path, self.compute), self.out, dims, a, b, bias)
    }
}

/// `bias + A·B` on `path` in `compute` into new storage of `out` (f32 unless f16 / bf16 was asked for),
/// written once (never zeroed first).
pub(super) fn new_product(
    (path, compute): (GemmPath, Compute),
    out: DType,
    dims: Dims,
    a: MatRef<'_>,
    b: MatRef<'_>,
    bias: Option<&[f32]>,
) -> Result<CpuStorage> {
    let c = gemm_new(path, dims, a, b, output_type(out), compute, bias).map_err(candle_core::Error::wrap)?;
    Ok(storage_of(c))
}

/// The type of a new C for output dtype `out`: f16, bf16, else f32.
pub(super) fn output_type(out: DType) -> OutputType {
    match out {
        DType::F16 => OutputType::F16,
        DType::BF16 => OutputType::Bf16,
        _ => OutputType::F32,
    }
}

/// A new C as candle's storage.
pub(super) fn storage_of(c: NewOutput) -> CpuStorage {
    match c {
        NewOutput::F32(v) => CpuStorage::F32(v),
        NewOutput::F16(v) => CpuStorage::F16(v),
        NewOutput::Bf16(v) => CpuStorage::BF16(v),
    }
}

impl CustomOp2 for GemmOp {
    fn name(&self) -> &'static str {
        "amp-gemm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (a, batch, [m, k]) = operand(s1, l1)?;
        read_from(self.b_values.as_ref(), s2, l2, |s2, l2| {
            let (b, _, [_, n]) = operand(s2, l2)?;
            let storage = self.product(Dims { batch, m, n, k }, a, b, None)?;
            let shape: Shape = if l1.dims().len() == 3 { (batch, m, n).into() } else { (m, n).into() };
            Ok((storage, shape))
        })
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let b_read = self.b_values.as_ref().unwrap_or(b);
        let da =
            needs_gradient(a).then(|| grad.apply_op2(&b_read.t()?, self.backward(a.dtype()))).transpose()?;
        let db = needs_gradient(b).then(|| a.t()?.apply_op2(grad, self.backward(b.dtype()))).transpose()?;
        Ok((deposit(a, da)?, deposit(b, db)?))
    }
}

/// Whether backward must compute `t`'s gradient: `t` is a variable or was computed from one. An input
/// that is neither (a batch of data) gets none, as in PyTorch, where candle's own ops compute and store
/// one anyway: for a model's first layer that is a whole product (`dX = dY W`) and a zero-filled sum
/// of its size, for nothing.
pub(super) fn needs_gradient(t: &Tensor) -> bool {
    t.track_op()
}

/// Hands a computed gradient to [`gradient_sink::deposit`]; `None` stays `None`.
pub(super) fn deposit(arg: &Tensor, grad: Option<Tensor>) -> Result<Option<Tensor>> {
    grad.map_or(Ok(None), |grad| gradient_sink::deposit(arg, grad))
}

/// The candle op of a Linear: `x W^T + b` with the bias as the GEMM's starting row (an untracked zero
/// row for a Linear without bias), then the epilogue.
#[derive(Clone, Debug)]
pub(super) struct LinearOp {
    gemm: GemmOp,
    /// Where the weight's values are read, when not from the weight itself ([`Operand::values`]).
    values: Option<Tensor>,
    epilogue: Epilogue,
    /// The product before a GELU epilogue, kept by the forward for the backward.
    pre_activation: Arc<Mutex<Option<CpuStorage>>>,
}

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "amp-linear"
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
        let (x, [rows, inputs]) = rows_of(s1, l1)?;
        let (mut storage, outputs) = self.product_of_rows((x, [rows, inputs]), (s2, l2), (s3, l3))?;
        match self.epilogue {
            Epilogue::Identity => {}
            Epilogue::Relu => super::relu::relu_in_place(&mut storage)?,
            Epilogue::Gelu => {
                let y = super::gelu::gelu_of(&storage, rows * outputs)?;
                *lock(&self.pre_activation)? = Some(storage);
                storage = y;
            }
        }
        let mut shape = l1.dims().to_vec();
        *shape.last_mut().expect("a matrix at least") = outputs;
        Ok((storage, shape.into()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let masked;
        let grad = match self.epilogue {
            Epilogue::Identity => grad,
            Epilogue::Relu => {
                masked = super::relu::relu_backward(res, grad)?;
                &masked
            }
            Epilogue::Gelu => {
                masked = grad
                    .contiguous()?
                    .apply_op1_no_bwd(&GeluEpilogueGradient(self.pre_activation.clone()))?;
                &masked
            }
        };
        let (dx, dw, db) =
            self.gradients((x, needs_gradient(x).then_some(x.dtype())), w, (bias, None), grad)?;
        Ok((deposit(x, dx)?, dw, db))
    }
}

impl LinearOp {
    /// `bias + x W^T` for `x`, a matrix of `rows x inputs`, with the weight and the bias from their
    /// storages and layouts: the product in new storage of the output dtype, and its columns.
    pub(super) fn product_of_rows(
        &self,
        (x, [rows, inputs]): (MatRef<'_>, [usize; 2]),
        (s2, l2): (&CpuStorage, &Layout),
        (s3, l3): (&CpuStorage, &Layout),
    ) -> Result<(CpuStorage, usize)> {
        let bias = super::elementwise::f32_elements(s3, l3, "amp-linear's bias")?;
        read_from(self.values.as_ref(), s2, l2, |s2, l2| {
            let (w, _, [outputs, _]) = operand(s2, l2)?;
            // The weight (out, in) read as the (in, out) operand: its strides swapped.
            let w_t = MatRef { row_stride: w.col_stride, col_stride: w.row_stride, ..w };
            Ok((self.gemm.product(Dims::new(rows, outputs, inputs), x, w_t, Some(bias))?, outputs))
        })
    }

    /// The gradients of `x W^T + b` from the product's gradient `grad`: x's in the dtype asked for
    /// (none when `None`), the weight's and the bias's where they need one, those two handed to the
    /// gradient sink ([`deposit`]). The bias's is `grad`'s column sums, or `summed` where the caller
    /// has them already (from `grad`'s f32 values, where `grad` is kept rounded to half).
    pub(super) fn gradients(
        &self,
        (x, dx_dtype): (&Tensor, Option<DType>),
        w: &Tensor,
        (bias, summed): (&Tensor, Option<Tensor>),
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The rows of x and of the gradient as matrices (x is a matrix or contiguous: views).
        let (grad, x_rows) = (as_rows(grad)?, as_rows(&x.detach())?);
        let w_read = self.values.as_ref().unwrap_or(w);
        let dx = dx_dtype
            .map(|dtype| grad.apply_op2_no_bwd(w_read, &self.gemm.backward(dtype))?.reshape(x.dims()))
            .transpose()?;
        // Added into a running sum only where the gradient would be f32 anyway (a half weight's is
        // rounded to half first: `GradientRoute::Working`, sharded masters).
        let added = match gradient_sink::sum_for(w) {
            Some(sum) if needs_gradient(w) && w.dtype() == DType::F32 => {
                self.add_weight_gradient(&grad, &x_rows, &sum)?
            }
            _ => false,
        };
        let streamed = if needs_gradient(w) && !added {
            self.streamed_weight_gradient(&grad, &x_rows, w)?
        } else {
            None
        };
        let dw = match streamed {
            Some((dw, all_finite)) => gradient_sink::deposit_checked(w, dw, all_finite)?,
            None => {
                let dw = (needs_gradient(w) && !added)
                    .then(|| grad.t()?.apply_op2_no_bwd(&x_rows, &self.gemm.backward(w.dtype())))
                    .transpose()?;
                deposit(w, dw)?
            }
        };
        let db = needs_gradient(bias)
            .then(|| summed.map_or_else(|| super::column_sums::column_sums(&grad), Ok))
            .transpose()?;
        Ok((dx, dw, deposit(bias, db)?))
    }

    /// `grad^T x_rows`, an f32 weight's gradient, written past the caches (the optimizer reads it after
    /// the whole backward pass: [`amp_kernels::gemm::gemm_new_streamed`]) and checked for infinities and
    /// NaNs as it is written, with whether it is all finite; `None` where the operands do not allow it
    /// (a half weight, whose gradient is rounded to half, or operands off the CPU or not contiguous) or
    /// it does not pay: on the FMA paths a product is bound by its FMAs, not by writing C, and the copy
    /// through a scratch block only costs. Measured on a Xeon (AMX), the MLP bench's model stepped alone,
    /// old and new builds alternated, three pairs: the bf16 O2 step's backward and optimizer 9.7 -> 8.8
    /// ms (AMX); the fp32 step's 20.2 / 21.3 -> 20.5 / 21.6 ms with its products streamed too.
    fn streamed_weight_gradient(
        &self,
        grad: &Tensor,
        x_rows: &Tensor,
        w: &Tensor,
    ) -> Result<Option<(Tensor, bool)>> {
        if !self.gemm.path.is_bf16_dot() {
            return Ok(None);
        }
        let (path, compute) = (self.gemm.path, self.gemm.compute);
        with_weight_gradient_operands(grad, x_rows, w, |dims, dy_t, x| {
            let (dw, all_finite) =
                gemm_new_streamed(path, dims, dy_t, x, compute, None).map_err(candle_core::Error::wrap)?;
            Ok((Tensor::from_vec(dw, (dims.m, dims.n), &candle_core::Device::Cpu)?, all_finite))
        })
    }

    /// `sum += grad^T x_rows`, the weight's gradient added by the GEMM into the running sum the pass
    /// was given for it (`C += A·B`: the sum is C's start), when the operands allow it: an f32 sum of
    /// the weight's shape and contiguous operands on the CPU. Returns whether it was added.
    fn add_weight_gradient(&self, grad: &Tensor, x_rows: &Tensor, sum: &Tensor) -> Result<bool> {
        if !(sum.device().is_cpu() && sum.is_contiguous()) {
            return Ok(false);
        }
        let (path, compute) = (self.gemm.path, self.gemm.compute);
        let added = with_weight_gradient_operands(grad, x_rows, sum, |dims, dy_t, x| {
            let added = crate::storage::with_all_mut(&[sum], |sums| match &mut sums[0] {
                GradSliceMut::F32(c) => {
                    let c = MatMut::row_major(&mut c[..], dims.n);
                    gemm_with(path, dims, dy_t, x, c, compute, Start::Output)
                        .map_err(candle_core::Error::wrap)
                }
                _ => Err(candle_core::Error::Msg("amp-linear: a gradient sum that is not f32".into())),
            });
            added.map_err(candle_core::Error::wrap)?
        })?;
        Ok(added.is_some())
    }
}

/// Runs `product` on the operands of a weight's gradient `grad^T x_rows` on the CPU: its dims, `dY^T`
/// (dY's rows read as columns) and x's rows; `None` where the gradient would not be an f32 one of
/// `like`'s shape, or `grad` or `x_rows` is off the CPU or not contiguous.
fn with_weight_gradient_operands<R>(
    grad: &Tensor,
    x_rows: &Tensor,
    like: &Tensor,
    product: impl FnOnce(Dims, MatRef<'_>, MatRef<'_>) -> Result<R>,
) -> Result<Option<R>> {
    let (rows, outputs) = grad.dims2()?;
    let inputs = x_rows.dim(1)?;
    let fits = like.dtype() == DType::F32
        && like.dims() == [outputs, inputs]
        && [grad, x_rows].iter().all(|t| t.device().is_cpu() && t.is_contiguous());
    if !fits {
        return Ok(None);
    }
    let result = crate::storage::with_slices(&[grad, x_rows], |operands| {
        let dy_t = MatRef { data: operands[0], row_stride: 1, col_stride: outputs, batch_stride: 0 };
        let x = MatRef::row_major(operands[1], inputs);
        product(Dims::new(outputs, inputs, rows), dy_t, x)
    });
    result.map_err(candle_core::Error::wrap)?.map(Some)
}

/// `t` `(.., cols)` as a matrix `(rows, cols)`: `t` itself when it is one, else a reshape (a view when
/// contiguous).
fn as_rows(t: &Tensor) -> Result<Tensor> {
    if t.rank() == 2 {
        return Ok(t.clone());
    }
    let cols = t.dims().last().copied().unwrap_or(1);
    t.reshape((super::rows_before_last(t.dims()), cols))
}

/// A Linear's input `(.., in)` as the matrix of its rows: a matrix through its strides, more
/// dimensions folded when contiguous.
pub(super) fn rows_of<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<(MatRef<'a>, [usize; 2])> {
    if layout.dims().len() == 2 {
        let (view, _, dims) = operand(storage, layout)?;
        return Ok((view, dims));
    }
    let Some((start, _)) = layout.contiguous_offsets() else {
        return Err(candle_core::Error::RequiresContiguous { op: "amp-linear" });
    };
    let cols = layout.dims().last().copied().unwrap_or(1);
    let rows = super::rows_before_last(layout.dims());
    let folded = Layout::contiguous_with_offset((rows, cols), start);
    let (view, _, dims) = operand(storage, &folded)?;
    Ok((view, dims))
}

/// The kept product of a GELU epilogue.
fn lock(kept: &Mutex<Option<CpuStorage>>) -> Result<MutexGuard<'_, Option<CpuStorage>>> {
    kept.lock().map_err(|_| candle_core::Error::Msg("amp-linear: a panic poisoned the kept product".into()))
}

/// The gradient of a GELU epilogue's input (the product) from its output's: `dy * gelu'(product)`.
struct GeluEpilogueGradient(Arc<Mutex<Option<CpuStorage>>>);

impl CustomOp1 for GeluEpilogueGradient {
    fn name(&self) -> &'static str {
        "amp-linear-gelu-backward"
    }

    fn cpu_fwd(&self, dy: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let kept = lock(&self.0)?;
        let product =
            kept.as_ref().ok_or_else(|| candle_core::Error::Msg("amp-linear: no kept product".into()))?;
        Ok((super::gelu::gelu_gradient(product, dy, layout)?, layout.shape().clone()))
    }
}
