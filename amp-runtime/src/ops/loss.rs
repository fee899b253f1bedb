//! Losses, every one computed in f32 whatever the input dtype (autocast's fp32 list), returning an f32
//! scalar: the mean over the batch (f64 inputs stay f64).
//!
//! A loss reduces over the whole batch, and its terms are where fp16 overflows first (squared errors of
//! 300 already exceed 65504) or loses its small values (log-probabilities of confident predictions).
//! [`binary_cross_entropy`] on half probabilities is refused, as Apex and autocast refuse it; its
//! logits form [`binary_cross_entropy_with_logits`] is safe in every dtype.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::elementwise::{elements, new_storage, part};
use super::{at_least_f32, log_softmax, widen, widest_dtype};
use crate::Precision;

/// The mean cross-entropy of `logits` `(N, C)` against class indices `targets` `(N)` (u8, u32 or i64):
/// `mean_n(-log_softmax(logits)[n, targets[n]])`.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if logits.dims().first() == Some(&0) {
        candle_core::bail!("cross_entropy: an empty batch (0 rows) has no mean loss");
    }
    nll(&log_softmax(logits, 1)?, targets)
}

/// The mean negative log-likelihood of `log_probs` `(N, C)` at class indices `targets` `(N)` (u8, u32
/// or i64): `mean_n(-log_probs[n, targets[n]])`.
pub fn nll(log_probs: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let log_probs = widen(log_probs)?;
    let (batch, classes) = log_probs.dims2()?;
    let count = targets.dims1()?;
    if count != batch {
        candle_core::bail!("nll: {batch} rows of log-probabilities but {count} targets");
    }
    if batch == 0 {
        candle_core::bail!("nll: an empty batch (0 rows) has no mean loss");
    }
    if targets.device().is_cpu() {
        // One pass over N ids, on the CPU only (on a GPU it would wait for the device). Unchecked,
        // candle's gather reports a negative id as an index near 2^64.
        let ids = targets.to_dtype(DType::I64)?.to_vec1::<i64>()?;
        if let Some((n, id)) = ids.iter().enumerate().find(|(_, &id)| id < 0 || id as usize >= classes) {
            candle_core::bail!(
                "nll: target {id} (element {n} of the targets) is not a class index: there are {classes} \
                 classes, 0..{classes}; a target to ignore (PyTorch's -100) must be left out of the batch"
            );
        }
    }
    let picked = log_probs.gather(&targets.unsqueeze(1)?, 1)?;
    picked.sum_all()?.affine(-1.0 / batch as f64, 0.0)
}

/// Mean squared error, `mean((pred - target)^2)`, in f32.
///
/// On the CPU, for f32, f16 and bf16 operands of one shape, one op each way
/// ([`amp_kernels::squared_error`]): the differences in f32, their squares summed in f64 and the mean
/// rounded once to f32; the gradient `2 g (pred - target) / n` in one pass, in `pred`'s dtype. candle's
/// chain (a difference, a square, a sum and a scale, each a pass into a fresh buffer, and about twice
/// as many backward) took 0.4 ms of the MLP bench's step. Otherwise (broadcast shapes, f64, CUDA) that
/// chain, in the wider of the two dtypes and at least f32.
pub fn mse(pred: &Tensor, target: &Tensor) -> Result<Tensor> {
    let fused =
        |t: &Tensor| t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16);
    if fused(pred) && fused(target) && pred.dims() == target.dims() && pred.elem_count() > 0 {
        return pred.contiguous()?.apply_op2(&target.contiguous()?, MeanSquaredError);
    }
    difference(pred, target)?.sqr()?.mean_all()
}

/// Mean absolute error, `mean(|pred - target|)`, in f32.
pub fn l1(pred: &Tensor, target: &Tensor) -> Result<Tensor> {
    difference(pred, target)?.abs()?.mean_all()
}

/// Smooth L1 (Huber scaled by `1/beta`, as PyTorch's `smooth_l1_loss`), in f32: with `d = pred -
/// target`, `0.5 d^2 / beta` where `|d| < beta`, else `|d| - 0.5 beta`; the mean over elements.
/// `beta = 0` is the L1 loss; a negative `beta` is an error.
pub fn smooth_l1(pred: &Tensor, target: &Tensor, beta: f64) -> Result<Tensor> {
    if beta.is_nan() || beta < 0.0 {
        candle_core::bail!("smooth_l1: beta must be non-negative, got {beta}");
    }
    if beta == 0.0 {
        return l1(pred, target);
    }
    let d = difference(pred, target)?;
    let abs = d.abs()?;
    let quadratic = d.sqr()?.affine(0.5 / beta, 0.0)?;
    let linear = abs.affine(1.0, -0.5 * beta)?;
    abs.lt(beta)?.where_cond(&quadratic, &linear)?.mean_all()
}

/// Binary cross-entropy on logits `x` against targets `y` in [0, 1], in f32, in the stable form
/// `max(x, 0) - x y + log(1 + e^-|x|)` (never exponentiates a positive number, never takes the log of
/// something that underflowed); the mean over elements.
pub fn binary_cross_entropy_with_logits(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (x, y) = in_loss_dtype(logits, targets)?;
    let softplus_tail = (x.abs()?.neg()?.exp()? + 1.0)?.log()?;
    ((x.relu()? - (&x * &y)?)? + softplus_tail)?.mean_all()
}

/// Binary cross-entropy on probabilities `p` against targets `y`:
/// `-mean(y max(log p, -100) + (1 - y) max(log(1 - p), -100))`, the log clamped at -100 like PyTorch.
///
/// Refused on f16/bf16 probabilities ([`crate::Error::BinaryCrossEntropyInHalf`]): `1 - p` of a half
/// `p` near 1 is 0 or a handful of ulps, so the loss and its gradient `1 / (p (1 - p))` are garbage
/// before any f32 arithmetic can help. Compute the logits instead and use
/// [`binary_cross_entropy_with_logits`].
pub fn binary_cross_entropy(probs: &Tensor, targets: &Tensor) -> crate::Result<Tensor> {
    if let Ok(precision) = Precision::from_dtype(probs.dtype()) {
        if precision.is_half() {
            return Err(crate::Error::BinaryCrossEntropyInHalf { precision });
        }
    }
    let (p, y) = in_loss_dtype(probs, targets)?;
    let log_p = log_at_least_minus_100(&p)?;
    let log_not_p = log_at_least_minus_100(&p.affine(-1.0, 1.0)?)?;
    let per_element = ((&y * log_p)? + (y.affine(-1.0, 1.0)? * log_not_p)?)?;
    Ok(per_element.mean_all()?.neg()?)
}

/// `max(log x, -100)` with a finite gradient where the clamp applies: where `x < e^-100` (a saturated
/// probability, `x = 0`) the log is taken of 1 instead and replaced by -100, so the backward never
/// forms `0 / 0` (`maximum(log x, -100)` would: `log`'s gradient `g / x` at `x = 0`).
fn log_at_least_minus_100(x: &Tensor) -> Result<Tensor> {
    let in_range = x.ge((-100f64).exp())?;
    let safe = in_range.where_cond(x, &x.ones_like()?)?;
    in_range.where_cond(&safe.log()?, &x.ones_like()?.affine(0.0, -100.0)?)
}

/// Both operands in the loss dtype: at least f32, the wider of the two.
fn in_loss_dtype(a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    let dtype = widest_dtype([at_least_f32(a.dtype()), at_least_f32(b.dtype())]).unwrap_or(DType::F32);
    Ok((a.to_dtype(dtype)?, b.to_dtype(dtype)?))
}

/// `pred - target` in the loss dtype, broadcast. Refuses shapes that broadcast into more elements than
/// either has, such as `(N, 1)` against `(N)`: every prediction would be compared with every target
/// (PyTorch warns of it), where a target broadcast to the prediction's shape is a loss of its own.
fn difference(pred: &Tensor, target: &Tensor) -> Result<Tensor> {
    let both = pred.shape().broadcast_shape_binary_op(target.shape(), "loss")?;
    if both.elem_count() > pred.elem_count().max(target.elem_count()) {
        candle_core::bail!(
            "loss: prediction {:?} and target {:?} broadcast to {:?}, comparing every prediction with \
             every target; give them one shape (`target.reshape(pred.shape())`, or `unsqueeze` where a \
             dimension of 1 is missing)",
            pred.dims(),
            target.dims(),
            both.dims()
        );
    }
    let (pred, target) = in_loss_dtype(pred, target)?;
    pred.broadcast_sub(&target)
}

/// `mean((p - t)^2)` as one op: an f32 scalar.
struct MeanSquaredError;

impl CustomOp2 for MeanSquaredError {
    fn name(&self) -> &'static str {
        "amp-mse"
    }

    fn cpu_fwd(
        &self,
        ps: &CpuStorage,
        pl: &Layout,
        ts: &CpuStorage,
        tl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (p, t) = (elements(ps, pl)?, elements(ts, tl)?);
        let mean = amp_kernels::squared_error::sum(p, t) / p.len() as f64;
        Ok((CpuStorage::F32(vec![mean as f32]), Shape::from(())))
    }

    fn bwd(
        &self,
        p: &Tensor,
        t: &Tensor,
        _loss: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // d/dp of mean((p - t)^2) is 2 (p - t) / n; of t, its negative.
        let scale = 2.0 * grad.to_dtype(DType::F32)?.to_scalar::<f32>()? / p.elem_count() as f32;
        let dp = p.apply_op2_no_bwd(t, &ScaledDifference { scale })?;
        let dt = if t.track_op() { Some(t.apply_op2_no_bwd(p, &ScaledDifference { scale })?) } else { None };
        Ok((Some(dp), dt))
    }
}

/// `scale * (a - b)` in `a`'s dtype: the squared error's gradient of `a`.
struct ScaledDifference {
    scale: f32,
}

impl CustomOp2 for ScaledDifference {
    fn name(&self) -> &'static str {
        "amp-mse-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (a, b) = (elements(s1, l1)?, elements(s2, l2)?);
        let out = new_storage(a.dtype(), a.len(), |at, out| {
            let n = out.len();
            amp_kernels::squared_error::gradient(part(a, at, n), part(b, at, n), self.scale, out)
        });
        Ok((out, l1.shape().clone()))
    }
}
