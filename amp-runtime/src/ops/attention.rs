//! Attention's core, `softmax(q k^T / sqrt(d) + mask) v` over a batch of heads, as one graph node.
//!
//! Composed of candle ops, the core is a product, a softmax and a product, with the reshapes that fold
//! the heads into a batch and the transposed copy of `k` around them, and for a multi-head layer the
//! split of each projection into heads and the merge back: seventeen graph nodes per layer on the
//! main job, each of which candle's backward pass gives a zero-filled gradient of its size and an add.
//! On amp's CPU GEMM it is one op. The forward runs both products and the softmax
//! ([`amp_kernels::softmax`], scale and causal mask folded in) and keeps the probabilities; the
//! backward runs the four products of the gradients and the softmax's backward between them. Each
//! product reads its operands where they lie (`k`, the transposes and each head of a `(batch, t,
//! heads * d)` projection through their strides), writes its result there too, runs all heads of a
//! matrix of the batch in one call ([`amp_kernels::gemm::gemm_groups_into`]), and rounds its operands
//! to the compute precision while packing, as [`super::matmul_to`] does. The batch's matrices run in
//! parallel, each through both products and the softmax between them before the next: its scores
//! (`heads x t_q x t_k` f32, 256 KiB on the main job) are still in the core's cache when the softmax
//! and the second product read them, where products over the whole batch (2 MiB of scores a layer)
//! passed them through memory three times. On the Xeon (AMX) the main job's bf16 O2 step went from
//! 70.8-82.3 to 65.5-69.7 ms (four alternated pairs of runs, two threads; fp32 127-143 -> 122-130).
//! Under a causal mask the products skip what
//! the mask zeroes ([`Triangle`]): the scores' tiles above the diagonal, and the terms of the
//! probabilities' (and their gradient's) zeros, about half of each product. The op computes what the
//! composition computes, bit for bit, in fewer passes over memory (up to the sign of a zero sum, and
//! but for a NaN or infinity in `v`, `k` or `q` that only masked entries would have met).

use std::sync::{Arc, Mutex, MutexGuard};

use amp_kernels::fresh::written_in_blocks;
use amp_kernels::gemm::{
    gemm_groups_into, gemm_new_groups, Compute, Dims, GemmPath, Groups, MatRef, Placement, Triangle,
};
use amp_kernels::softmax::{self, Mask};
use amp_kernels::{Dtype, GradSlice, GradSliceMut};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use super::elementwise::{elements, elements_mut, kernel_dtype, new_storage, tensor_of};
use super::gemm::{deposit, is_float, needs_gradient, output_type, storage_of};
use super::heads::{merge_heads, split_heads};
use crate::dispatch::{self, compute_of, MatmulKernel};
use crate::storage::with_slices;
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
    if let Some(heads) = Heads::batched(q.dims(), k.dims(), v.dims()) {
        if let Some(mixed) = fused(heads, [q, k, v], causal, compute)? {
            return Ok(mixed);
        }
    }
    let scale_in_softmax = dispatch::runs_on_amp_gemm(q.device(), compute);
    let q = if scale_in_softmax { q.clone() } else { (q * scale)? };
    let scores = super::matmul_to(&q, &k.t()?, compute, DType::F32)?;
    let probs =
        super::fused_softmax::attention_probs(&scores, if scale_in_softmax { scale } else { 1.0 }, causal)?;
    super::matmul_to(&probs, v, compute, DType::F32)
}

/// [`scaled_dot_product_attention`] of `heads` heads held side by side: `q` `(batch, t_q, heads * d)`,
/// `k` `(batch, t_k, heads * d)`, `v` `(batch, t_k, heads * d_v)` (projections as they come), head `h`
/// the features `h * d .. (h + 1) * d`; the result `(batch, t_q, heads * d_v)`, its heads side by side
/// as well. On amp's GEMM the op reads and writes the heads in place; elsewhere the heads are split
/// into a batch, attended and merged back.
pub(crate) fn attention_of_heads(
    [q, k, v]: [&Tensor; 3],
    heads: usize,
    causal: bool,
    compute: Precision,
) -> Result<Tensor> {
    if let Some(side_by_side) = Heads::side_by_side(q.dims(), k.dims(), v.dims(), heads) {
        if let Some(mixed) = fused(side_by_side, [q, k, v], causal, compute)? {
            return Ok(mixed);
        }
    }
    let [q, k, v] = [q, k, v].map(|x| split_heads(x, heads));
    merge_heads(&scaled_dot_product_attention(&q?, &k?, &v?, causal, compute)?)
}

/// The one-op version (scale `1/sqrt(d)`), or `None` where it does not apply: not amp's GEMM, or a
/// dtype other than f32, f16 and bf16.
fn fused(heads: Heads, [q, k, v]: [&Tensor; 3], causal: bool, compute: Precision) -> Result<Option<Tensor>> {
    if ![q, k, v].iter().all(|t| is_float(t.dtype())) {
        return Ok(None);
    }
    let Some(op) = AttentionOp::on_amp_gemm(heads, causal, compute, q.device()) else {
        return Ok(None);
    };
    Ok(Some(q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)?))
}

/// The sizes, and where the heads lie: `groups` heads side by side in each operand's rows (1 for
/// `(.., t, d)` operands), each a batch of `batch` matrices; `t_q` queries and `t_k` keys, `d`
/// features per query and key, `d_v` per value.
#[derive(Clone, Copy, Debug)]
pub(super) struct Heads {
    groups: usize,
    batch: usize,
    t_q: usize,
    t_k: usize,
    d: usize,
    d_v: usize,
}

impl Heads {
    /// `q` `(.., t_q, d)`, `k` `(.., t_k, d)`, `v` `(.., t_k, d_v)`, the leading dimensions the same.
    fn batched(q: &[usize], k: &[usize], v: &[usize]) -> Option<Heads> {
        let r = q.len();
        let lead = r.checked_sub(2)?;
        let fits = k.len() == r
            && v.len() == r
            && q[..lead] == k[..lead]
            && q[..lead] == v[..lead]
            && k[r - 1] == q[r - 1]
            && v[r - 2] == k[r - 2];
        fits.then(|| Heads {
            groups: 1,
            batch: q[..lead].iter().product(),
            t_q: q[lead],
            t_k: k[lead],
            d: q[r - 1],
            d_v: v[r - 1],
        })
    }

    /// `q` `(batch, t_q, heads * d)`, `k` `(batch, t_k, heads * d)`, `v` `(batch, t_k, heads * d_v)`.
    pub(super) fn side_by_side(q: &[usize], k: &[usize], v: &[usize], heads: usize) -> Option<Heads> {
        let (&[batch, t_q, qe], &[kb, t_k, ke], &[vb, vt, ve]) = (q, k, v) else { return None };
        let fits = heads > 0
            && (kb, vb, vt, ke) == (batch, batch, t_k, qe)
            && qe.is_multiple_of(heads)
            && ve.is_multiple_of(heads);
        fits.then(|| Heads { groups: heads, batch, t_q, t_k, d: qe / heads, d_v: ve / heads })
    }

    /// The same heads for one matrix of the batch.
    fn one(&self) -> Heads {
        Heads { batch: 1, ..*self }
    }

    /// Elements of the probabilities (or of their gradient) of every group.
    fn squares_len(&self) -> usize {
        self.groups * self.batch * self.t_q * self.t_k
    }

    /// Elements of an operand or a result with `rows` rows of `cols` features a head.
    fn rows_len(&self, rows: usize, cols: usize) -> usize {
        self.batch * rows * self.groups * cols
    }

    /// Matrix `b` of the batch onward, of an operand with `rows` rows of `cols` features a head.
    fn at<'a>(&self, data: GradSlice<'a>, b: usize, rows: usize, cols: usize) -> GradSlice<'a> {
        data.split_at(b * rows * self.groups * cols).1
    }

    /// Products of `(m, k) x (k, n)` matrices, one per matrix of a group.
    fn dims(&self, m: usize, n: usize, k: usize) -> Dims {
        Dims::batched(self.batch, m, n, k)
    }

    /// Group 0's matrices of an operand with `t` rows of `w` features a head, and the distance to the
    /// next group's.
    fn operand<'a>(&self, data: GradSlice<'a>, t: usize, w: usize) -> Grouped<'a> {
        let row = self.groups * w;
        (MatRef { data, row_stride: row, col_stride: 1, batch_stride: t * row }, w)
    }

    fn q<'a>(&self, data: GradSlice<'a>) -> Grouped<'a> {
        self.operand(data, self.t_q, self.d)
    }

    fn k<'a>(&self, data: GradSlice<'a>) -> Grouped<'a> {
        self.operand(data, self.t_k, self.d)
    }

    fn v<'a>(&self, data: GradSlice<'a>) -> Grouped<'a> {
        self.operand(data, self.t_k, self.d_v)
    }

    /// The result's gradient.
    fn mixed<'a>(&self, data: GradSlice<'a>) -> Grouped<'a> {
        self.operand(data, self.t_q, self.d_v)
    }

    /// The probabilities or the scores' gradient, `(t_q, t_k)` matrices stacked group by group.
    fn square<'a>(&self, data: &'a [f32]) -> Grouped<'a> {
        let matrix = self.t_q * self.t_k;
        (MatRef::row_major(data, self.t_k).with_batch_stride(matrix), self.batch * matrix)
    }

    /// The shape of a result of `rows` rows of `cols` features a head, with the leading dimensions of
    /// `like`.
    fn shape(&self, like: &[usize], rows: usize, cols: usize) -> Shape {
        let mut dims = like[..like.len() - 2].to_vec();
        dims.extend([rows, self.groups * cols]);
        dims.into()
    }
}

/// An operand of every group: group 0's matrices, and the distance from one group's to the next's.
type Grouped<'a> = (MatRef<'a>, usize);

/// A grouped operand read transposed.
fn t((m, step): Grouped<'_>) -> Grouped<'_> {
    (MatRef { row_stride: m.col_stride, col_stride: m.row_stride, ..m }, step)
}

/// The candle op: `(q, k, v) -> softmax(scale q k^T + mask) v`, the probabilities kept for backward.
/// [`mod@super::self_attention`] runs it on elements it holds outside candle's graph
/// ([`AttentionOp::attend`], [`AttentionOp::gradients`]).
#[derive(Clone, Debug)]
pub(super) struct AttentionOp {
    path: GemmPath,
    compute: Compute,
    scale: f32,
    causal: bool,
    heads: Heads,
    /// The probabilities, stacked group by group.
    probs: Arc<Mutex<Option<Vec<f32>>>>,
}

impl AttentionOp {
    /// The op for `heads` (scale `1/sqrt(d)`) where the dispatcher picks amp's GEMM for their products
    /// in `compute` on `device`; `None` elsewhere.
    pub(super) fn on_amp_gemm(
        heads: Heads,
        causal: bool,
        compute: Precision,
        device: &Device,
    ) -> Option<AttentionOp> {
        let MatmulKernel::Amp(path) =
            dispatch::explain(device, compute, heads.dims(heads.t_q, heads.t_k, heads.d)).kernel
        else {
            return None;
        };
        Some(AttentionOp {
            path,
            compute: compute_of(compute),
            scale: (1.0 / (heads.d as f64).sqrt()) as f32,
            causal,
            heads,
            probs: Arc::default(),
        })
    }

    fn mask(&self) -> Mask {
        if self.causal {
            Mask::Causal { rows_per_matrix: self.heads.t_q }
        } else {
            Mask::None
        }
    }

    /// What the products skip under the mask (`triangle`), or nothing without one.
    fn under_mask(&self, triangle: Triangle) -> Triangle {
        if self.causal {
            triangle
        } else {
            Triangle::Full
        }
    }

    /// Each group's `a · b` into `c` (f32, or rounded once from the f32 sums), placed as `placement`
    /// says.
    fn into(
        &self,
        dims: Dims,
        ((a, a_step), (b, b_step)): (Grouped<'_>, Grouped<'_>),
        placement: Placement,
        triangle: Triangle,
        c: GradSliceMut<'_>,
    ) -> Result<()> {
        let groups = Groups { count: self.heads.groups, a_step, b_step, placement };
        let triangle = self.under_mask(triangle);
        gemm_groups_into(self.path, dims, (a, b), groups, c, self.compute, triangle)
            .map_err(candle_core::Error::wrap)
    }

    /// Each group's `a · b` in f32, stacked group by group.
    fn squares(
        &self,
        dims: Dims,
        (a, b): (Grouped<'_>, Grouped<'_>),
        triangle: Triangle,
    ) -> Result<Vec<f32>> {
        f32s(self.grouped(DType::F32, dims, (a, b), Placement::Stacked, triangle)?)
    }

    fn grouped(
        &self,
        out: DType,
        dims: Dims,
        ((a, a_step), (b, b_step)): (Grouped<'_>, Grouped<'_>),
        placement: Placement,
        triangle: Triangle,
    ) -> Result<CpuStorage> {
        let groups = Groups { count: self.heads.groups, a_step, b_step, placement };
        let triangle = self.under_mask(triangle);
        let c = gemm_new_groups(self.path, dims, (a, b), groups, output_type(out), self.compute, triangle)
            .map_err(candle_core::Error::wrap)?;
        Ok(storage_of(c))
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
        let (q, k, v) = (elements(s1, l1)?, elements(s2, l2)?, elements(s3, l3)?);
        let h = self.heads;
        Ok((self.attend([q, k, v], Dtype::F32)?, h.shape(l1.dims(), h.t_q, h.d_v)))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _mixed: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.to_dtype(DType::F32)?.contiguous()?;
        let wanted = [wanted_gradient(q)?, wanted_gradient(k)?, wanted_gradient(v)?];
        let grads = with_slices(&[q, k, v, &grad], |slices| match *slices {
            [qs, ks, vs, dmixed] => self.gradients([qs, ks, vs, dmixed], wanted),
            _ => unreachable!("one slice per tensor"),
        })
        .map_err(candle_core::Error::wrap)??;
        let h = self.heads;
        let [dq, dk, dv] = grads;
        let tensor = |x: &Tensor, storage: Option<CpuStorage>, rows: usize, cols: usize| {
            storage.map(|s| tensor_of(s, h.shape(x.dims(), rows, cols))).transpose()
        };
        let (dq, dk, dv) =
            (tensor(q, dq, h.t_q, h.d)?, tensor(k, dk, h.t_k, h.d)?, tensor(v, dv, h.t_k, h.d_v)?);
        Ok((deposit(q, dq)?, deposit(k, dk)?, deposit(v, dv)?))
    }
}

impl AttentionOp {
    /// `softmax(scale q k^T + mask) v` of the elements of `q`, `k` and `v` (any of f32, f16, bf16, laid
    /// out as [`Heads`] says), in a new storage of `out` (rounded once from the f32 sums); the
    /// probabilities are kept for [`AttentionOp::gradients`].
    pub(super) fn attend(&self, [q, k, v]: [GradSlice<'_>; 3], out: Dtype) -> Result<CpuStorage> {
        let h = self.heads;
        let one = h.one();
        let (square, mixed_len) = (one.squares_len(), one.rows_len(h.t_q, h.d_v));
        let mut probs: Vec<f32> = written_in_blocks(h.batch * square, square, |_, _| {});
        let mut mixed = new_storage(out, h.batch * mixed_len, |_, _| {});
        let parts = batch_parts(elements_mut(&mut mixed, h.batch * mixed_len)?, mixed_len, h.batch);
        // One batch at a time, its heads' scores turned into probabilities and multiplied by `v` while
        // they are in cache.
        let each = probs.par_chunks_mut(square.max(1)).zip(parts);
        each.enumerate().try_for_each(|(b, (probs, mixed))| -> Result<()> {
            let (q, k, v) = (h.at(q, b, h.t_q, h.d), h.at(k, b, h.t_k, h.d), h.at(v, b, h.t_k, h.d_v));
            let dims = one.dims(h.t_q, h.t_k, h.d);
            self.into(dims, (one.q(q), t(one.k(k))), Placement::Stacked, Triangle::LowerC, probs.into())?;
            softmax::forward_in_place(probs, h.t_k, self.scale, self.mask());
            let dims = one.dims(h.t_q, h.d_v, h.t_k);
            let operands = (one.square(probs), one.v(v));
            self.into(dims, operands, Placement::SideBySide, Triangle::ZeroAboveA, mixed)
        })?;
        *self.kept()? = Some(probs);
        Ok(mixed)
    }

    /// The gradients of `q`, `k` and `v` in the dtypes `wanted` (none where `None`) from their elements
    /// and the result's gradient `dmixed` (any of f32, f16, bf16), after [`AttentionOp::attend`], one
    /// batch at a time: its heads' probabilities' gradient is turned into the scores' and multiplied
    /// into `dq` and `dk` while it is in cache.
    pub(super) fn gradients(
        &self,
        [qs, ks, vs, dmixed]: [GradSlice<'_>; 4],
        wanted: [Option<Dtype>; 3],
    ) -> Result<[Option<CpuStorage>; 3]> {
        let h = self.heads;
        let one = h.one();
        let kept = self.kept()?;
        let probs = kept
            .as_deref()
            .ok_or_else(|| candle_core::Error::Msg("amp attention: no kept probabilities".into()))?;
        let output = |dtype: Option<Dtype>, rows: usize, cols: usize| -> Option<Output> {
            let storage = new_storage(dtype?, h.batch * one.rows_len(rows, cols), |_, _| {});
            Some(Output { storage, rows, cols })
        };
        let [q_dtype, k_dtype, v_dtype] = wanted;
        let (mut dq, mut dk, mut dv) =
            (output(q_dtype, h.t_q, h.d), output(k_dtype, h.t_k, h.d), output(v_dtype, h.t_k, h.d_v));
        let dq_parts = output_parts(dq.as_mut(), one, h.batch)?;
        let dk_parts = output_parts(dk.as_mut(), one, h.batch)?;
        let dv_parts = output_parts(dv.as_mut(), one, h.batch)?;
        let square = one.squares_len();
        let each = dq_parts.into_par_iter().zip(dk_parts).zip(dv_parts).zip(probs.par_chunks(square.max(1)));
        each.enumerate().try_for_each(|(b, (((dq, dk), dv), probs))| -> Result<()> {
            let (q, k, v) = (h.at(qs, b, h.t_q, h.d), h.at(ks, b, h.t_k, h.d), h.at(vs, b, h.t_k, h.d_v));
            let dmixed = h.at(dmixed, b, h.t_q, h.d_v);
            if dq.is_some() || dk.is_some() {
                // The probabilities' gradient, turned into the scores' where it lies.
                let dims = one.dims(h.t_q, h.t_k, h.d_v);
                let mut dscores = self.squares(dims, (one.mixed(dmixed), t(one.v(v))), Triangle::LowerC)?;
                softmax::backward_in_place(probs, &mut dscores, h.t_k, self.scale);
                let ds = one.square(&dscores);
                if let Some(dq) = dq {
                    let dims = one.dims(h.t_q, h.d, h.t_k);
                    self.into(dims, (ds, one.k(k)), Placement::SideBySide, Triangle::ZeroAboveA, dq)?;
                }
                if let Some(dk) = dk {
                    let dims = one.dims(h.t_k, h.d, h.t_q);
                    self.into(dims, (t(ds), one.q(q)), Placement::SideBySide, Triangle::ZeroBelowA, dk)?;
                }
            }
            if let Some(dv) = dv {
                let dims = one.dims(h.t_k, h.d_v, h.t_q);
                let operands = (t(one.square(probs)), one.mixed(dmixed));
                self.into(dims, operands, Placement::SideBySide, Triangle::ZeroBelowA, dv)?;
            }
            Ok(())
        })?;
        Ok([dq, dk, dv].map(|out| out.map(|out| out.storage)))
    }
}

/// The dtype of `x`'s gradient where it needs one.
fn wanted_gradient(x: &Tensor) -> Result<Option<Dtype>> {
    needs_gradient(x).then(|| kernel_dtype(x.dtype())).transpose()
}

/// A gradient the backward pass writes batch by batch: `rows` rows of `cols` features a head.
struct Output {
    storage: CpuStorage,
    rows: usize,
    cols: usize,
}

/// `out`'s part for each matrix of the batch of `one`'s shape, or `None` for each without `out`.
fn output_parts(out: Option<&mut Output>, one: Heads, batch: usize) -> Result<Vec<Option<GradSliceMut<'_>>>> {
    let Some(out) = out else { return Ok((0..batch).map(|_| None).collect()) };
    let part = one.rows_len(out.rows, out.cols);
    let data = elements_mut(&mut out.storage, batch * part)?;
    Ok(batch_parts(data, part, batch).into_iter().map(Some).collect())
}

/// `data` split into `batch` parts of `part` elements.
fn batch_parts(mut data: GradSliceMut<'_>, part: usize, batch: usize) -> Vec<GradSliceMut<'_>> {
    let mut parts = Vec::with_capacity(batch);
    for _ in 0..batch {
        let (first, rest) = data.split_at(part);
        parts.push(first);
        data = rest;
    }
    parts
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

    /// Query, key and value shapes, and the heads side by side in them (`None`: a batch of heads).
    type Case = ([&'static [usize]; 3], Option<usize>);

    const CASES: [Case; 3] = [
        ([&[2, 3, 9, 16], &[2, 3, 9, 16], &[2, 3, 9, 16]], None),
        ([&[4, 5, 8], &[4, 11, 8], &[4, 11, 6]], None),
        ([&[2, 5, 24], &[2, 11, 24], &[2, 11, 18]], Some(3)),
    ];

    #[test]
    fn computes_the_composition_bit_for_bit_forward_and_backward() -> Result<()> {
        let dev = Device::Cpu;
        for (shape, heads) in CASES {
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
                        let (ours, theirs) = match heads {
                            None => (
                                scaled_dot_product_attention(q, k, v, causal, compute)?,
                                composed(q, k, v, causal, compute)?,
                            ),
                            Some(heads) => {
                                let [qh, kh, vh] = [q, k, v].map(|x| split_heads(x, heads));
                                let apart = composed(&qh?, &kh?, &vh?, causal, compute)?;
                                (attention_of_heads([q, k, v], heads, causal, compute)?, merge_heads(&apart)?)
                            }
                        };
                        let nodes = ours.sorted_nodes().into_iter().filter(|t| !t.is_variable()).count();
                        assert_eq!(nodes, 1, "the op alone");
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
