//! Convolutions on amp's CPU GEMM, as candle ops with a backward pass.
//!
//! Per image, the patches are unfolded into a columns matrix ([`amp_kernels::conv::unfold`], in the
//! compute precision: an f32 input rounded on the way) and one batched product over the groups,
//! `W_g · columns_g`, writes the image's `(out, positions)` block of the result: no transpose of the
//! output, and one image's columns in memory at a time. A 1 x 1 kernel at stride 1 without padding
//! reads the image as its columns. The backward runs the same GEMM:
//! - `dW = sum over images of dY_b · columns_b^T`, the images' products accumulated into one f32 sum
//!   (the columns unfolded again, not kept) and rounded once into the weight's dtype;
//! - `dX_b = fold(W^T · dY_b)`: the columns' gradient in f32, folded back onto the image in f32
//!   ([`amp_kernels::conv::fold`]) and rounded once into the input's dtype.
//!
//! Like [`super::matmul_to`], operands are rounded to the compute precision while packed and products
//! summed in f32, so a bf16 or f16 convolution computes what a half kernel with f32 accumulation
//! does, in the backward too.

use amp_kernels::conv::{fold, unfold, ConvShape};
use amp_kernels::gemm::{gemm_with, Compute, Dims, GemmPath, MatMut, MatRef, Start};
use amp_kernels::GradSlice;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::buffer::Buffer;
use super::gemm::{deposit, is_float, needs_gradient, read_from};
use super::Operand;
use crate::dispatch::{self, compute_of, MatmulKernel};
use crate::Precision;

/// Zero padding, stride and dilation per spatial dimension (`[height, width]`), and the groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ConvParams {
    pub padding: [usize; 2],
    pub stride: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
}

/// `x (batch, in, h, w)` convolved with the weight `(out, in / groups, kh, kw)` on amp's GEMM: operands
/// rounded to `compute` (an f32 `x` while unfolded, the weight while packed), products summed in f32,
/// result `(batch, out, oh, ow)` rounded once into `out`. Each gradient comes back in its operand's
/// dtype: the weight's in f32 when it is an fp32 master read from its working copy
/// ([`Operand::values`]). `None` when the dispatcher does not pick amp's GEMM (not a CPU, candle
/// forced) or a dtype is not a float: the caller then uses candle's convolution.
///
/// # Errors
/// On shapes that do not make a convolution (channels not divisible by the groups, a kernel larger
/// than the padded input, ...), with the reason.
pub(crate) fn conv2d(
    x: &Tensor,
    weight: &Operand,
    params: ConvParams,
    compute: Precision,
    out: DType,
) -> Result<Option<Tensor>> {
    let w = &weight.differentiated;
    let geometry = Geometry::new(params, x.dims(), w.dims())?;
    match dispatch::explain(x.device(), compute, geometry.product()).kernel {
        MatmulKernel::Amp(path) if [x.dtype(), w.dtype(), out].into_iter().all(is_float) => {
            let values = weight.values.clone().filter(|v| v.dims() == w.dims());
            let op = ConvOp { path, compute: compute_of(compute), params, out, values };
            // An f32 input is rounded while it is unfolded; a half one in another precision first.
            let x = if x.dtype() == DType::F32 { x.clone() } else { x.to_dtype(compute.dtype())? };
            Ok(Some(x.contiguous()?.apply_op2(&w.contiguous()?, op)?))
        }
        _ => Ok(None),
    }
}

/// A convolution's sizes, checked: `x (batch, in, h, w)`, `w (out, in / groups, kh, kw)`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Geometry {
    batch: usize,
    outputs: usize,
    groups: usize,
    shape: ConvShape,
    positions: usize,
}

impl Geometry {
    pub(super) fn new(params: ConvParams, x: &[usize], w: &[usize]) -> Result<Geometry> {
        let (&[batch, channels, height, width], &[outputs, per_group, kh, kw]) = (x, w) else {
            return Err(conv_error(format!("input {x:?} and kernel {w:?} must both have rank 4")));
        };
        let groups = params.groups;
        if groups == 0 || channels % groups != 0 || outputs % groups != 0 || per_group * groups != channels {
            return Err(conv_error(format!(
                "input {x:?} and kernel {w:?} with {groups} groups: the input's and the kernel's channels \
                 (dims 1 and 0) must divide by the groups, and the kernel's dim 1 be the input's \
                 channels / groups"
            )));
        }
        let shape = ConvShape {
            channels,
            height,
            width,
            kernel: [kh, kw],
            padding: params.padding,
            stride: params.stride,
            dilation: params.dilation,
        };
        let Some([rows, cols]) = shape.output() else {
            return Err(conv_error(format!(
                "input {x:?}, kernel {w:?}, {params:?}: no output position (the dilated kernel is larger \
                 than the padded input, or a stride or dilation is zero)"
            )));
        };
        Ok(Geometry { batch, outputs, groups, shape, positions: rows * cols })
    }

    /// One group's product for one image: `(out / groups) x positions`, summing `patch / groups`.
    pub(super) fn product(&self) -> Dims {
        Dims::new(self.outputs / self.groups, self.positions, self.group_patch())
    }

    /// A 1 x 1 kernel at stride 1 without padding: the image is its own columns matrix (no unfold),
    /// and the columns' gradient the image's (no fold).
    fn is_pointwise(&self) -> bool {
        let s = &self.shape;
        s.kernel == [1, 1] && s.stride == [1, 1] && s.padding == [0, 0]
    }

    /// The columns matrix of image `b` of `x`: the image itself when pointwise, else unfolded into
    /// `columns`.
    fn columns<'a>(&self, x: GradSlice<'a>, b: usize, columns: &'a mut Buffer) -> Result<GradSlice<'a>> {
        let image = sub(x, b * self.shape.image_len(), self.shape.image_len());
        if self.is_pointwise() {
            return Ok(image);
        }
        unfold(&self.shape, image, columns.as_mut()).map_err(candle_core::Error::wrap)?;
        Ok(columns.as_ref())
    }

    /// A buffer for one image's columns matrix in `dtype` (empty when pointwise).
    fn columns_buffer(&self, dtype: DType) -> Result<Buffer> {
        let len = if self.is_pointwise() { 0 } else { self.shape.patch_len() * self.positions };
        Buffer::zeros(dtype, len)
    }

    /// Rows of the columns matrix per group.
    fn group_patch(&self) -> usize {
        self.shape.patch_len() / self.groups
    }

    /// The groups' products of one image, batched: `dims` with `groups` matrices.
    fn batched(&self, dims: Dims) -> Dims {
        Dims::batched(self.groups, dims.m, dims.n, dims.k)
    }

    /// `(batch, out, output rows, output columns)`.
    pub(super) fn output_shape(&self) -> Shape {
        let [rows, cols] = self.output();
        (self.batch, self.outputs, rows, cols).into()
    }

    /// Output rows and columns ([`Geometry::new`] checked that there are some).
    pub(super) fn output(&self) -> [usize; 2] {
        self.shape.output().unwrap_or_default()
    }
}

pub(super) fn conv_error(message: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("amp conv: {message}"))
}

/// The candle op: `x ⋆ w` per image, one batched GEMM over the groups.
#[derive(Clone, Debug)]
pub(super) struct ConvOp {
    pub path: GemmPath,
    pub compute: Compute,
    pub params: ConvParams,
    /// The result's dtype.
    pub out: DType,
    /// Where the weight's values are read, when not from the weight itself ([`Operand::values`]).
    pub values: Option<Tensor>,
}

impl CustomOp2 for ConvOp {
    fn name(&self) -> &'static str {
        "amp-conv"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = Geometry::new(self.params, l1.dims(), l2.dims())?;
        let x = contiguous(s1, l1)?;
        read_from(self.values.as_ref(), s2, l2, |s2, l2| {
            let w = contiguous(s2, l2)?;
            let block = g.outputs * g.positions;
            let mut y = Buffer::zeros(self.out, g.batch * block)?;
            let mut columns = g.columns_buffer(self.columns_dtype(x))?;
            let one = g.product();
            for b in 0..g.batch {
                let columns = g.columns(x, b, &mut columns)?;
                let a = MatRef::row_major(w, one.k).with_batch_stride(one.m * one.k);
                let b_op = MatRef::row_major(columns, one.n).with_batch_stride(one.k * one.n);
                let c = MatMut::row_major(y.range(b * block, block), one.n).with_batch_stride(one.m * one.n);
                self.gemm(g.batched(one), a, b_op, c, Start::Zero)?;
            }
            Ok((y.into_storage(), g.output_shape()))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let w_read = self.values.as_ref().unwrap_or(w);
        let dx = needs_gradient(x)
            .then(|| {
                let op = ConvInputGradient { op: self.clone(), x: x.dims4()?, dtype: x.dtype() };
                grad.apply_op2_no_bwd(w_read, &op)
            })
            .transpose()?;
        let dw = needs_gradient(w)
            .then(|| {
                let op = ConvWeightGradient { op: self.clone(), w: w.dims4()? };
                x.apply_op2_no_bwd(&grad, &op)?.to_dtype(w.dtype())
            })
            .transpose()?;
        Ok((deposit(x, dx)?, deposit(w, dw)?))
    }
}

impl ConvOp {
    /// The columns matrix's dtype for input `x`: an f32 input is rounded to the compute precision as
    /// it is unfolded; a half input already is in it ([`conv2d`] casts any other).
    fn columns_dtype(&self, x: GradSlice<'_>) -> DType {
        match (x, self.compute) {
            (GradSlice::F32(_), Compute::F16) => DType::F16,
            (GradSlice::F32(_), Compute::Bf16) => DType::BF16,
            (x, _) => dtype_of(x),
        }
    }

    fn gemm(&self, dims: Dims, a: MatRef<'_>, b: MatRef<'_>, c: MatMut<'_>, start: Start<'_>) -> Result<()> {
        gemm_with(self.path, dims, a, b, c, self.compute, start).map_err(candle_core::Error::wrap)
    }
}

/// `dX` from `(dY, W)`: per image, `W_g^T · dY_g` into f32 columns, folded onto the image.
struct ConvInputGradient {
    op: ConvOp,
    /// The input's dims and dtype.
    x: (usize, usize, usize, usize),
    dtype: DType,
}

impl CustomOp2 for ConvInputGradient {
    fn name(&self) -> &'static str {
        "amp-conv-input-gradient"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.op.input_gradient(self.x, self.dtype, (s1, l1), (s2, l2))
    }
}

impl ConvOp {
    /// `dX (x dims, dtype)` from `dY` and `W`: per image, `W_g^T · dY_g` into f32 columns, folded onto
    /// the image and rounded once. Also a transposed convolution's forward
    /// ([`super::conv_transpose2d`]), which is this map.
    pub(super) fn input_gradient(
        &self,
        x: (usize, usize, usize, usize),
        dtype: DType,
        (s1, l1): (&CpuStorage, &Layout),
        (s2, l2): (&CpuStorage, &Layout),
    ) -> Result<(CpuStorage, Shape)> {
        let g = Geometry::new(self.params, &[x.0, x.1, x.2, x.3], l2.dims())?;
        let (dy, w) = (contiguous(s1, l1)?, contiguous(s2, l2)?);
        let (image, block) = (g.shape.image_len(), g.outputs * g.positions);
        if l1.dims() != g.output_shape().dims() {
            return Err(conv_error(format!(
                "the output's gradient is {:?}, the convolution's output {:?}",
                l1.dims(),
                g.output_shape().dims()
            )));
        }
        let mut dx = Buffer::zeros(dtype, g.batch * image)?;
        let mut columns =
            if g.is_pointwise() { Vec::new() } else { vec![0.0f32; g.shape.patch_len() * g.positions] };
        let one = g.product();
        // Per group: (patch x out) · (out x positions); W_g read transposed where it lies.
        let dims = Dims::new(one.k, one.n, one.m);
        for b in 0..g.batch {
            let w_t = MatRef { data: w, row_stride: 1, col_stride: one.k, batch_stride: one.m * one.k };
            let dy_b = MatRef::row_major(sub(dy, b * block, block), one.n).with_batch_stride(one.m * one.n);
            if g.is_pointwise() {
                // The columns' gradient is the image's: written (rounded once) straight into dX.
                let c = MatMut::row_major(dx.range(b * image, image), one.n).with_batch_stride(one.k * one.n);
                self.gemm(g.batched(dims), w_t, dy_b, c, Start::Zero)?;
                continue;
            }
            let c = MatMut::row_major(&mut columns[..], one.n).with_batch_stride(one.k * one.n);
            self.gemm(g.batched(dims), w_t, dy_b, c, Start::Zero)?;
            fold(&g.shape, &columns, dx.range(b * image, image)).map_err(candle_core::Error::wrap)?;
        }
        Ok((dx.into_storage(), Shape::from(x)))
    }
}

/// `dW` (f32) from `(x, dY)`: the images' `dY_g · columns_g^T` summed into one f32 accumulator.
pub(super) struct ConvWeightGradient {
    pub op: ConvOp,
    /// The kernel's dims.
    pub w: (usize, usize, usize, usize),
}

impl CustomOp2 for ConvWeightGradient {
    fn name(&self) -> &'static str {
        "amp-conv-weight-gradient"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let w_dims = [self.w.0, self.w.1, self.w.2, self.w.3];
        let g = Geometry::new(self.op.params, l1.dims(), &w_dims)?;
        let (x, dy) = (contiguous(s1, l1)?, contiguous(s2, l2)?);
        let block = g.outputs * g.positions;
        let mut dw = vec![0.0f32; g.outputs * g.group_patch()];
        let mut columns = g.columns_buffer(self.op.columns_dtype(x))?;
        let one = g.product();
        // Per group: (out x positions) · (positions x patch); the columns read transposed.
        let dims = Dims::new(one.m, one.k, one.n);
        for b in 0..g.batch {
            let columns = g.columns(x, b, &mut columns)?;
            let dy_b = MatRef::row_major(sub(dy, b * block, block), one.n).with_batch_stride(one.m * one.n);
            let columns_t =
                MatRef { data: columns, row_stride: 1, col_stride: one.n, batch_stride: one.k * one.n };
            let c = MatMut::row_major(&mut dw[..], one.k).with_batch_stride(one.m * one.k);
            let start = if b == 0 { Start::Zero } else { Start::Output };
            self.op.gemm(g.batched(dims), dy_b, columns_t, c, start)?;
        }
        Ok((CpuStorage::F32(dw), Shape::from(self.w)))
    }
}

/// A contiguous float tensor's elements.
fn contiguous<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<GradSlice<'a>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(conv_error("operands must be contiguous".into()));
    };
    Ok(match storage {
        CpuStorage::F32(v) => v[start..end].into(),
        CpuStorage::F16(v) => v[start..end].into(),
        CpuStorage::BF16(v) => v[start..end].into(),
        other => {
            return Err(candle_core::Error::UnsupportedDTypeForOp(other.dtype(), "amp conv (f32, f16, bf16)"))
        }
    })
}

/// Elements `start..start + len`.
fn sub(s: GradSlice<'_>, start: usize, len: usize) -> GradSlice<'_> {
    s.split_at(start).1.split_at(len).0
}

fn dtype_of(s: GradSlice<'_>) -> DType {
    match s {
        GradSlice::F32(_) => DType::F32,
        GradSlice::F16(_) => DType::F16,
        GradSlice::Bf16(_) => DType::BF16,
    }
}
