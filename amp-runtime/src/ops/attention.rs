//! Attention's core, `softmax(q k^T / sqrt(d) + mask) v` over a batch of heads, as one graph node.
//!
//! Composed of candle ops, the core is a product, a softmax and a product, with the reshapes that fold
//! the heads into a batch and the transposed copy of `k` around them: thirteen graph nodes per layer on
//! the main job, each of which candle's backward pass gives a zero-filled gradient of its size and an
//! add. On amp's CPU GEMM it is one op. The forward runs both products and the softmax
//! ([`amp_kernels::softmax`], scale and causal mask folded in) and keeps the probabilities; the
//! backward runs the four products of the gradients and the softmax's backward between them. Each
//! product reads its operands where they lie (`k` and the transposes through their strides) and rounds
//! them to the compute precision while packing, as [`super::matmul_to`] does, so the op computes what
//! the composition computes, bit for bit, in fewer passes over memory.

use std::ops::Deref;
use std::sync::{Arc, Mutex, MutexGuard};

use amp_kernels::gemm::{Compute, Dims, GemmPath, MatRef};
use amp_kernels::softmax::{self, Mask};
use amp_kernels::GradSlice;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Storage, Tensor, D};

use super::gemm::{deposit, is_float, needs_gradient, new_product};
use crate::dispatch::{self, compute_of, MatmulKernel};
use crate::Precision;

/// Attention over a batch of heads: `softmax(q k^T / sqrt(d) + mask) v` for `q` `(.., t_q, d)`, `k`
/// `(.., t_k, d)` and `v` `(.., t_k, d_v)` with the same leading dimensions; when `causal`, query `i`
/// sees keys `j <= i` only. Both products round their operands to `compute` and sum in f32; the scores
/// and the probabilities are f32 (the probabilities rounded to `compute` as the second product reads
/// them), and so is the result `(.., t_q, d_v)`.
///
/// On the CPU under amp's GEMM it is one op each way (see the module's notes). Elsewhere (CUDA,
/// candle's kernel forced) it is candle's ops, with `q` scaled before the first product, whose result
/// candle rounds to the compute precision: the scores stay `sqrt(d)` times further from fp16's
/// overflow, and the scale is exact when `d` is a power of 4 (16, 64, 256).
///
/// # Errors
/// On shapes that do not fit (candle's error from the products).
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    compute: Precision,
) -> Result<Tensor> {
    let scale = 1.0 / (q.dim(D::Minus1)? as f64).sqrt();
    if let Some(mixed) = fused(q, k, v, scale, causal, compute)? {
        return Ok(mixed);
    }
    let scale_in_softmax = dispatch::runs_on_amp_gemm(q.device(), compute);
    let q = if scale_in_softmax { q.clone() } else { (q * scale)? };
    let scores = super::matmul_to(&q, &k.t()?, compute, DType::F32)?;
    let probs =
        super::fused_softmax::attention_probs(&scores, if scale_in_softmax { scale } else { 1.0 }, causal)?;
    super::matmul_to(&probs, v, compute, DType::F32)
}

/// The one-op version, or `None` where it does not apply: not amp's GEMM, a dtype other than f32, f16
/// and bf16, leading dimensions that differ (broadcast) or shapes that do not fit.
fn fused(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    causal: bool,
    compute: Precision,
) -> Result<Option<Tensor>> {
    let Some(heads) = Heads::of(q.dims(), k.dims(), v.dims()) else { return Ok(None) };
    if ![q, k, v].iter().all(|t| is_float(t.dtype())) {
        return Ok(None);
    }
    let MatmulKernel::Amp(path) = dispatch::explain(q.device(), compute, heads.scores()).kernel else {
        return Ok(None);
    };
    let op = AttentionOp {
        path,
        compute: compute_of(compute),
        scale: scale as f32,
        causal,
        heads,
        probs: Arc::default(),
    };
    Ok(Some(q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)?))
}

/// The sizes: `batch` matrices (the leading dimensions) of `t_q` queries and `t_k` keys, `d` features
/// per query and key, `d_v` per value.
#[derive(Clone, Copy, Debug)]
struct Heads {
    batch: usize,
    t_q: usize,
    t_k: usize,
    d: usize,
    d_v: usize,
}

impl Heads {
    fn of(q: &[usize], k: &[usize], v: &[usize]) -> Option<Heads> {
        let r = q.len();
        let lead = r.checked_sub(2)?;
        let fits = k.len() == r
            && v.len() == r
            && q[..lead] == k[..lead]
            && q[..lead] == v[..lead]
            && k[r - 1] == q[r - 1]
            && v[r - 2] == k[r - 2];
        fits.then(|| Heads {
            batch: q[..lead].iter().product(),
            t_q: q[lead],
            t_k: k[lead],
            d: q[r - 1],
            d_v: v[r - 1],
        })
    }

    /// `q k^T`: `(t_q, t_k)` matrices summing `d` products.
    fn scores(&self) -> Dims {
        Dims::batched(self.batch, self.t_q, self.t_k, self.d)
    }

    fn q<'a>(&self, data: GradSlice<'a>) -> MatRef<'a> {
        MatRef::row_major(data, self.d).with_batch_stride(self.t_q * self.d)
    }

    fn k<'a>(&self, data: GradSlice<'a>) -> MatRef<'a> {
        MatRef::row_major(data, self.d).with_batch_stride(self.t_k * self.d)
    }

    fn v<'a>(&self, data: GradSlice<'a>) -> MatRef<'a> {
        MatRef::row_major(data, self.d_v).with_batch_stride(self.t_k * self.d_v)
    }

    /// The mixed values' gradient, `(t_q, d_v)` matrices.
    fn mixed<'a>(&self, data: GradSlice<'a>) -> MatRef<'a> {
        MatRef::row_major(data, self.d_v).with_batch_stride(self.t_q * self.d_v)
    }

    /// Probabilities or the scores' gradient, `(t_q, t_k)` matrices.
    fn square<'a>(&self, data: &'a [f32]) -> MatRef<'a> {
        MatRef::row_major(data, self.t_k).with_batch_stride(self.t_q * self.t_k)
    }

    fn shape(&self, lead: &[usize], rows: usize, cols: usize) -> Shape {
        let mut dims = lead.to_vec();
        dims.extend([rows, cols]);
        dims.into()
    }
}

/// A row-major batch of matrices read transposed.
fn t(m: MatRef<'_>) -> MatRef<'_> {
    MatRef { row_stride: m.col_stride, col_stride: m.row_stride, ..m }
}

/// The candle op: `(q, k, v) -> softmax(scale q k^T + mask) v`, the probabilities kept for backward.
#[derive(Clone, Debug)]
struct AttentionOp {
    path: GemmPath,
    compute: Compute,
    scale: f32,
    causal: bool,
    heads: Heads,
    probs: Arc<Mutex<Option<Vec<f32>>>>,
}

impl AttentionOp {
    fn mask(&self) -> Mask {
        if self.causal {
            Mask::Causal { rows_per_matrix: self.heads.t_q }
        } else {
            Mask::None
        }
    }

    /// `a · b` in f32, or in `out` rounded once.
    fn product(&self, out: DType, dims: Dims, a: MatRef<'_>, b: MatRef<'_>) -> Result<CpuStorage> {
        new_product((self.path, self.compute), out, dims, a, b, None)
    }

    fn kept(&self) -> Result<MutexGuard<'_, Option<Vec<f32>>>> {
        self.probs.lock().map_err(|_| {
            candle_core::Error::Msg("amp attention: a panic poisoned the kept probabilities".into())
        })
    }
}

/// The f32 elements of a product's storage.
fn f32s(storage: CpuStorage) -> Result<Vec<f32>> {
    match storage {
        CpuStorage::F32(v) => Ok(v),
        other => Err(candle_core::Error::UnsupportedDTypeForOp(other.dtype(), "amp attention: f32 sums")),
    }
}

fn elements<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<GradSlice<'a>> {
    crate::storage::read_slice(storage, layout).map_err(candle_core::Error::wrap)
}

impl CustomOp3 for AttentionOp {
    fn name(&self) -> &'static str {
        "amp-attention"
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
        let h = self.heads;
        let (q, k, v) = (elements(s1, l1)?, elements(s2, l2)?, elements(s3, l3)?);
        let scores = f32s(self.product(DType::F32, h.scores(), h.q(q), t(h.k(k)))?)?;
        let mut probs = vec![0f32; scores.len()];
        softmax::forward(&scores, h.t_k, self.scale, self.mask(), &mut probs);
        drop(scores);
        let mixed =
            self.product(DType::F32, Dims::batched(h.batch, h.t_q, h.d_v, h.t_k), h.square(&probs), h.v(v))?;
        *self.kept()? = Some(probs);
        let lead = &l1.dims()[..l1.dims().len() - 2];
        Ok((mixed, h.shape(lead, h.t_q, h.d_v)))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _mixed: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let h = self.heads;
        let grad = grad.to_dtype(DType::F32)?.contiguous()?;
        let guards = [q, k, v, &grad].map(Tensor::storage_and_layout);
        let [qs, ks, vs, dmixed] = [0, 1, 2, 3].map(|i| on_cpu(&guards[i]));
        let (qs, ks, vs, dmixed) = (qs?, ks?, vs?, dmixed?);
        let kept = self.kept()?;
        let probs = kept
            .as_deref()
            .ok_or_else(|| candle_core::Error::Msg("amp attention: no kept probabilities".into()))?;
        let lead = &q.dims()[..q.rank() - 2];
        let tensor =
            |storage: CpuStorage, rows: usize, cols: usize| tensor_of(storage, h.shape(lead, rows, cols));

        let (needs_q, needs_k, needs_v) = (needs_gradient(q), needs_gradient(k), needs_gradient(v));
        let (mut dq, mut dk, mut dv) = (None, None, None);
        if needs_q || needs_k {
            // The probabilities' gradient, then the scores' (the scale and the mask folded in).
            let dprobs = self.product(
                DType::F32,
                Dims::batched(h.batch, h.t_q, h.t_k, h.d_v),
                h.mixed(dmixed),
                t(h.v(vs)),
            )?;
            let dprobs = f32s(dprobs)?;
            let mut dscores = vec![0f32; dprobs.len()];
            softmax::backward(probs, &dprobs, h.t_k, self.scale, &mut dscores);
            drop(dprobs);
            let ds = h.square(&dscores);
            if needs_q {
                let dims = Dims::batched(h.batch, h.t_q, h.d, h.t_k);
                dq = Some(tensor(self.product(q.dtype(), dims, ds, h.k(ks))?, h.t_q, h.d)?);
            }
            if needs_k {
                let dims = Dims::batched(h.batch, h.t_k, h.d, h.t_q);
                dk = Some(tensor(self.product(k.dtype(), dims, t(ds), h.q(qs))?, h.t_k, h.d)?);
            }
        }
        if needs_v {
            let dims = Dims::batched(h.batch, h.t_k, h.d_v, h.t_q);
            dv = Some(tensor(
                self.product(v.dtype(), dims, t(h.square(probs)), h.mixed(dmixed))?,
                h.t_k,
                h.d_v,
            )?);
        }
        Ok((deposit(q, dq)?, deposit(k, dk)?, deposit(v, dv)?))
    }
}

/// The elements of a tensor's storage, locked for reading, on the CPU.
fn on_cpu<'a, G: Deref<Target = Storage>>((storage, layout): &'a (G, &Layout)) -> Result<GradSlice<'a>> {
    match &**storage {
        Storage::Cpu(s) => elements(s, layout),
        _ => Err(candle_core::Error::Msg("amp attention: an operand off the CPU".into())),
    }
}

/// A CPU tensor of `shape` holding `storage`.
fn tensor_of(storage: CpuStorage, shape: Shape) -> Result<Tensor> {
    let cpu = &Device::Cpu;
    match storage {
        CpuStorage::F32(v) => Tensor::from_vec(v, shape, cpu),
        CpuStorage::F16(v) => Tensor::from_vec(v, shape, cpu),
        CpuStorage::BF16(v) => Tensor::from_vec(v, shape, cpu),
        other => Err(candle_core::Error::UnsupportedDTypeForOp(other.dtype(), "amp attention")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::{with_override, Override};
    use candle_core::Var;

    /// What the op replaces: the two products and the softmax as three ops.
    fn composed(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, compute: Precision) -> Result<Tensor> {
        let scale = 1.0 / (q.dim(D::Minus1)? as f64).sqrt();
        let scores = super::super::matmul_to(q, &k.t()?, compute, DType::F32)?;
        let probs = super::super::fused_softmax::attention_probs(&scores, scale, causal)?;
        super::super::matmul_to(&probs, v, compute, DType::F32)
    }

    /// The output and the gradients of `sum(out * g)` for q, k, v, as bits.
    fn bits_of(out: &Tensor, g: &Tensor, qkv: &[Var; 3]) -> Result<Vec<Vec<u32>>> {
        let grads = (out * g)?.sum_all()?.backward()?;
        let mut all = vec![out.clone()];
        for var in qkv {
            all.push(grads.get(var).cloned().ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?);
        }
        all.iter()
            .map(|t| {
                Ok(t.to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .map(|x| x.to_bits())
                    .collect())
            })
            .collect()
    }

    #[test]
    fn computes_the_composition_bit_for_bit_forward_and_backward() -> Result<()> {
        let dev = Device::Cpu;
        let shapes: [[&[usize]; 3]; 2] = [[&[2, 3, 9, 16]; 3], [&[4, 5, 8], &[4, 11, 8], &[4, 11, 6]]];
        for shape in shapes {
            let qkv = shape.map(|s| Var::from_tensor(&Tensor::randn(0f32, 1.5, s, &dev)?));
            let [q, k, v] = qkv;
            let qkv = [q?, k?, v?];
            let mut out = shape[0].to_vec();
            *out.last_mut().expect("rank 3 or 4") = shape[2][shape[2].len() - 1];
            let g = Tensor::randn(0f32, 1.0, out, &dev)?;
            let [q, k, v] = [0, 1, 2].map(|i| qkv[i].as_tensor());
            let paths = [
                (Override::Auto, Precision::Fp32),
                (Override::Auto, Precision::Bf16),
                (Override::Auto, Precision::Fp16),
                (Override::Path(GemmPath::Portable), Precision::Bf16),
                (Override::Path(GemmPath::Avx512Bf16Model), Precision::Bf16),
                (Override::Path(GemmPath::AmxBf16Model), Precision::Bf16),
            ];
            for causal in [false, true] {
                for (over, compute) in paths {
                    let run = || -> Result<[Vec<Vec<u32>>; 2]> {
                        let scale = 1.0 / (q.dim(D::Minus1)? as f64).sqrt();
                        let ours = fused(q, k, v, scale, causal, compute)?.expect("amp's GEMM on the CPU");
                        let theirs = composed(q, k, v, causal, compute)?;
                        Ok([bits_of(&ours, &g, &qkv)?, bits_of(&theirs, &g, &qkv)?])
                    };
                    let [ours, theirs] = with_override(over, run).map_err(candle_core::Error::wrap)??;
                    for (what, (a, b)) in ["out", "dq", "dk", "dv"].iter().zip(ours.iter().zip(&theirs)) {
                        assert!(a == b, "{what} {shape:?} causal {causal} {compute:?} {over:?}");
                    }
                }
            }
        }
        Ok(())
    }
}
