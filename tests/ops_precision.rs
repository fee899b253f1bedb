//! `amp::ops` against f64 references: the fp32 class (exp, log, pow, softmax, reductions, ...), the
//! promote class and the matmul class, forward and gradient, with fp16 and bf16 inputs.
//!
//! Tolerances (normwise relative error, `common::tolerance`): the inputs are half values and the f64
//! reference sees exactly those values, so an fp32-class forward has no half rounding at all, only f32
//! arithmetic (`256 u_f32`). Its gradient is formed in f32 and rounded once to the half input's dtype:
//! one rounding, `u` (2^-11 fp16, 2^-8 bf16), times a safety factor of 2. Matmul-class ops round each
//! operand and the result: 3 roundings (4 with a bias), safety factor 4, because a sum of products
//! whose terms cancel amplifies the operands' relative errors by `|A||B| / |AB|`, about 1-2 here.

mod common;

use amp::{ops, Precision};
use candle_core::{DType, Device, Result, Tensor};

const HALVES: [DType; 2] = [DType::F16, DType::BF16];

type Op = fn(&Tensor) -> Result<Tensor>;

#[test]
fn fp32_ops_match_f64_in_fp16_and_bf16_forward_and_backward() -> Result<()> {
    let cases: [(&str, Op, Op, bool); 15] = [
        ("exp", ops::exp, |x| x.exp(), false),
        ("log", ops::log, |x| x.log(), true),
        ("pow", |x| ops::pow(x, 1.5), |x| x.powf(1.5), true),
        ("softmax", |x| ops::softmax(x, 1), |x| candle_nn::ops::softmax(x, 1), false),
        ("log_softmax", |x| ops::log_softmax(x, 1), |x| candle_nn::ops::log_softmax(x, 1), false),
        ("sum", |x| ops::sum(x, 1), |x| x.sum(1), false),
        ("sum_keepdim", |x| ops::sum_keepdim(x, 1), |x| x.sum_keepdim(1), false),
        ("mean", |x| ops::mean(x, 0), |x| x.mean(0), false),
        ("mean_keepdim", |x| ops::mean_keepdim(x, 0), |x| x.mean_keepdim(0), false),
        ("sum_all", ops::sum_all, |x| x.sum_all(), false),
        ("mean_all", ops::mean_all, |x| x.mean_all(), false),
        ("norm", ops::norm, |x| x.sqr()?.sum_all()?.sqrt(), false),
        ("cumsum", |x| ops::cumsum(x, 1), |x| x.cumsum(1), false),
        ("var", |x| ops::var(x, 1), |x| x.var_keepdim(1)?.squeeze(1), false),
        ("std", |x| ops::std(x, 1), |x| x.var_keepdim(1)?.sqrt()?.squeeze(1), false),
    ];
    for half in HALVES {
        let normal = common::randn_in(1, &[6, 40], 2.0, half)?;
        let positive = (normal.to_dtype(DType::F32)?.abs()? + 0.25)?.to_dtype(half)?;
        for (name, amp_op, reference, needs_positive) in cases {
            let x = if needs_positive { &positive } else { &normal };
            let (y, grad) = common::value_and_grad(amp_op, x)?;
            let (y_ref, grad_ref) = common::value_and_grad(reference, &x.to_dtype(DType::F64)?)?;
            assert_eq!(y.dtype(), DType::F32, "{name} returns f32");
            assert_eq!(grad.dtype(), half, "{name}: the gradient returns in the input's dtype");
            common::assert_close(
                &format!("{name} {half:?} forward"),
                &y,
                &y_ref,
                common::tolerance(half, 0, 1.0),
            )?;
            common::assert_close(
                &format!("{name} {half:?} grad"),
                &grad,
                &grad_ref,
                common::tolerance(half, 1, 2.0),
            )?;
        }
    }
    Ok(())
}

#[test]
fn summing_ten_thousand_half_ones_is_exact_in_ops_but_not_in_candle() -> Result<()> {
    for (half, candle_gives) in [(DType::F16, 2048.0), (DType::BF16, 256.0)] {
        let ones = Tensor::ones(10_000, half, &Device::Cpu)?;
        // The trap: candle accumulates in the storage dtype; once the sum's ulp exceeds 2, adding 1 rounds
        // back to the same value (2048 = 2^(10+1) in fp16, 256 = 2^(7+1) in bf16).
        let naive = ones.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        assert_eq!(naive, candle_gives, "candle's own {half:?} sum");
        assert_eq!(ops::sum_all(&ones)?.to_scalar::<f32>()?, 10_000.0);
        assert_eq!(ops::sum(&ones, 0)?.to_scalar::<f32>()?, 10_000.0);
        assert_eq!(ops::mean_all(&ones)?.to_scalar::<f32>()?, 1.0);
        assert_eq!(ops::norm(&ones)?.to_scalar::<f32>()?, 100.0);
    }
    Ok(())
}

#[test]
fn near_fp16_overflow_fp32_ops_stay_finite_and_correct_where_half_overflows() -> Result<()> {
    // Values in [3e4, 6e4): representable in fp16 (max 65504), but their squares, sums and exponentials
    // are not.
    let x = common::uniform_in(5, &[4, 64], 3e4, 6e4, DType::F16)?;
    let x64 = x.to_dtype(DType::F64)?;
    let exact = common::tolerance(DType::F16, 0, 1.0);
    let cases: [(&str, Op, Op, Op); 4] = [
        ("norm", ops::norm, |x| x.sqr()?.sum_all()?.sqrt(), |x| x.sqr()?.sum_all()?.sqrt()),
        ("sum", ops::sum_all, |x| x.sum_all(), |x| x.sum_all()),
        ("var", |x| ops::var(x, 1), |x| x.var_keepdim(1)?.squeeze(1), |x| x.var_keepdim(1)?.squeeze(1)),
        (
            "softmax",
            |x| ops::softmax(x, 1),
            |x| candle_nn::ops::softmax(x, 1),
            |x| {
                let e = x.exp()?;
                e.broadcast_div(&e.sum_keepdim(1)?)
            },
        ),
    ];
    for (name, amp_op, reference, naive) in cases {
        let naive_half = naive(&x)?;
        assert!(!common::all_finite(&naive_half)?, "{name}: the naive fp16 path overflows");
        let (y, grad) = common::value_and_grad(amp_op, &x)?;
        assert!(common::all_finite(&grad)?, "{name}: the gradient is finite");
        common::assert_close(&format!("{name} near fp16 overflow"), &y, &reference(&x64)?, exact)?;
    }
    Ok(())
}

#[test]
fn promote_ops_compute_in_the_widest_dtype() -> Result<()> {
    use DType::{BF16, F16, F32, F64, U32};
    assert_eq!(ops::widest_dtype([F16, F16]), Some(F16));
    assert_eq!(ops::widest_dtype([BF16, F16]), Some(F32), "neither half holds the other");
    assert_eq!(ops::widest_dtype([BF16, F32, F16]), Some(F32));
    assert_eq!(ops::widest_dtype([F32, F64]), Some(F64));
    assert_eq!(ops::widest_dtype([U32, BF16]), Some(BF16));
    assert_eq!(ops::widest_dtype([U32, U32]), None);
    // 1 + 2^-10 (fp16) plus 256 (bf16) is exact in f32; fp16 would round it to 257, bf16 to 256.
    let a = Tensor::new(&[1.0f32 + 2f32.powi(-10)], &Device::Cpu)?.to_dtype(F16)?;
    let b = Tensor::new(&[256.0f32], &Device::Cpu)?.to_dtype(BF16)?;
    let sum = ops::add(&a, &b)?;
    assert_eq!((sum.dtype(), sum.to_vec1::<f32>()?[0]), (F32, 257.0 + 2f32.powi(-10)));

    type Binary = fn(&Tensor, &Tensor) -> Result<Tensor>;
    let cases: [(&str, Binary); 8] = [
        ("add", ops::add),
        ("sub", ops::sub),
        ("mul", ops::mul),
        ("div", ops::div),
        ("maximum", ops::maximum),
        ("minimum", ops::minimum),
        ("cat", |a, b| ops::cat(&[a, b], 1)),
        ("stack", |a, b| ops::stack(&[a, b], 0)),
    ];
    for half in HALVES {
        let a = common::randn_in(2, &[3, 8], 1.0, half)?;
        let b = (common::randn_in(3, &[3, 8], 1.0, F32)?.abs()? + 0.5)?; // f32, away from 0 for div
        for (name, op) in cases {
            let (y, grad_a) = common::value_and_grad(|a| op(a, &b), &a)?;
            let (y_ref, grad_ref) = common::value_and_grad(|a| op(a, &b.to_dtype(F64)?), &a.to_dtype(F64)?)?;
            assert_eq!(y.dtype(), F32, "{name}: {half:?} with f32 computes in f32");
            // One f32 rounding forward; the gradient is rounded once to the half input's dtype.
            common::assert_close(
                &format!("{name} {half:?} forward"),
                &y,
                &y_ref,
                common::tolerance(half, 0, 1.0),
            )?;
            common::assert_close(
                &format!("{name} {half:?} grad"),
                &grad_a,
                &grad_ref,
                common::tolerance(half, 1, 2.0),
            )?;
        }
    }
    Ok(())
}

#[test]
fn matmul_and_linear_compute_in_the_requested_precision() -> Result<()> {
    let a = common::randn_in(7, &[2, 5, 48], 1.0, DType::F32)?;
    let b = common::randn_in(8, &[48, 24], 0.2, DType::F32)?;
    let bias = common::randn_in(9, &[24], 0.5, DType::F32)?;
    let bt = b.t()?.contiguous()?;
    let (a64, b64, bias64) = (a.to_dtype(DType::F64)?, b.to_dtype(DType::F64)?, bias.to_dtype(DType::F64)?);
    for half in [Precision::Fp16, Precision::Bf16] {
        let h = half.dtype();
        let (y, grad) = common::value_and_grad(|a| ops::matmul(a, &b, half), &a)?;
        let (y_ref, grad_ref) = common::value_and_grad(|a| a.broadcast_matmul(&b64), &a64)?;
        assert_eq!((y.dtype(), grad.dtype()), (h, DType::F32));
        common::assert_close(&format!("matmul {half} forward"), &y, &y_ref, common::tolerance(h, 3, 4.0))?;
        common::assert_close(&format!("matmul {half} grad"), &grad, &grad_ref, common::tolerance(h, 3, 4.0))?;

        let (y, grad) = common::value_and_grad(|a| ops::linear(a, &bt, Some(&bias), half), &a)?;
        let reference = |a: &Tensor| a.broadcast_matmul(&b64)?.broadcast_add(&bias64);
        let (y_ref, grad_ref) = common::value_and_grad(reference, &a64)?;
        assert_eq!(y.dtype(), h);
        common::assert_close(&format!("linear {half} forward"), &y, &y_ref, common::tolerance(h, 4, 4.0))?;
        common::assert_close(&format!("linear {half} grad"), &grad, &grad_ref, common::tolerance(h, 3, 4.0))?;
    }
    Ok(())
}
