//! amp's GEMM as a candle op: forward and both gradients against f64 references, every layout the
//! layers use, and the dispatcher's choices.
//!
//! Tolerance: each element is a sum of `k` exact products of the rounded operands, accumulated in f32
//! (`gamma_k sum|ab|`, `gamma_k ~ k 2^-24`), then rounded once to the output dtype (`u_out |c|`). The
//! gradients are the same kind of sum over the other dimension, of `dC` rounded to the compute
//! precision. The f64 references below round exactly the operands the kernel rounds, so the bound is
//! the kernel's own error, not the precision's.

use amp::dispatch::{self, Compute, Dims, GemmPath, MatmulKernel, Override};
use amp::{ops, Precision};
use candle_core::{DType, Device, Result, Tensor, Var, D};

/// Values of `t` rounded to `dtype` and back, as f64, row-major.
fn values(t: &Tensor, dtype: DType) -> Result<Vec<f64>> {
    let v = t.to_dtype(dtype)?.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    Ok(v)
}

/// f64 `A·B` for `(batch, m, k)·(batch, k, n)` and the `sum |a b|` of each element.
fn reference(a: &[f64], b: &[f64], (batch, m, k, n): (usize, usize, usize, usize)) -> (Vec<f64>, Vec<f64>) {
    let (mut c, mut abs) = (vec![0.0; batch * m * n], vec![0.0; batch * m * n]);
    for p in 0..batch {
        for i in 0..m {
            for j in 0..n {
                for l in 0..k {
                    let x = a[(p * m + i) * k + l] * b[(p * k + l) * n + j];
                    c[(p * m + i) * n + j] += x;
                    abs[(p * m + i) * n + j] += x.abs();
                }
            }
        }
    }
    (c, abs)
}

/// The output dtype's unit roundoff, and half its smallest subnormal step (the absolute error of a
/// result that is subnormal there).
fn unit(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F16 => (2f64.powi(-11), 2f64.powi(-25)),
        DType::BF16 => (2f64.powi(-8), 2f64.powi(-134)),
        _ => (2f64.powi(-24), 2f64.powi(-150)),
    }
}

#[track_caller]
fn assert_within(
    what: &str,
    got: &Tensor,
    (want, abs): (Vec<f64>, Vec<f64>),
    k: usize,
    out: DType,
) -> Result<()> {
    let got = got.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let gamma = k as f64 * 2f64.powi(-24) * 1.01;
    for (i, ((g, w), s)) in got.iter().zip(&want).zip(&abs).enumerate() {
        let (u, tiny) = unit(out);
        let bound = gamma * s + u * (w.abs() + gamma * s) + tiny;
        assert!((g - w).abs() <= bound, "{what}[{i}]: {g:e} vs {w:e}, bound {bound:e}");
    }
    Ok(())
}

fn compute_dtype(p: Precision) -> DType {
    p.dtype()
}

#[test]
fn forward_and_both_gradients_match_f64_for_every_precision_and_layout() -> Result<()> {
    let dev = Device::Cpu;
    let (batch, m, k, n) = (3, 37, 70, 65);
    for precision in Precision::ALL {
        for out in [DType::F32, precision.dtype()] {
            for b_transposed in [false, true] {
                let a = Var::from_tensor(&Tensor::randn(0f32, 1.0, (batch, m, k), &dev)?)?;
                // B stored as (batch, n, k) and read transposed, like a Linear weight, or as (batch, k, n).
                let b_stored = if b_transposed {
                    Tensor::randn(0f32, 1.0, (batch, n, k), &dev)?
                } else {
                    Tensor::randn(0f32, 1.0, (batch, k, n), &dev)?
                };
                let b_var = Var::from_tensor(&b_stored)?;
                let b =
                    if b_transposed { b_var.as_tensor().transpose(1, 2)? } else { b_var.as_tensor().clone() };
                let c = ops::matmul_to(a.as_tensor(), &b, precision, out)?;
                assert_eq!((c.dims(), c.dtype()), (&[batch, m, n][..], out));
                let cd = compute_dtype(precision);
                let (av, bv) = (values(a.as_tensor(), cd)?, values(&b.contiguous()?, cd)?);
                let what = format!("{precision} out {out:?} b_transposed {b_transposed}");
                assert_within(&format!("C {what}"), &c, reference(&av, &bv, (batch, m, k, n)), k, out)?;

                // d(sum(C * G))/dA = G·B^T and /dB = A^T·G, with G rounded to the compute precision.
                let g = Tensor::randn(0f32, 1.0, (batch, m, n), &dev)?.to_dtype(out)?;
                let grads = (c * &g)?.sum_all()?.backward()?;
                let gv = values(&g, cd)?;
                let bt: Vec<f64> = transpose(&bv, batch, k, n);
                let at: Vec<f64> = transpose(&av, batch, m, k);
                let da = grads.get(a.as_tensor()).expect("A has a gradient");
                assert_eq!(da.dtype(), DType::F32, "dA in A's dtype");
                assert_within(
                    &format!("dA {what}"),
                    da,
                    reference(&gv, &bt, (batch, m, n, k)),
                    n,
                    DType::F32,
                )?;
                let db = grads.get(b_var.as_tensor()).expect("B has a gradient");
                let db = if b_transposed { db.transpose(1, 2)? } else { db.clone() };
                assert_within(
                    &format!("dB {what}"),
                    &db.contiguous()?,
                    reference(&at, &gv, (batch, k, m, n)),
                    m,
                    DType::F32,
                )?;
            }
        }
    }
    Ok(())
}

/// `(batch, r, c)` row-major to `(batch, c, r)`.
fn transpose(x: &[f64], batch: usize, r: usize, c: usize) -> Vec<f64> {
    let mut t = vec![0.0; x.len()];
    for p in 0..batch {
        for i in 0..r {
            for j in 0..c {
                t[(p * c + j) * r + i] = x[(p * r + i) * c + j];
            }
        }
    }
    t
}

#[test]
fn batch_dimensions_broadcast_and_fold_like_candle() -> Result<()> {
    let dev = Device::Cpu;
    // (2, 3, m, k) · (k, n): the rank-2 operand broadcasts over both batch dimensions.
    let a = Tensor::randn(0f32, 1.0, (2, 3, 5, 8), &dev)?;
    let b = Tensor::randn(0f32, 1.0, (8, 4), &dev)?;
    let ours = ops::matmul_to(&a, &b, Precision::Fp32, DType::F32)?;
    let candle = a.broadcast_matmul(&b)?;
    assert_eq!(ours.dims(), candle.dims());
    let diff = (ours - candle)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff < 1e-5, "{diff}");
    let bad = Tensor::randn(0f32, 1.0, (7, 4), &dev)?;
    assert!(ops::matmul_to(&a, &bad, Precision::Fp32, DType::F32).is_err());
    Ok(())
}

#[test]
fn forcing_candle_gives_candles_product_and_explain_says_so() -> Result<()> {
    let dev = Device::Cpu;
    let a = Tensor::randn(0f32, 1.0, (16, 32), &dev)?.to_dtype(DType::BF16)?;
    let b = Tensor::randn(0f32, 1.0, (32, 24), &dev)?.to_dtype(DType::BF16)?;
    let auto = dispatch::explain(&dev, Precision::Bf16, Dims::new(16, 24, 32));
    assert_eq!(auto.kernel, MatmulKernel::Amp(GemmPath::choose(Compute::Bf16)), "{auto}");
    let ours = ops::matmul(&a, &b, Precision::Bf16)?;
    let (forced, theirs) = dispatch::with_override(Override::Candle, || {
        (
            dispatch::explain(&dev, Precision::Bf16, Dims::new(16, 24, 32)),
            ops::matmul(&a, &b, Precision::Bf16),
        )
    })
    .expect("candle is always available");
    let theirs = theirs?;
    assert_eq!(dispatch::current_override(), Override::Auto, "restored after the closure");
    assert_eq!(forced.kernel, MatmulKernel::Candle);
    assert!(forced.reason.contains("forced"), "{forced}");
    // Both sum the same bf16 products in f32 and round once to bf16: at most one bf16 ulp apart.
    let (x, y) = (ours.to_dtype(DType::F32)?, theirs.to_dtype(DType::F32)?);
    let rel = ((&x - &y)?.abs()? / (y.abs()? + 1e-3)?)?.max_all()?.to_scalar::<f32>()?;
    assert!(rel <= 2f32.powi(-7), "{rel}");
    Ok(())
}

#[test]
fn a_linear_layer_trains_through_the_gemm_op() -> Result<()> {
    use candle_core::Module;
    let dev = Device::Cpu;
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    let layer = amp::nn::linear(8, 3, vb)?;
    let x = Tensor::randn(0f32, 1.0, (4, 5, 8), &dev)?;
    let y = layer.forward(&x)?;
    assert_eq!(y.dims(), &[4, 5, 3]);
    let grads = y.sqr()?.sum_all()?.backward()?;
    let gw = grads.get(layer.weight().trainable().as_tensor()).expect("weight gradient");
    // dL/dW = sum over rows of 2 y x^T, computed in f64 from the same values.
    let (yv, xv) = (y.reshape((20, 3))?, x.reshape((20, 8))?);
    let want = (yv.t()?.matmul(&xv)? * 2.0)?;
    let diff = (gw - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
    let scale = want.abs()?.max(D::Minus1)?.max(0)?.to_scalar::<f32>()?;
    assert!(diff <= scale * 1e-5, "{diff} vs {scale}");
    Ok(())
}

#[test]
fn linear_with_bias_matches_f64_forward_and_for_all_three_gradients() -> Result<()> {
    let dev = Device::Cpu;
    let (rows, inp, out) = (45, 70, 33);
    for precision in Precision::ALL {
        let cd = precision.dtype();
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3, 15, inp), &dev)?)?;
        let w = Var::from_tensor(&Tensor::randn(0f32, 0.5, (out, inp), &dev)?.to_dtype(cd)?)?;
        let b = Var::from_tensor(&Tensor::randn(0f32, 1.0, out, &dev)?)?;
        let y = ops::linear(x.as_tensor(), w.as_tensor(), Some(b.as_tensor()), precision)?;
        assert_eq!((y.dims(), y.dtype()), (&[3, 15, out][..], cd));
        let (xv, wv, bv) =
            (values(x.as_tensor(), cd)?, values(w.as_tensor(), cd)?, values(b.as_tensor(), DType::F32)?);
        let wt = transpose(&wv, 1, out, inp);
        let (mut want, abs) = reference(&xv, &wt, (1, rows, inp, out));
        for (i, v) in want.iter_mut().enumerate() {
            *v += bv[i % out];
        }
        // The bias starts the f32 chain: one more term in the sum.
        let abs: Vec<f64> = abs.iter().enumerate().map(|(i, a)| a + bv[i % out].abs()).collect();
        assert_within(&format!("y {precision}"), &y.reshape((rows, out))?, (want, abs), inp + 1, cd)?;

        let g = Tensor::randn(0f32, 1.0, (3, 15, out), &dev)?.to_dtype(cd)?;
        let grads = (y * &g)?.sum_all()?.backward()?;
        let gv = values(&g, cd)?;
        let dx = grads.get(x.as_tensor()).expect("x gradient");
        assert_within(
            &format!("dx {precision}"),
            &dx.reshape((rows, inp))?,
            reference(&gv, &wv, (1, rows, out, inp)),
            out,
            DType::F32,
        )?;
        let dw = grads.get(w.as_tensor()).expect("w gradient");
        let gt = transpose(&gv, 1, rows, out);
        assert_within(&format!("dw {precision}"), dw, reference(&gt, &xv, (1, out, rows, inp)), rows, cd)?;
        // The bias gradient: column sums of the rounded upstream gradient, in f32.
        let db = grads.get(b.as_tensor()).expect("bias gradient");
        assert_eq!(db.dtype(), DType::F32);
        let ones = vec![1.0; rows];
        assert_within(
            &format!("db {precision}"),
            db,
            reference(&ones, &gv, (1, 1, rows, out)),
            rows,
            DType::F32,
        )?;
    }
    Ok(())
}

/// An operand that is neither a variable nor computed from one (a batch of data) gets no gradient, as
/// in PyTorch: the product for it is not run. Variables and tensors computed from them get theirs, for
/// plain products and for a Linear with bias, on the portable path and the automatic one.
#[test]
fn operands_that_are_not_tracked_get_no_gradient() -> Result<()> {
    let dev = Device::Cpu;
    for over in [Override::Path(GemmPath::Portable), Override::Auto] {
        dispatch::with_override(over, || -> Result<()> {
            let data = Tensor::randn(0f32, 1.0, (6, 9), &dev)?;
            let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 9), &dev)?)?;
            let b = Var::from_tensor(&Tensor::randn(0f32, 1.0, 4, &dev)?)?;
            let y = ops::linear(&data, &w, Some(&b), Precision::Bf16)?;
            let grads = y.to_dtype(DType::F32)?.sum_all()?.backward()?;
            assert!(grads.get(&data).is_none(), "{over:?}: data got a gradient");
            assert!(grads.get(&w).is_some() && grads.get(&b).is_some(), "{over:?}: parameters lost theirs");
            // A tracked left operand (computed from a variable) keeps its gradient path.
            let h = (w.as_tensor() * 2.0)?;
            let z = ops::matmul(&data, &h.t()?, Precision::Bf16)?;
            let grads = z.to_dtype(DType::F32)?.sum_all()?.backward()?;
            assert!(grads.get(&data).is_none() && grads.get(&w).is_some(), "{over:?}: matmul");
            let want = data.sum(0)?.unsqueeze(0)?.broadcast_as((4, 9))?.affine(2.0, 0.0)?;
            let got = grads.get(&w).expect("w's gradient");
            let err = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(err < 0.1, "{over:?}: w's gradient off by {err}");
            Ok(())
        })??;
    }
    Ok(())
}

#[test]
fn a_linear_whose_weight_does_not_fit_the_input_is_refused_on_every_kernel() -> Result<()> {
    use candle_core::Module;
    let dev = Device::Cpu;
    let weight = Tensor::randn(0f32, 1.0, (30, 20), &dev)?;
    let wide = Tensor::randn(0f32, 1.0, (30, 40), &dev)?;
    let bias = Tensor::zeros(30, DType::F32, &dev)?;
    let short_bias = Tensor::zeros(29, DType::F32, &dev)?;
    let message = |r: Result<Tensor>| r.expect_err("refused").to_string();
    for over in [Override::Auto, Override::Candle] {
        dispatch::with_override(over, || -> Result<()> {
            for precision in Precision::ALL {
                for features in [15, 25] {
                    let x = Tensor::randn(0f32, 1.0, (4, features), &dev)?;
                    for b in [None, Some(&bias)] {
                        let err = message(ops::linear(&x, &weight, b, precision));
                        assert!(err.contains(&format!("{features} features")), "{over:?}: {err}");
                    }
                    // A narrowed weight has columns beyond its width in the same storage.
                    let narrowed = wide.narrow(1, 0, 20)?;
                    let err = message(ops::linear(&x, &narrowed, Some(&bias), precision));
                    assert!(err.contains("takes 20"), "{over:?}: {err}");
                }
                let x = Tensor::randn(0f32, 1.0, (2, 3, 20), &dev)?;
                let err = message(ops::linear(&x, &weight, Some(&short_bias), precision));
                assert!(err.contains("must have shape [30]"), "{over:?}: {err}");
                assert_eq!(ops::linear(&x, &weight, Some(&bias), precision)?.dims(), &[2, 3, 30]);
            }
            Ok(())
        })
        .expect("candle is always available")?;
    }
    let varmap = candle_nn::VarMap::new();
    let layer = amp::nn::linear(20, 30, candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
    let err = message(layer.forward(&Tensor::zeros((4, 15), DType::F32, &dev)?));
    assert!(err.contains("give the input shape (.., 20)"), "{err}");
    Ok(())
}

#[test]
fn a_linear_of_no_input_features_gives_its_bias_on_every_row_in_any_rank() -> Result<()> {
    // Rows of no elements: the sums are empty, so each output row is the bias (and the bias's gradient
    // the row count), whatever the rank; counted as elements over features, the rows would be 0.
    let dev = Device::Cpu;
    let weight = Var::from_tensor(&Tensor::zeros((3, 0), DType::F32, &dev)?)?;
    let bias = Var::new(&[1f32, 2.0, 3.0], &dev)?;
    for over in [Override::Auto, Override::Candle] {
        dispatch::with_override(over, || -> Result<()> {
            for precision in Precision::ALL {
                for dims in [&[10, 0][..], &[2, 5, 0], &[2, 1, 5, 0], &[0]] {
                    let x = Tensor::zeros(dims, DType::F32, &dev)?;
                    let y = ops::linear(&x, &weight, Some(&bias), precision)?;
                    let mut expected = dims.to_vec();
                    *expected.last_mut().expect("a dimension") = 3;
                    assert_eq!(y.dims(), expected, "{over:?} {precision:?} {dims:?}");
                    let rows = y.to_dtype(DType::F32)?.reshape(((), 3))?.to_vec2::<f32>()?;
                    assert!(rows.iter().all(|r| r == &[1.0, 2.0, 3.0]), "{over:?} {precision:?}: {rows:?}");
                    let grads = y.to_dtype(DType::F32)?.sum_all()?.backward()?;
                    let count = rows.len() as f32;
                    let db =
                        grads.get(&bias).expect("a bias gradient").to_dtype(DType::F32)?.to_vec1::<f32>()?;
                    assert_eq!(db, [count; 3], "{over:?} {precision:?} {dims:?}");
                }
            }
            Ok(())
        })
        .expect("candle is always available")?;
    }
    Ok(())
}

/// A bf16 product of a few rows (read in place by every path that has such a kernel: the FMA paths,
/// `vdpbf16ps`, AMX) runs on the dispatcher's path bit for bit, and so does a backward product that
/// reads its operands the same way; under a forced path, on that path. C in f32, where the paths'
/// orders of summation show.
#[test]
fn a_product_of_few_rows_runs_on_the_chosen_path_and_a_forced_path_as_forced() -> Result<()> {
    use amp_kernels::gemm::{gemm_new, MatRef, NewOutput, OutputType};
    let dev = Device::Cpu;
    let (rows, inputs, outputs) = (12, 1000, 40);
    let x = Tensor::randn(0f32, 1.0, (rows, inputs), &dev)?.to_dtype(DType::BF16)?;
    let w = Tensor::randn(0f32, 1.0, (outputs, inputs), &dev)?.to_dtype(DType::BF16)?;
    let (xs, ws) = (x.flatten_all()?.to_vec1::<half::bf16>()?, w.flatten_all()?.to_vec1::<half::bf16>()?);
    let dims = Dims::new(rows, outputs, inputs);
    let (a, b) = (MatRef::row_major(&xs[..], inputs), MatRef::transposed(&ws[..], inputs));
    // C's bits from amp's GEMM on `path`, in f32.
    let f32_bits = |path: GemmPath, dims: Dims, a: MatRef<'_>, b: MatRef<'_>| -> Vec<u32> {
        let c = gemm_new(path, dims, a, b, OutputType::F32, Compute::Bf16, None).expect("runs");
        let NewOutput::F32(c) = c else { panic!("an f32 C") };
        c.iter().map(|v| v.to_bits()).collect()
    };
    let on = |path: GemmPath| f32_bits(path, dims, a, b);
    let bits = |t: Tensor| -> Result<Vec<u32>> {
        Ok(t.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
    };
    // A path that runs everywhere and sums in another order than the chosen one (unless that is the
    // `vdpbf16ps` path, whose model it is).
    let (chosen, forced_path) = (GemmPath::choose(Compute::Bf16), GemmPath::Avx512Bf16Model);
    if chosen != GemmPath::Avx512Bf16 {
        assert_ne!(on(forced_path), on(chosen), "the two paths' sums differ somewhere on this data");
    }
    // x W^T with W's transpose a view: the product reads W in place, as a Linear's forward does.
    let product = || ops::matmul_to(&x, &w.t()?, Precision::Bf16, DType::F32);
    assert_eq!(bits(product()?)?, on(chosen), "automatic: {chosen}");
    let forced = dispatch::with_override(Override::Path(forced_path), product).expect("runs everywhere")?;
    assert_eq!(bits(forced)?, on(forced_path), "forced: {forced_path}");
    // A backward product that reads as the forward does: dA = dC·B^T for a B stored (k, n) in bf16, dC
    // of 12 rows.
    let b_kn = w.t()?.contiguous()?;
    let b_kn_values = b_kn.flatten_all()?.to_vec1::<half::bf16>()?;
    let dc = Tensor::randn(0f32, 1.0, (rows, outputs), &dev)?;
    let dc_values = dc.flatten_all()?.to_vec1::<f32>()?;
    let (da_dims, da_a) = (Dims::new(rows, inputs, outputs), MatRef::row_major(&dc_values[..], outputs));
    let da_b = MatRef::transposed(&b_kn_values[..], outputs);
    let da_on = |path: GemmPath| f32_bits(path, da_dims, da_a, da_b);
    let da = || -> Result<Tensor> {
        let a = Var::from_tensor(&Tensor::randn(0f32, 1.0, (rows, inputs), &dev)?)?;
        let c = ops::matmul_to(a.as_tensor(), &b_kn, Precision::Bf16, DType::F32)?;
        let grads = (c * &dc)?.sum_all()?.backward()?;
        Ok(grads.get(a.as_tensor()).expect("a's gradient").clone())
    };
    assert_eq!(bits(da()?)?, da_on(chosen), "backward, automatic: {chosen}");
    let forced = dispatch::with_override(Override::Path(forced_path), da).expect("runs everywhere")?;
    assert_eq!(bits(forced)?, da_on(forced_path), "backward, forced: {forced_path}");
    Ok(())
}
