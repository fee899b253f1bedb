//! `amp::ops::scaled_dot_product_attention` against an f64 reference of `softmax(q k^T / sqrt(d) +
//! mask) v` and its three gradients, in fp32, bf16 and fp16, causal or not, self- and cross-attention
//! shapes (`t_q != t_k`, `d != d_v`), on amp's GEMM (one graph node) and on candle's kernel.
//!
//! Tolerance (normwise relative, `common::tolerance`): the roundings to the compute format on each
//! path. Forward: `q` and `k` as the first product reads them, the probabilities and `v` as the second
//! does: 4. Gradients: the upstream gradient and `v` (the probabilities' gradient), the scores'
//! gradient and `k` or `q` (`dq`, `dk`), or the probabilities and the upstream gradient (`dv`): 4.
//! Safety factor 3: the softmax and its backward amplify the scores' relative error by about `|s|`,
//! 1-3 on these data. In fp32 the f32 arithmetic term of the tolerance alone (`256 u`).

mod common;

use amp::dispatch::{with_override, GemmPath, Override};
use amp::{ops, Precision};
use candle_core::{DType, Result, Tensor, Var, D};

/// `(q, k, v)` shapes: self-attention with heads as a 4-d batch, cross-attention with a 3-d batch.
const SHAPES: [[&[usize]; 3]; 2] =
    [[&[2, 3, 9, 16], &[2, 3, 9, 16], &[2, 3, 9, 16]], [&[4, 5, 8], &[4, 11, 8], &[4, 11, 6]]];

/// `softmax(q k^T / sqrt(d) + mask) v` in f64 with candle's ops.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
    let d = q.dim(D::Minus1)?;
    let mut scores = (q.matmul(&k.t()?.contiguous()?)? / (d as f64).sqrt())?;
    if causal {
        let (t_q, t_k) = (q.dim(D::Minus2)?, k.dim(D::Minus2)?);
        let mask: Vec<f64> = (0..t_q)
            .flat_map(|i| (0..t_k).map(move |j| if j > i { f64::NEG_INFINITY } else { 0.0 }))
            .collect();
        scores = scores.broadcast_add(&Tensor::from_vec(mask, (t_q, t_k), q.device())?)?;
    }
    let e = scores.broadcast_sub(&scores.max_keepdim(D::Minus1)?.detach())?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?.matmul(v)
}

/// The output and the gradients of `sum(out * g)` with respect to `q`, `k`, `v`, of `f` on variables
/// holding `inputs` in `dtype`.
fn value_and_gradients(
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    inputs: &[Tensor; 3],
    g: &Tensor,
    dtype: DType,
) -> Result<[Tensor; 4]> {
    let vars = inputs.each_ref().map(|t| t.to_dtype(dtype).and_then(|t| Var::from_tensor(&t)));
    let [q, k, v] =
        [&vars[0], &vars[1], &vars[2]].map(|v| v.as_ref().expect("a variable").as_tensor().clone());
    let out = f(&q, &k, &v)?;
    let grads = (out.to_dtype(dtype)? * g.to_dtype(dtype)?)?.sum_all()?.backward()?;
    let grad =
        |t: &Tensor| grads.get(t).cloned().ok_or_else(|| candle_core::Error::Msg("no gradient".into()));
    Ok([out, grad(&q)?, grad(&k)?, grad(&v)?])
}

fn inputs(shapes: [&[usize]; 3], seed: u64) -> Result<([Tensor; 3], Tensor)> {
    let [q, k, v] = [0, 1, 2].map(|i| common::randn_in(seed + i as u64, shapes[i], 1.5, DType::F32));
    let mut out = shapes[0].to_vec();
    *out.last_mut().expect("rank 3 or 4") = shapes[2][shapes[2].len() - 1];
    Ok(([q?, k?, v?], common::randn_in(seed + 3, &out, 1.0, DType::F32)?))
}

fn check_against_f64(over: Override) -> Result<()> {
    for (s, shapes) in SHAPES.into_iter().enumerate() {
        let (qkv, g) = inputs(shapes, 10 * s as u64)?;
        for causal in [false, true] {
            let want = value_and_gradients(|q, k, v| reference(q, k, v, causal), &qkv, &g, DType::F64)?;
            for compute in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
                let attend = |q: &Tensor, k: &Tensor, v: &Tensor| {
                    ops::scaled_dot_product_attention(q, k, v, causal, compute)
                };
                let got = with_override(over, || value_and_gradients(attend, &qkv, &g, DType::F32))
                    .map_err(candle_core::Error::wrap)??;
                let tolerance = match compute {
                    Precision::Fp32 => common::tolerance(DType::F32, 0, 1.0),
                    half => common::tolerance(half.dtype(), 4, 3.0),
                };
                for (what, (got, want)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
                    assert_eq!(got.dtype(), DType::F32, "{what}: f32 in, f32 out");
                    let case = format!("{what} {shapes:?} causal {causal} {compute:?} {over:?}");
                    common::assert_close(&case, got, want, tolerance)?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn matches_f64_on_amps_gemm() -> Result<()> {
    check_against_f64(Override::Auto)?;
    // The portable kernel: the path every CPU has.
    check_against_f64(Override::Path(GemmPath::Portable))
}

#[test]
fn matches_f64_on_candles_kernel() -> Result<()> {
    check_against_f64(Override::Candle)
}

#[test]
fn is_one_graph_node_on_amps_gemm_and_ignores_the_future_when_causal() -> Result<()> {
    let (qkv, _) = inputs(SHAPES[0], 7)?;
    let vars = qkv.each_ref().map(|t| Var::from_tensor(t).expect("a variable"));
    let [q, k, v] = [&vars[0], &vars[1], &vars[2]].map(|v| v.as_tensor());
    let out = ops::scaled_dot_product_attention(q, k, v, true, Precision::Bf16)?;
    let computed = out.sorted_nodes().into_iter().filter(|t| !t.is_variable()).count();
    assert_eq!(computed, 1, "the op alone between q, k, v and the output");
    // Changing the last key and value changes no output but the last query's.
    let t = q.dim(2)?;
    let change = |x: &Tensor| -> Result<Tensor> {
        let last = (x.narrow(2, t - 1, 1)? + 1.0)?;
        Tensor::cat(&[&x.narrow(2, 0, t - 1)?, &last], 2)
    };
    let moved = ops::scaled_dot_product_attention(q, &change(k)?, &change(v)?, true, Precision::Bf16)?;
    let diff = (out.narrow(2, 0, t - 1)? - moved.narrow(2, 0, t - 1)?)?.abs()?.flatten_all()?.max(0)?;
    assert_eq!(diff.to_scalar::<f32>()?, 0.0);
    let last = (out.narrow(2, t - 1, 1)? - moved.narrow(2, t - 1, 1)?)?.abs()?.flatten_all()?.max(0)?;
    assert!(last.to_scalar::<f32>()? > 0.0);
    Ok(())
}

#[test]
fn a_transposed_key_is_read_as_its_copy_and_bad_shapes_are_refused() -> Result<()> {
    let (qkv, _) = inputs(SHAPES[0], 3)?;
    let [q, k, v] = &qkv;
    let k_strided = k.transpose(2, 3)?.contiguous()?.transpose(2, 3)?;
    assert!(!k_strided.is_contiguous());
    let a = ops::scaled_dot_product_attention(q, &k_strided, v, false, Precision::Bf16)?;
    let b = ops::scaled_dot_product_attention(q, k, v, false, Precision::Bf16)?;
    assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?);
    // Keys with another feature count than the queries': the product's shape error.
    let narrow = k.narrow(3, 0, 8)?;
    let err =
        ops::scaled_dot_product_attention(q, &narrow, v, false, Precision::Bf16).expect_err("d differs");
    assert!(err.to_string().contains("shape mismatch"), "{err}");
    Ok(())
}
