//! The sums over the rows of a matrix, in f32: a Linear's bias gradient.
//!
//! candle reduces over a leading dimension one output element at a time with a strided inner loop;
//! on the CPU amp's kernel ([`amp_kernels::reduce::column_sums`]) streams the rows past a block of
//! f32 accumulators instead (about 6% of the main job's step went to candle's version). Elsewhere
//! candle's `sum(0)` in f32 runs.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

/// `x.sum(0)` in f32 for a matrix `x` `(rows, cols)` of f32, f16 or bf16 (halves widened exactly),
/// in the kernel's fixed order (bands of rows, then the bands' sums). Not differentiable itself (it is
/// used inside backward passes).
pub(crate) fn column_sums(x: &Tensor) -> Result<Tensor> {
    if !x.device().is_cpu() {
        return x.to_dtype(DType::F32)?.sum(0);
    }
    x.contiguous()?.apply_op1_no_bwd(&ColumnSums)
}

struct ColumnSums;

impl CustomOp1 for ColumnSums {
    fn name(&self) -> &'static str {
        "amp-column-sums"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, cols) = layout.shape().dims2()?;
        let src = crate::storage::read_slice(storage, layout).map_err(candle_core::Error::wrap)?;
        let mut out = vec![0f32; cols];
        amp_kernels::reduce::column_sums(src, rows, cols, &mut out);
        Ok((CpuStorage::F32(out), Shape::from(cols)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn agrees_with_candles_sum_over_rows() -> Result<()> {
        let x = Tensor::randn(0f32, 1.0, (37, 300), &Device::Cpu)?;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let x = x.to_dtype(dtype)?;
            let ours = column_sums(&x)?;
            let theirs = x.to_dtype(DType::F32)?.sum(0)?;
            assert_eq!(ours.dims(), &[300]);
            let diff = (ours - theirs)?.abs()?.max(0)?.to_scalar::<f32>()?;
            assert!(diff < 1e-4, "{dtype:?}: {diff}");
        }
        // A transposed view is made contiguous first.
        let t = x.t()?;
        let diff = (column_sums(&t)? - t.sum(0)?)?.abs()?.max(0)?.to_scalar::<f32>()?;
        assert!(diff < 1e-4);
        Ok(())
    }
}
