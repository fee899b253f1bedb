//! `amp::ops::loss` against f64 references with fp16 and bf16 inputs, near fp16 overflow, and the
//! refusal of `binary_cross_entropy` on half probabilities.
//!
//! Tolerances (normwise relative, `common::tolerance`): the f64 reference sees exactly the half input
//! values, and every loss computes in f32, so the forward carries only f32 arithmetic error (`256
//! u_f32`, no half rounding). The gradient is formed in f32 and rounded once to the half input's dtype:
//! 1 rounding of `u` (2^-11 fp16, 2^-8 bf16), safety factor 2.

mod common;

use amp::ops::loss;
use candle_core::{DType, Device, Result, Tensor};

type Loss = fn(&Tensor, &Tensor) -> Result<Tensor>;

fn reference_smooth_l1(pred: &Tensor, target: &Tensor) -> Result<Tensor> {
    let d = (pred - target)?;
    let quadratic = (d.sqr()? * 0.5)?;
    let linear = (d.abs()? - 0.5)?;
    d.abs()?.lt(1.0)?.where_cond(&quadratic, &linear)?.mean_all()
}

fn reference_bce_with_logits(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let p = (logits.neg()?.exp()? + 1.0)?.recip()?;
    let terms = ((targets * p.log()?)? + (targets.affine(-1.0, 1.0)? * p.affine(-1.0, 1.0)?.log()?)?)?;
    terms.mean_all()?.neg()
}

#[test]
fn losses_match_f64_in_fp16_and_bf16_forward_and_backward() -> Result<()> {
    let classes = Tensor::new(&[3u32, 0, 9, 4, 4, 7, 1, 2], &Device::Cpu)?;
    let regression: [(&str, Loss, Loss); 4] = [
        ("mse", loss::mse, candle_nn::loss::mse),
        ("l1", loss::l1, |p, t| (p - t)?.abs()?.mean_all()),
        ("smooth_l1", |p, t| loss::smooth_l1(p, t, 1.0), reference_smooth_l1),
        ("bce_with_logits", loss::binary_cross_entropy_with_logits, reference_bce_with_logits),
    ];
    for half in [DType::F16, DType::BF16] {
        let (fwd_tol, grad_tol) = (common::tolerance(half, 0, 1.0), common::tolerance(half, 1, 2.0));
        let logits = common::randn_in(1, &[8, 10], 2.0, half)?;
        let logits64 = logits.to_dtype(DType::F64)?;

        let (y, grad) = common::value_and_grad(|x| loss::cross_entropy(x, &classes), &logits)?;
        let (y_ref, grad_ref) =
            common::value_and_grad(|x| candle_nn::loss::cross_entropy(x, &classes), &logits64)?;
        assert_eq!((y.dtype(), y.rank(), grad.dtype()), (DType::F32, 0, half));
        common::assert_close(&format!("cross_entropy {half:?} forward"), &y, &y_ref, fwd_tol)?;
        common::assert_close(&format!("cross_entropy {half:?} grad"), &grad, &grad_ref, grad_tol)?;

        let log_probs = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, 1)?.to_dtype(half)?;
        let (y, grad) = common::value_and_grad(|x| loss::nll(x, &classes), &log_probs)?;
        let (y_ref, grad_ref) =
            common::value_and_grad(|x| candle_nn::loss::nll(x, &classes), &log_probs.to_dtype(DType::F64)?)?;
        common::assert_close(&format!("nll {half:?} forward"), &y, &y_ref, fwd_tol)?;
        common::assert_close(&format!("nll {half:?} grad"), &grad, &grad_ref, grad_tol)?;

        let targets = common::uniform_in(2, &[8, 10], 0.0, 1.0, DType::F32)?;
        let targets64 = targets.to_dtype(DType::F64)?;
        for (name, amp_loss, reference) in regression {
            let (y, grad) = common::value_and_grad(|x| amp_loss(x, &targets), &logits)?;
            let (y_ref, grad_ref) = common::value_and_grad(|x| reference(x, &targets64), &logits64)?;
            assert_eq!((y.dtype(), y.rank(), grad.dtype()), (DType::F32, 0, half), "{name}");
            common::assert_close(&format!("{name} {half:?} forward"), &y, &y_ref, fwd_tol)?;
            common::assert_close(&format!("{name} {half:?} grad"), &grad, &grad_ref, grad_tol)?;
        }
    }
    Ok(())
}

#[test]
fn binary_cross_entropy_on_f32_matches_f64_and_clamps_the_log_at_minus_100() -> Result<()> {
    let probs = common::uniform_in(3, &[6, 7], 0.02, 0.98, DType::F32)?;
    let targets = common::uniform_in(4, &[6, 7], 0.0, 1.0, DType::F32)?;
    let bce = |p: &Tensor| loss::binary_cross_entropy(p, &targets).map_err(candle_core::Error::from);
    let reference = |p: &Tensor| {
        let t = targets.to_dtype(DType::F64)?;
        ((&t * p.log()?)? + (t.affine(-1.0, 1.0)? * p.affine(-1.0, 1.0)?.log()?)?)?.mean_all()?.neg()
    };
    let (y, grad) = common::value_and_grad(bce, &probs)?;
    let (y_ref, grad_ref) = common::value_and_grad(reference, &probs.to_dtype(DType::F64)?)?;
    // f32 input, f32 arithmetic throughout: only `256 u_f32`.
    let f32_tol = common::tolerance(DType::F32, 0, 1.0);
    common::assert_close("bce f32 forward", &y, &y_ref, f32_tol)?;
    common::assert_close("bce f32 grad", &grad, &grad_ref, f32_tol)?;

    // Saturated probabilities: log(0) is clamped to -100 (PyTorch's rule), and the gradient stays
    // finite, also at p = 1 with y = 1, where `maximum(log(1 - p), -100)` would give 0/0.
    let p = Tensor::new(&[0.0f32, 1.0, 1.0, 0.5], &Device::Cpu)?;
    let y = Tensor::new(&[1.0f32, 0.0, 1.0, 1.0], &Device::Cpu)?;
    let (value, grad) = common::value_and_grad(|p| Ok(loss::binary_cross_entropy(p, &y)?), &p)?;
    let expected = (100.0 + 100.0 + 0.0 + std::f64::consts::LN_2) / 4.0;
    assert!((value.to_scalar::<f32>()? as f64 - expected).abs() < 1e-5, "{value}");
    assert!(common::all_finite(&grad)?, "gradient at saturated probabilities: {grad}");
    Ok(())
}

#[test]
fn binary_cross_entropy_refuses_half_input_and_names_the_logits_form() -> Result<()> {
    let targets = Tensor::new(&[1.0f32, 0.0], &Device::Cpu)?;
    for (dtype, name) in [(DType::F16, "fp16"), (DType::BF16, "bf16")] {
        let probs = Tensor::new(&[0.9f32, 0.2], &Device::Cpu)?.to_dtype(dtype)?;
        let err = loss::binary_cross_entropy(&probs, &targets).expect_err("half input must be refused");
        assert!(matches!(err, amp::Error::BinaryCrossEntropyInHalf { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            format!(
                "binary_cross_entropy on a {name} input is unsafe in half precision (log of probabilities near \
                 0 and 1 underflows); pass logits to binary_cross_entropy_with_logits instead"
            )
        );
    }
    Ok(())
}

#[test]
fn near_fp16_overflow_losses_stay_finite_and_correct_where_half_overflows() -> Result<()> {
    // Predictions and logits in [3e4, 6e4): representable in fp16, but squares, exponentials and the
    // sums over the batch are not.
    let x = common::uniform_in(5, &[16, 40], 3e4, 6e4, DType::F16)?;
    let x64 = x.to_dtype(DType::F64)?;
    let zeros = Tensor::zeros((16, 40), DType::F32, &Device::Cpu)?;
    let classes = Tensor::arange(0u32, 16, &Device::Cpu)?;
    let exact = common::tolerance(DType::F16, 0, 1.0);

    let naive_mse = (&x - zeros.to_dtype(DType::F16)?)?.sqr()?.mean_all()?;
    assert!(!common::all_finite(&naive_mse)?, "fp16 mse overflows");
    let (y, grad) = common::value_and_grad(|x| loss::mse(x, &zeros), &x)?;
    assert!(common::all_finite(&grad)?);
    common::assert_close(
        "mse near fp16 overflow",
        &y,
        &candle_nn::loss::mse(&x64, &zeros.to_dtype(DType::F64)?)?,
        exact,
    )?;

    let naive_ce = x.exp()?.sum_keepdim(1)?.log()?.sum_all()?;
    assert!(!common::all_finite(&naive_ce)?, "fp16 log-sum-exp overflows");
    let (y, grad) = common::value_and_grad(|x| loss::cross_entropy(x, &classes), &x)?;
    assert!(common::all_finite(&grad)?);
    common::assert_close(
        "cross_entropy near fp16 overflow",
        &y,
        &candle_nn::loss::cross_entropy(&x64, &classes)?,
        exact,
    )?;

    let naive_l1 = x.abs()?.mean_all()?;
    assert!(!common::all_finite(&naive_l1)?, "fp16 sum of the batch overflows");
    let l1 = loss::l1(&x, &zeros)?;
    common::assert_close("l1 near fp16 overflow", &l1, &x64.abs()?.mean_all()?, exact)?;

    // Targets 0: the loss is mean(x) + mean(log(1 + e^-x)), and e^-x underflows even f64 here.
    let sigmoid = (x.neg()?.exp()? + 1.0)?.recip()?;
    let naive_bce = sigmoid.affine(-1.0, 1.0)?.log()?.neg()?.mean_all()?;
    assert!(!common::all_finite(&naive_bce)?, "fp16 bce through the sigmoid saturates: log(1 - 1)");
    let (bce, grad) = common::value_and_grad(|x| loss::binary_cross_entropy_with_logits(x, &zeros), &x)?;
    assert!(common::all_finite(&grad)?);
    common::assert_close("bce_with_logits near fp16 overflow", &bce, &x64.mean_all()?, exact)?;

    assert!(loss::smooth_l1(&x, &zeros, -1.0).is_err(), "negative beta is refused");
    let l1_again = loss::smooth_l1(&x, &zeros, 0.0)?;
    assert_eq!(l1_again.to_scalar::<f32>()?, l1.to_scalar::<f32>()?, "beta = 0 is the L1 loss");
    Ok(())
}

/// The one-op mean squared error (same shapes) and candle's chain (broadcast target) against f64, with
/// gradients of both operands: `2 (p - t) / n` and its negative. The f32 forward sums squares in f64,
/// so only its final rounding (and the f32 differences) separate it from the reference.
#[test]
fn mse_gradients_reach_both_operands_and_broadcast_targets_fall_back() -> Result<()> {
    let pred = candle_core::Var::from_tensor(&common::randn_in(5, &[16, 12], 1.5, DType::F32)?)?;
    for target_shape in [&[16usize, 12][..], &[12][..]] {
        let target = candle_core::Var::from_tensor(&common::randn_in(6, target_shape, 1.0, DType::F32)?)?;
        let loss = loss::mse(&pred, &target)?;
        let grads = loss.backward()?;
        let (p64, t64) = (pred.to_dtype(DType::F64)?, target.to_dtype(DType::F64)?.broadcast_as((16, 12))?);
        let d = (&p64 - &t64)?;
        let want = d.sqr()?.mean_all()?.to_scalar::<f64>()?;
        let got = f64::from(loss.to_scalar::<f32>()?);
        assert!(
            (got - want).abs() <= want * 4.0 * f64::from(f32::EPSILON),
            "{target_shape:?}: {got} vs {want}"
        );
        let dp_want = d.affine(2.0 / 192.0, 0.0)?;
        let dp = grads.get(&pred).expect("pred's gradient");
        common::assert_close(
            &format!("{target_shape:?} dpred"),
            dp,
            &dp_want,
            common::tolerance(DType::F32, 2, 2.0),
        )?;
        let dt = grads.get(&target).expect("target's gradient");
        let dt_want = dp_want.neg()?.sum_keepdim(0)?;
        let dt_want = if target_shape.len() == 1 { dt_want.squeeze(0)? } else { dp_want.neg()? };
        common::assert_close(
            &format!("{target_shape:?} dtarget"),
            dt,
            &dt_want,
            common::tolerance(DType::F32, 2, 2.0),
        )?;
    }
    Ok(())
}

#[test]
fn targets_that_are_not_class_indices_and_an_empty_batch_are_refused() -> Result<()> {
    let logits = Tensor::zeros((3, 5), DType::F32, &Device::Cpu)?;
    for (targets, bad) in
        [(vec![0i64, -1, 2], "target -1 (element 1"), (vec![0, 5, 2], "target 5 (element 1")]
    {
        let targets = Tensor::new(targets.as_slice(), &Device::Cpu)?;
        let err = loss::cross_entropy(&logits, &targets).expect_err("refused").to_string();
        assert!(err.contains(bad) && err.contains("there are 5 classes"), "{err}");
    }
    let ignored = Tensor::new(&[0i64, -100, 2], &Device::Cpu)?;
    let err = loss::cross_entropy(&logits, &ignored).expect_err("refused").to_string();
    assert!(err.contains("must be left out of the batch"), "{err}");
    let empty = Tensor::zeros((0, 5), DType::F32, &Device::Cpu)?;
    let none = Tensor::zeros(0, DType::U32, &Device::Cpu)?;
    let err = loss::cross_entropy(&empty, &none).expect_err("refused").to_string();
    assert!(err.contains("empty batch"), "{err}");
    Ok(())
}

#[test]
fn a_prediction_and_target_that_broadcast_into_each_other_are_refused() -> Result<()> {
    // (N, 1) against (N): the classic trap, a (N, N) grid of every prediction against every target.
    let pred = Tensor::zeros((4, 1), DType::F32, &Device::Cpu)?;
    let target = Tensor::zeros(4, DType::F32, &Device::Cpu)?;
    for result in [loss::mse(&pred, &target), loss::l1(&pred, &target), loss::smooth_l1(&pred, &target, 1.0)]
    {
        let err = result.expect_err("refused").to_string();
        assert!(err.contains("[4, 1] and target [4] broadcast to [4, 4]"), "{err}");
    }
    assert_eq!(loss::mse(&pred, &target.unsqueeze(1)?)?.dims(), &[] as &[usize]);
    Ok(())
}
