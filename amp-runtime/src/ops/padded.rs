//! candle's matmul on operands zero-padded to the tensor cores' step
//! ([`crate::dispatch::pad_for_tensor_cores`]).

use amp_kernels::gemm::Dims;
use candle_core::{DType, Result, Tensor};

use crate::Precision;

/// `a @ b` by candle's matmul in `compute`'s dtype, result in `out`; on operands zero-padded to
/// `padded`'s sizes where given ([`crate::dispatch::Choice::padded`]).
pub(super) fn candle_product(
    a: &Tensor,
    b: &Tensor,
    compute: Precision,
    out: DType,
    padded: Option<Dims>,
) -> Result<Tensor> {
    let dtype = compute.dtype();
    let (a, b) = (a.to_dtype(dtype)?, b.to_dtype(dtype)?);
    let c = match padded {
        Some(padded) => padded_matmul(&a, &b, padded)?,
        None => a.matmul(&b)?,
    };
    c.to_dtype(out)
}

/// `a @ b` (`(.., m, k)` and `(.., k, n)`, the same batch dimensions) with `a` zero-padded to
/// `(.., padded.m, padded.k)` and `b` to `(.., padded.k, padded.n)`, the result cut back to
/// `(.., m, n)`. Every term the padding adds is a product with zero, so each sum has the product's own
/// terms (a sum of -0 aside, which becomes +0; cuBLAS may add them in another order for the padded
/// shape); candle's autograd takes gradients back through the padding.
fn padded_matmul(a: &Tensor, b: &Tensor, padded: Dims) -> Result<Tensor> {
    let rank = a.rank();
    let (rows, inner) = (rank - 2, rank - 1);
    let (m, k, n) = (a.dim(rows)?, a.dim(inner)?, b.dim(inner)?);
    let a = a.pad_with_zeros(rows, 0, padded.m - m)?.pad_with_zeros(inner, 0, padded.k - k)?;
    let b = b.pad_with_zeros(rows, 0, padded.k - k)?.pad_with_zeros(inner, 0, padded.n - n)?;
    a.matmul(&b)?.narrow(rows, 0, m)?.narrow(inner, 0, n)
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    fn values(t: &Tensor) -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
    }

    /// The padded product and both its gradients are the unpadded ones, bit for bit, for single and
    /// batched products and every dimension padded or not.
    #[test]
    fn padding_changes_neither_the_product_nor_its_gradients() -> Result<()> {
        let dev = Device::Cpu;
        for (batch, m, k, n, padded) in [
            (vec![], 5, 13, 7, Dims::new(8, 8, 16)),
            (vec![], 16, 3, 24, Dims::new(16, 24, 8)),
            (vec![2, 3], 9, 8, 10, Dims::batched(6, 16, 16, 8)),
        ] {
            let shape = |r: usize, c: usize| [batch.as_slice(), &[r, c]].concat();
            let a = Var::randn(0f32, 1.0, shape(m, k), &dev)?;
            let b = Var::randn(0f32, 1.0, shape(k, n), &dev)?;
            let dc = Tensor::randn(0f32, 1.0, shape(m, n), &dev)?;
            let plain = a.matmul(&b)?;
            let pad = candle_product(&a, &b, Precision::Fp32, DType::F32, Some(padded))?;
            assert_eq!(pad.dims(), plain.dims());
            assert_eq!(values(&pad), values(&plain), "{m} x {k} x {n} padded to {padded:?}");
            let (plain_grads, pad_grads) =
                ((plain * &dc)?.sum_all()?.backward()?, (pad * &dc)?.sum_all()?.backward()?);
            for v in [&a, &b] {
                let (want, got) = (plain_grads.get(v).unwrap(), pad_grads.get(v).unwrap());
                assert_eq!(got.dims(), v.dims());
                assert_eq!(values(got), values(want), "gradient, {m} x {k} x {n} padded to {padded:?}");
            }
        }
        Ok(())
    }

    #[test]
    fn without_padding_it_is_candles_matmul_in_the_compute_dtype() -> Result<()> {
        let dev = Device::Cpu;
        let a = Tensor::randn(0f32, 1.0, (4, 6), &dev)?;
        let b = Tensor::randn(0f32, 1.0, (6, 5), &dev)?;
        let got = candle_product(&a, &b, Precision::Bf16, DType::F32, None)?;
        let want = a.to_dtype(DType::BF16)?.matmul(&b.to_dtype(DType::BF16)?)?.to_dtype(DType::F32)?;
        assert_eq!((got.dtype(), values(&got)), (DType::F32, values(&want)));
        Ok(())
    }
}
