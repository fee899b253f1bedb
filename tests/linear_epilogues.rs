//! `Linear::forward_relu` and `Linear::forward_gelu` (the activation as the epilogue of the layer's
//! GEMM op) and `ops::relu` (one pass each way): the same values and gradients as the layer followed by
//! the separate op, bit for bit, in fp32 and under O2 bf16 / fp16; and the fused fp32 ReLU layer against
//! an f64 reference of `relu(x W^T + b)` and its three gradients (GELU's own accuracy is tested against
//! f64 in `ops::gelu`).
//!
//! Tolerance of the f64 comparison: every output and gradient element is one f32 sum of `k` products
//! (k = 48 inputs for the output and `dx`, 40 rows for `dW` and `db`), so its error is at most
//! `gamma_k sum |terms|` with `gamma_k = k 2^-24`; the mask is exact (the references mask where the
//! f64 pre-activation is positive, and the inputs keep every pre-activation at least 1e-3 from 0, far
//! beyond the sum's error, so both sides mask the same elements).

mod common;

use amp::nn::{linear, Linear};
use amp::varmap::SeededInit;
use amp::{ops, AmpConfig, AmpModule, OptLevel, Precision};
use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_nn::VarMap;

#[derive(AmpModule)]
struct One {
    fc: Linear,
}

const ROWS: usize = 40;
const INPUTS: usize = 48;
const OUTPUTS: usize = 24;

/// The layer under `config`, a variable input, and the upstream gradient, all drawn from `seed`.
fn setup(config: AmpConfig, seed: u64) -> Result<(One, Var, Tensor)> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let vb = SeededInit::new(seed).var_builder(&varmap, DType::F32, &dev);
    let mut model = One { fc: linear(INPUTS, OUTPUTS, vb.pp("fc"))? };
    amp::initialize(&mut model, config).map_err(candle_core::Error::wrap)?;
    let x = Var::from_tensor(&common::randn_in(seed + 1, &[ROWS, INPUTS], 1.0, DType::F32)?)?;
    let g = common::randn_in(seed + 2, &[ROWS, OUTPUTS], 1.0, DType::F32)?;
    Ok((model, x, g))
}

/// The activations an epilogue can fuse.
#[derive(Clone, Copy, Debug)]
enum Act {
    Relu,
    Gelu,
}

/// The output, and the gradients of `x`, the weight and the bias of `sum(y * g)`, with `act` fused
/// into the layer or applied after it.
fn run(model: &One, x: &Var, g: &Tensor, act: Act, fused: bool) -> Result<[Tensor; 4]> {
    let y = match (act, fused) {
        (Act::Relu, true) => model.fc.forward_relu(x)?,
        (Act::Relu, false) => ops::relu(&model.fc.forward(x)?)?,
        (Act::Gelu, true) => model.fc.forward_gelu(x)?,
        (Act::Gelu, false) => ops::gelu(&model.fc.forward(x)?)?,
    };
    let grads = (y.to_dtype(DType::F32)? * g)?.sum_all()?.backward()?;
    let param_grad = |p: &amp::Param| -> Result<Tensor> {
        let grad = p.grad("fc", &grads).map_err(candle_core::Error::wrap)?;
        Ok(grad.expect("a gradient").clone())
    };
    let (w, b) = (param_grad(model.fc.weight())?, param_grad(model.fc.bias().expect("a bias"))?);
    Ok([y, grads.get(x).expect("x's gradient").clone(), w, b])
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
}

#[test]
fn fused_activations_are_the_layer_then_the_op_bit_for_bit_in_every_precision() -> Result<()> {
    let dev = Device::Cpu;
    let configs = [
        AmpConfig { opt_level: OptLevel::O0, half: Precision::Bf16 },
        AmpConfig::new(OptLevel::O2, &dev).with_half(Precision::Bf16),
        AmpConfig::new(OptLevel::O2, &dev).with_half(Precision::Fp16),
    ];
    for (config, act) in configs.into_iter().flat_map(|c| [(c, Act::Relu), (c, Act::Gelu)]) {
        let (model, x, g) = setup(config, 7)?;
        let fused = run(&model, &x, &g, act, true)?;
        let apart = run(&model, &x, &g, act, false)?;
        for (what, (f, a)) in ["y", "dx", "dW", "db"].iter().zip(fused.iter().zip(&apart)) {
            assert_eq!(f.dtype(), a.dtype(), "{act:?} {what} under {config:?}");
            assert_eq!(bits(f)?, bits(a)?, "{act:?} {what} under {config:?}");
        }
        let zeros = fused[0].to_dtype(DType::F32)?.eq(0f64)?.to_dtype(DType::F32)?.sum_all()?;
        let clamped = zeros.to_scalar::<f32>()? > 100.0;
        assert_eq!(clamped, matches!(act, Act::Relu), "{act:?}: about half the outputs clamped by ReLU only");
    }
    Ok(())
}

#[test]
fn fused_fp32_layer_matches_the_f64_reference() -> Result<()> {
    // Seed 3: no pre-activation within 1e-3 of 0 (asserted below; the draws are seeded).
    let (model, x, g) = setup(AmpConfig { opt_level: OptLevel::O0, half: Precision::Bf16 }, 3)?;
    let f64s = |t: &Tensor| -> Result<Vec<f64>> { t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>() };
    let (xv, gv) = (f64s(x.as_tensor())?, f64s(&g)?);
    let (wv, bv) = (f64s(model.fc.weight().master().as_tensor())?, f64s(model.fc.bias().unwrap().master())?);
    // Pre-activation, its sum of |terms|, and the masked upstream gradient.
    let mut pre = vec![0f64; ROWS * OUTPUTS];
    let mut pre_abs = vec![0f64; ROWS * OUTPUTS];
    for r in 0..ROWS {
        for o in 0..OUTPUTS {
            let terms = (0..INPUTS).map(|i| xv[r * INPUTS + i] * wv[o * INPUTS + i]);
            pre[r * OUTPUTS + o] = terms.clone().sum::<f64>() + bv[o];
            pre_abs[r * OUTPUTS + o] = terms.map(f64::abs).sum::<f64>() + bv[o].abs();
        }
    }
    let margin = pre.iter().map(|p| p.abs()).fold(f64::INFINITY, f64::min);
    assert!(margin > 1e-3, "a pre-activation within {margin:e} of 0: pick another seed");
    let dpre: Vec<f64> = pre.iter().zip(&gv).map(|(&p, &g)| if p > 0.0 { g } else { 0.0 }).collect();
    let [y, dx, dw, db] = run(&model, &x, &g, Act::Relu, true)?;
    let gamma = |k: usize| k as f64 * 2f64.powi(-24) * 1.01;
    let check = |what: &str, got: &Tensor, want: &dyn Fn(usize) -> (f64, f64), k: usize| -> Result<()> {
        for (i, got) in f64s(got)?.into_iter().enumerate() {
            let (want, abs) = want(i);
            let bound = gamma(k) * abs + 2f64.powi(-24) * want.abs();
            assert!((got - want).abs() <= bound, "{what}[{i}]: {got:e} vs {want:e}, bound {bound:e}");
        }
        Ok(())
    };
    check("y", &y, &|i| (pre[i].max(0.0), if pre[i] > 0.0 { pre_abs[i] } else { 0.0 }), INPUTS + 1)?;
    check(
        "dx",
        &dx,
        &|i| {
            let (r, c) = (i / INPUTS, i % INPUTS);
            let terms = (0..OUTPUTS).map(|o| dpre[r * OUTPUTS + o] * wv[o * INPUTS + c]);
            (terms.clone().sum(), terms.map(f64::abs).sum())
        },
        OUTPUTS,
    )?;
    check(
        "dW",
        &dw,
        &|i| {
            let (o, c) = (i / INPUTS, i % INPUTS);
            let terms = (0..ROWS).map(|r| dpre[r * OUTPUTS + o] * xv[r * INPUTS + c]);
            (terms.clone().sum(), terms.map(f64::abs).sum())
        },
        ROWS,
    )?;
    check(
        "db",
        &db,
        &|o| {
            let terms = (0..ROWS).map(|r| dpre[r * OUTPUTS + o]);
            (terms.clone().sum(), terms.map(f64::abs).sum())
        },
        ROWS,
    )
}

#[test]
fn relu_op_keeps_nan_passes_no_gradient_at_zero_and_keeps_the_dtype() -> Result<()> {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let values = [-2.0f32, -0.0, 0.0, 0.5, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 3.0];
        let x = Var::from_tensor(&Tensor::new(&values, &dev)?.to_dtype(dtype)?)?;
        let y = ops::relu(&x)?;
        assert_eq!(y.dtype(), dtype);
        let got = y.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        assert_eq!(&got[..4], &[0.0, 0.0, 0.0, 0.5]);
        assert!(got[4].is_nan(), "a NaN stays NaN ({dtype:?})");
        assert_eq!(&got[5..], &[f32::INFINITY, 0.0, 3.0]);
        let dy = Tensor::new(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], &dev)?.to_dtype(dtype)?;
        let grads = (y * dy)?.to_dtype(DType::F32)?.sum_all()?.backward()?;
        let dx = grads.get(&x).expect("a gradient");
        assert_eq!(dx.dtype(), dtype);
        assert_eq!(dx.to_dtype(DType::F32)?.to_vec1::<f32>()?, [0.0, 0.0, 0.0, 4.0, 0.0, 6.0, 0.0, 8.0]);
    }
    Ok(())
}
