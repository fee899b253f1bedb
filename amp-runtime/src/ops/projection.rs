//! A Linear of a fused chain of ops ([`super::mlp`], [`mod@super::self_attention`]): its operands, and the
//! dtype in which a chain keeps what its products read.

use amp_kernels::Dtype;
use candle_core::{DType, Device, Result, Tensor};

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
