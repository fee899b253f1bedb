//! Attention's split into heads and merge back, as one op each way on the CPU.
//!
//! With candle's tensor ops, splitting `(batch, t, heads * d)` into `(batch, heads, t, d)` is a reshape,
//! a transpose and a copy: three graph nodes, and candle's backward pass adds the gradient of each into
//! a fresh zero tensor (the transpose's add strided) and copies once more for the reshape. As one op,
//! the backward pass is one permuted copy and one accumulation. Merging is the same permutation the
//! other way. Off the CPU candle's ops run.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// `x` `(batch, t, heads * d)` as `(batch, heads, t, d)`, contiguous.
pub(crate) fn split_heads(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (batch, t, embed) = x.dims3()?;
    if heads == 0 || !embed.is_multiple_of(heads) {
        candle_core::bail!("split_heads: {embed} features do not split into {heads} heads");
    }
    if !x.device().is_cpu() {
        return x.reshape((batch, t, heads, embed / heads))?.transpose(1, 2)?.contiguous();
    }
    x.contiguous()?.apply_op1(Heads::Split { heads })
}

/// `x` `(batch, heads, t, d)` as `(batch, t, heads * d)`, contiguous.
pub(crate) fn merge_heads(x: &Tensor) -> Result<Tensor> {
    let (batch, heads, t, d) = x.dims4()?;
    if !x.device().is_cpu() {
        return x.transpose(1, 2)?.reshape((batch, t, heads * d));
    }
    x.contiguous()?.apply_op1(Heads::Merge)
}

/// The op, with its backward pass the other direction.
#[derive(Clone, Copy, Debug)]
enum Heads {
    Split { heads: usize },
    Merge,
}

impl CustomOp1 for Heads {
    fn name(&self) -> &'static str {
        match self {
            Heads::Split { .. } => "amp-split-heads",
            Heads::Merge => "amp-merge-heads",
        }
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        // Both directions swap the middle two axes of a contiguous (outer, a, b, inner) block.
        let (axes, shape): ([usize; 4], Shape) = match *self {
            Heads::Split { heads } => {
                let (batch, t, embed) = layout.shape().dims3()?;
                let d = embed / heads;
                ([batch, t, heads, d], (batch, heads, t, d).into())
            }
            Heads::Merge => {
                let (batch, heads, t, d) = layout.shape().dims4()?;
                ([batch, heads, t, d], (batch, t, heads * d).into())
            }
        };
        let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg(format!("{}: the input must be contiguous", self.name()))
        })?;
        let out = match storage {
            CpuStorage::F32(v) => CpuStorage::F32(swap_middle_axes(&v[start..end], axes)),
            CpuStorage::F16(v) => CpuStorage::F16(swap_middle_axes(&v[start..end], axes)),
            CpuStorage::BF16(v) => CpuStorage::BF16(swap_middle_axes(&v[start..end], axes)),
            CpuStorage::F64(v) => CpuStorage::F64(swap_middle_axes(&v[start..end], axes)),
            other => {
                let dtype = candle_core::backend::BackendStorage::dtype(other);
                return Err(candle_core::Error::UnsupportedDTypeForOp(dtype, self.name()));
            }
        };
        Ok((out, shape))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let back = match *self {
            Heads::Split { .. } => Heads::Merge,
            Heads::Merge => Heads::Split { heads: arg.dim(1)? },
        };
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&back)?))
    }
}

/// `src` as a contiguous `(outer, a, b, inner)` array, returned as `(outer, b, a, inner)`: each run of
/// `inner` elements copied once, in parallel over the output's `(outer, b)` slabs, into memory never
/// zeroed first.
fn swap_middle_axes<T: Copy + Send + Sync>(src: &[T], [outer, a, b, inner]: [usize; 4]) -> Vec<T> {
    let len = outer * a * b * inner;
    assert_eq!(src.len(), len, "the input holds (outer, a, b, inner) elements");
    let mut dst: Vec<T> = Vec::with_capacity(len);
    let slab = a * inner;
    if slab > 0 {
        dst.spare_capacity_mut()[..len].par_chunks_mut(slab).enumerate().for_each(|(s, out)| {
            let (o, j) = (s / b, s % b);
            for (i, run) in out.chunks_exact_mut(inner).enumerate() {
                let from = &src[((o * a + i) * b + j) * inner..][..inner];
                for (slot, &x) in run.iter_mut().zip(from) {
                    slot.write(x);
                }
            }
        });
    }
    // SAFETY: the slabs cover all `len` elements (`outer * b` slabs of `a * inner`), each written above.
    unsafe { dst.set_len(len) };
    dst
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    /// Forward and backward bit for bit as candle's reshape / transpose / copy chains, in every float
    /// dtype; a transposed (non-contiguous) input too.
    #[test]
    fn agree_with_candles_tensor_ops_forward_and_backward() -> Result<()> {
        let dev = Device::Cpu;
        let (batch, t, heads, d) = (3, 5, 4, 6);
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            let x =
                Var::from_tensor(&Tensor::randn(0f32, 1.0, (batch, t, heads * d), &dev)?.to_dtype(dtype)?)?;
            let r = Tensor::randn(0f32, 1.0, (batch, heads, t, d), &dev)?.to_dtype(dtype)?;

            let ours = split_heads(&x, heads)?;
            let theirs = x.reshape((batch, t, heads, d))?.transpose(1, 2)?.contiguous()?;
            assert_eq!(ours.dims(), theirs.dims());
            let bits = |t: &Tensor| -> Result<Vec<f64>> { t.to_dtype(DType::F64)?.flatten_all()?.to_vec1() };
            assert_eq!(bits(&ours)?, bits(&theirs)?, "{dtype:?} split");
            let (g1, g2) = ((&ours * &r)?.sum_all()?.backward()?, (&theirs * &r)?.sum_all()?.backward()?);
            assert_eq!(bits(g1.get(&x).expect("grad"))?, bits(g2.get(&x).expect("grad"))?);

            let y = Var::from_tensor(&r)?;
            let ours = merge_heads(&y)?;
            let theirs = y.transpose(1, 2)?.reshape((batch, t, heads * d))?;
            assert_eq!(bits(&ours)?, bits(&theirs)?, "{dtype:?} merge");
            let s = Tensor::randn(0f32, 1.0, (batch, t, heads * d), &dev)?.to_dtype(dtype)?;
            let (g1, g2) = ((&ours * &s)?.sum_all()?.backward()?, (&theirs * &s)?.sum_all()?.backward()?);
            assert_eq!(bits(g1.get(&y).expect("grad"))?, bits(g2.get(&y).expect("grad"))?);
        }
        // A non-contiguous input is made contiguous first; a bad head count is refused.
        let x = Tensor::randn(0f32, 1.0, (2, 8, 3), &dev)?.transpose(1, 2)?;
        let theirs = x.reshape((2, 3, 2, 4))?.transpose(1, 2)?.contiguous()?;
        let diff = (split_heads(&x, 2)? - theirs)?.abs()?.sum_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        assert!(split_heads(&x, 3).is_err());
        Ok(())
    }
}
