//! A Linear of a fused chain of ops ([`super::mlp`], [`mod@super::self_attention`]): its operands, and the
//! dtype in which a chain keeps what its products read.

use amp_kernels::{Dtype, GradSlice};
use candle_core::{DType, Device, Result, Tensor};

use super::elementwise::{elements_mut, new_storage, tensor_of};
use super::gemm::{linear_op, LinearOp, Operand};
use crate::Precision;

/// One Linear of a chain: its weight as the product reads it, its bias (none: zeros), its compute
/// precision and its output dtype.
pub(crate) struct Projection<'a> {
    pub weight: &'a Operand,
    pub bias: Option<&'a Tensor>,
    pub compute: Precision,
    pub out: DType,
}

impl Projection<'_> {
    /// The projection's op for `rows` rows of `x_dtype` on `device`, writing `out` (not always the
    /// projection's output dtype: a chain may keep the output as its next product reads it), and its
    /// bias in f32; `None` where the dispatcher does not pick amp's GEMM.
    pub(super) fn op(
        &self,
        (rows, x_dtype, device): (usize, DType, &Device),
        out: DType,
    ) -> Result<Option<(LinearOp, Tensor)>> {
        linear_op((rows, x_dtype, device), self.weight, &self.bias_row(device)?, self.compute, out)
    }

    /// The bias, or for a projection without one, an untracked zero row (no gradient is computed for it).
    fn bias_row(&self, device: &Device) -> Result<Tensor> {
        match self.bias {
            Some(bias) => Ok(bias.clone()),
            None => Tensor::zeros(self.weight.differentiated.dim(0)?, DType::F32, device),
        }
    }

    /// The projection's output features.
    pub(super) fn outputs(&self) -> Result<usize> {
        self.weight.differentiated.dim(0)
    }
}

/// The dtype in which a tensor of dtype `dtype`, or the f32 values it would hold, is kept for products
/// in `compute` to read: the values they read, bit for bit. Those products round an f32 tensor to
/// their compute precision as they read it (stored so rounded, it is read as it is) and read a half
/// one as it is (rounded again where their precision differs: kept as it is).
pub(super) fn as_read(dtype: DType, compute: Precision) -> Dtype {
    match (dtype, compute) {
        (DType::BF16, _) | (DType::F32, Precision::Bf16) => Dtype::Bf16,
        (DType::F16, _) | (DType::F32, Precision::Fp16) => Dtype::F16,
        _ => Dtype::F32,
    }
}

/// candle's name for a kernels' dtype.
pub(super) fn candle_dtype(dtype: Dtype) -> DType {
    match dtype {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::Bf16 => DType::BF16,
    }
}

/// A projection's output gradient `grad` (`(.., features)`) as the projection's backward products read
/// it when they compute in `compute`, with the bias's gradient where that takes a pass of its own: an
/// f32 gradient read in half precision is rounded once, its columns summed from the f32 values in the
/// same pass (what the products and the bias's sum would read, bit for bit: the products then read it
/// as it is, a bf16 A in place on AMX); any other is returned as it is, without sums.
pub(super) fn gradient_as_read(grad: &Tensor, compute: Precision) -> Result<(Tensor, Option<Tensor>)> {
    let kept = as_read(grad.dtype(), compute);
    let features = grad.dims().last().copied().unwrap_or(1);
    if grad.dtype() != DType::F32 || kept == Dtype::F32 || !grad.device().is_cpu() || features == 0 {
        return Ok((grad.clone(), None));
    }
    let grad = grad.contiguous()?;
    let rounded = crate::storage::with_slices(&[&grad], |slices| -> Result<_> {
        let GradSlice::F32(values) = slices[0] else { unreachable!("an f32 tensor's slice") };
        let mut sums = vec![0f32; features];
        let mut rounded = new_storage(kept, values.len(), |_, _| {});
        let dst = elements_mut(&mut rounded, values.len())?;
        amp_kernels::reduce::rounded_with_column_sums(values, dst, features, &mut sums);
        Ok((tensor_of(rounded, grad.shape().clone())?, Tensor::from_vec(sums, features, grad.device())?))
    })
    .map_err(candle_core::Error::wrap)??;
    Ok((rounded.0, Some(rounded.1)))
}
