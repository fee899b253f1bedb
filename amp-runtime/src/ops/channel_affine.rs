//! A per-channel scale and shift, `x * weight[c] + bias[c]`, as one candle op on the CPU, forward and
//! backward in one pass each ([`amp_kernels::channel_affine`]): the end of a group norm and a batch norm.
//!
//! Written with broadcasting candle ops it is a product and a sum forward, and backward a product, two
//! reductions over every dimension but the channels', and the sums into fresh zero gradients: 70 ms of
//! a group norm's 122 ms at `(8, 256, 32, 32)` (the normalisation itself: 9 ms).

use amp_kernels::channel_affine::{self, Planes};
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

/// `x * weight[c] + bias[c]` with the channels `c` on dimension `channel_dim` of `x`, in f32, or `None`
/// off the CPU or for operands that are not all f32. Refuses parameters of another length than the
/// channel count.
pub(crate) fn channel_affine(
    x: &Tensor,
    channel_dim: usize,
    weight: &Tensor,
    bias: &Tensor,
) -> Result<Option<Tensor>> {
    let all_f32 = [x, weight, bias].iter().all(|t| t.dtype() == DType::F32);
    if !x.device().is_cpu() || !all_f32 {
        return Ok(None);
    }
    let dims = x.dims();
    let Some(&channels) = dims.get(channel_dim) else {
        candle_core::bail!("channel affine: x of shape {dims:?} has no dimension {channel_dim}");
    };
    if weight.dims() != [channels] || bias.dims() != [channels] {
        candle_core::bail!(
            "channel affine: x has {channels} channels (dimension {channel_dim} of {dims:?}) but the weight \
             has shape {:?} and the bias {:?}",
            weight.dims(),
            bias.dims()
        );
    }
    let planes = Planes { channels, inner: dims[channel_dim + 1..].iter().product() };
    let op = ChannelAffine { planes };
    Ok(Some(x.contiguous()?.apply_op3(&weight.contiguous()?, &bias.contiguous()?, op)?))
}

/// The forward op: `(x, weight, bias) -> y`.
#[derive(Clone, Copy, Debug)]
struct ChannelAffine {
    planes: Planes,
}

/// The backward op: `(x, weight, dy) -> [dx; dweight; dbias]`, one f32 vector.
#[derive(Clone, Copy, Debug)]
struct ChannelAffineBackward {
    planes: Planes,
}

/// The f32 elements of a contiguous storage.
fn f32s<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    super::elementwise::f32_elements(storage, layout, "amp channel affine")
}

impl CustomOp3 for ChannelAffine {
    fn name(&self) -> &'static str {
        "amp-channel-affine"
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
        let (x, weight, bias) = (f32s(s1, l1)?, f32s(s2, l2)?, f32s(s3, l3)?);
        let y = channel_affine::forward_new(x, self.planes, weight, bias);
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _bias: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let backward = ChannelAffineBackward { planes: self.planes };
        let all = x.apply_op3_no_bwd(weight, &grad.contiguous()?, &backward)?;
        let (n, channels) = (x.elem_count(), self.planes.channels);
        let dx = all.narrow(0, 0, n)?.reshape(x.dims())?;
        Ok((Some(dx), Some(all.narrow(0, n, channels)?), Some(all.narrow(0, n + channels, channels)?)))
    }
}

impl CustomOp3 for ChannelAffineBackward {
    fn name(&self) -> &'static str {
        "amp-channel-affine-backward"
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
        let (x, weight, dy) = (f32s(s1, l1)?, f32s(s2, l2)?, f32s(s3, l3)?);
        let (n, channels) = (x.len(), self.planes.channels);
        let mut all = vec![0f32; n + 2 * channels];
        let (dx, sums) = all.split_at_mut(n);
        let (dweight, dbias) = sums.split_at_mut(channels);
        channel_affine::backward(x, dy, self.planes, weight, dx, dweight, dbias);
        Ok((CpuStorage::F32(all), Shape::from(n + 2 * channels)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The op agrees with broadcasting candle ops: forward bit for bit (a product rounded, then a sum),
    /// gradients within f32 roundoff (candle sums them in f32, the op in f64), for the channels on the
    /// first, a middle and the last dimension.
    #[test]
    fn agrees_with_broadcasting_candle_ops_forward_and_backward() -> Result<()> {
        let dev = Device::Cpu;
        for (dims, channel_dim) in [(vec![5, 3, 4, 6], 1), (vec![6, 40], 0), (vec![2, 3, 7], 2)] {
            let channels = dims[channel_dim];
            let x = Var::from_tensor(&Tensor::randn(0f32, 2.0, dims.as_slice(), &dev)?)?;
            let w = Var::from_tensor(&Tensor::randn(1f32, 0.3, channels, &dev)?)?;
            let b = Var::from_tensor(&Tensor::randn(0f32, 0.3, channels, &dev)?)?;
            let r = Tensor::randn(0f32, 1.0, dims.as_slice(), &dev)?;
            let ours = channel_affine(x.as_tensor(), channel_dim, w.as_tensor(), b.as_tensor())?
                .expect("f32 on the CPU");
            let mut shape = vec![1; dims.len()];
            shape[channel_dim] = channels;
            let (ws, bs) =
                (w.as_tensor().reshape(shape.as_slice())?, b.as_tensor().reshape(shape.as_slice())?);
            let theirs = x.as_tensor().broadcast_mul(&ws)?.broadcast_add(&bs)?;
            let bits = |t: &Tensor| -> Result<Vec<u32>> {
                Ok(t.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
            };
            assert_eq!(bits(&ours)?, bits(&theirs)?, "{dims:?} forward");
            let (g1, g2) = ((ours * &r)?.sum_all()?.backward()?, (theirs * &r)?.sum_all()?.backward()?);
            for (name, v) in [("x", &x), ("weight", &w), ("bias", &b)] {
                let (a, c) = (g1.get(v.as_tensor()).expect("ours"), g2.get(v.as_tensor()).expect("theirs"));
                assert_eq!(a.dims(), v.dims(), "{name}");
                let diff = (a - c)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                assert!(diff < 1e-4, "{dims:?} d{name}: {diff}");
            }
        }
        Ok(())
    }

    #[test]
    fn parameters_of_another_length_are_refused_and_other_dtypes_left_to_candle() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::zeros((2, 3, 4), DType::F32, &dev)?;
        let (w, b) = (Tensor::ones(4, DType::F32, &dev)?, Tensor::zeros(4, DType::F32, &dev)?);
        let err = channel_affine(&x, 1, &w, &b).expect_err("4 parameters for 3 channels").to_string();
        assert!(err.contains("3 channels"), "{err}");
        let half = x.to_dtype(DType::BF16)?;
        assert!(channel_affine(&half, 2, &w, &b)?.is_none());
        Ok(())
    }
}
