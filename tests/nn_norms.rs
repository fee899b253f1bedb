//! `amp::nn::BatchNorm`, `GroupNorm` and `RmsNorm`: fp32 statistics, the running-statistics update, train vs eval,
//! f64 references with fp16 and bf16 inputs, inputs near fp16 overflow, and candle-nn parity.
//!
//! Tolerances (normwise relative, `common::tolerance`): both layers compute in f32 on the half input's
//! exact values, and round the output once to the input's dtype: 1 rounding of `u` (2^-11 fp16, 2^-8
//! bf16), safety 2. The input gradient passes 2 roundings (the upstream gradient into the half output,
//! the result into the half input), the weight and bias gradients 1 (the upstream gradient; their sums
//! are f32); safety 4 for the input gradient, whose projection `g - mean(g) - x_hat mean(g x_hat)`
//! cancels part of `g`.

mod common;

use amp::nn::{batch_norm, group_norm, BatchNorm, BatchNormConfig, GroupNorm, RmsNorm};
use amp::{Layer, LayerPrecision, Param};
use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_nn::{ModuleT, VarBuilder, VarMap};

const HALVES: [DType; 2] = [DType::F16, DType::BF16];
const EPS: f64 = 1e-5;

fn values(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// `(x - mean) / sqrt(var + eps) * w + b` in f64 over `dims`, biased variance, per channel (dim 1).
fn reference_norm(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    dims: &[usize],
    stats: Option<(&Tensor, &Tensor)>,
) -> Result<Tensor> {
    let mut shape = vec![1; x.rank()];
    shape[1] = w.elem_count();
    let (mean, var) = match stats {
        Some((m, v)) => (m.reshape(shape.as_slice())?, v.reshape(shape.as_slice())?),
        None => {
            let mean = x.mean_keepdim(dims)?;
            let var = x.broadcast_sub(&mean)?.sqr()?.mean_keepdim(dims)?;
            (mean, var)
        }
    };
    let normed = x.broadcast_sub(&mean)?.broadcast_div(&(var + EPS)?.sqrt()?)?;
    normed.broadcast_mul(&w.reshape(shape.as_slice())?)?.broadcast_add(&b.reshape(shape.as_slice())?)
}

fn bn_layer(t: &[Tensor], stats: (&Tensor, &Tensor)) -> Result<BatchNorm> {
    let (mean, var) = (Var::from_tensor(&stats.0.copy()?)?, Var::from_tensor(&stats.1.copy()?)?);
    let affine = Some((Param::from_tensor(&t[1])?, Param::from_tensor(&t[2])?));
    BatchNorm::new(mean, var, affine, BatchNormConfig::default())
}

#[test]
fn batch_norm_running_statistics_follow_the_momentum_formula_exactly_in_f32() -> Result<()> {
    let varmap = VarMap::new();
    let config = BatchNormConfig { momentum: 0.25, ..Default::default() };
    let bn = batch_norm(2, config, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
    // Channel 0 of the first batch is {256, 258} in bf16: its mean 257 and the running mean 64.25 are
    // not bf16 values (spacing 2 and 0.5 there), so only f32 statistics can hold them.
    assert_ne!(values(&Tensor::new(64.25f32, &Device::Cpu)?.to_dtype(DType::BF16)?)?, [64.25]);
    let batches = [[[256.0f32, 1.0], [258.0, 3.0]], [[4.0, 8.0], [8.0, 4.0]]];
    let (mut mean, mut var) = ([0.0f64; 2], [1.0f64; 2]);
    for batch in batches {
        let x = Tensor::new(&batch, &Device::Cpu)?.to_dtype(DType::BF16)?;
        let y = bn.forward_t(&x, true)?;
        assert_eq!(y.dtype(), DType::BF16);
        for c in 0..2 {
            let (a, b) = (batch[0][c] as f64, batch[1][c] as f64);
            let batch_mean = (a + b) / 2.0;
            let unbiased = ((a - batch_mean).powi(2) + (b - batch_mean).powi(2)) / (2.0 - 1.0);
            mean[c] = (1.0 - 0.25) * mean[c] + 0.25 * batch_mean;
            var[c] = (1.0 - 0.25) * var[c] + 0.25 * unbiased;
        }
        assert_eq!(bn.running_mean().dtype(), DType::F32);
        assert_eq!(values(bn.running_mean())?, mean, "running mean");
        assert_eq!(values(bn.running_var())?, var, "running variance");
    }
    assert_eq!((mean, var), ([49.6875, 1.875], [2.9375, 2.9375]));
    // Eval normalises with the running statistics (weight 1, bias 0), training with the batch's own.
    let x = Tensor::new(&[[50.0f32, 2.0], [52.0, 4.0]], &Device::Cpu)?.to_dtype(DType::BF16)?;
    let eval = values(&bn.forward_t(&x, false)?)?;
    let train = values(&bn.forward_t(&x, true)?)?;
    let expected = [(50.0 - mean[0]) / (var[0] + EPS).sqrt(), (2.0 - mean[1]) / (var[1] + EPS).sqrt()];
    for (got, want) in eval.iter().zip(expected) {
        assert!(
            (got - want).abs() <= want.abs() * common::unit_roundoff(DType::BF16),
            "eval {got} vs {want}"
        );
    }
    assert!(
        (train[0] + 1.0).abs() < 1e-2 && (train[2] - 1.0).abs() < 1e-2,
        "train uses batch stats: {train:?}"
    );
    Ok(())
}

#[test]
fn batch_norm_matches_f64_in_fp16_and_bf16_in_train_and_eval() -> Result<()> {
    let stats = (
        common::randn_in(4, &[3], 0.5, DType::F32)?,
        (common::randn_in(5, &[3], 1.0, DType::F32)?.abs()? + 0.5)?,
    );
    let stats64 = (stats.0.to_dtype(DType::F64)?, stats.1.to_dtype(DType::F64)?);
    for half in HALVES {
        let inputs = [
            (common::randn_in(1, &[4, 3, 5, 5], 3.0, DType::F32)? + 1.0)?.to_dtype(half)?,
            common::randn_in(2, &[3], 1.0, DType::F32)?,
            common::randn_in(3, &[3], 0.5, DType::F32)?,
        ];
        let inputs64 = inputs.iter().map(|t| t.to_dtype(DType::F64)).collect::<Result<Vec<_>>>()?;
        for train in [true, false] {
            let ours = |t: &[Tensor]| bn_layer(t, (&stats.0, &stats.1))?.forward_t(&t[0], train);
            let given = (!train).then_some((&stats64.0, &stats64.1));
            let reference = |t: &[Tensor]| reference_norm(&t[0], &t[1], &t[2], &[0, 2, 3], given);
            let (y, grads) = common::value_and_grads(ours, &inputs)?;
            let (y_ref, grads_ref) = common::value_and_grads(reference, &inputs64)?;
            assert_eq!((y.dtype(), grads[0].dtype(), grads[1].dtype()), (half, half, DType::F32));
            let what = format!("batch_norm {half:?} train={train}");
            common::assert_close(&format!("{what} forward"), &y, &y_ref, common::tolerance(half, 1, 2.0))?;
            common::assert_close(
                &format!("{what} grad x"),
                &grads[0],
                &grads_ref[0],
                common::tolerance(half, 2, 4.0),
            )?;
            common::assert_close(
                &format!("{what} grad weight"),
                &grads[1],
                &grads_ref[1],
                common::tolerance(half, 1, 2.0),
            )?;
            common::assert_close(
                &format!("{what} grad bias"),
                &grads[2],
                &grads_ref[2],
                common::tolerance(half, 1, 2.0),
            )?;
        }
    }
    Ok(())
}

#[test]
fn group_norm_matches_f64_in_fp16_and_bf16() -> Result<()> {
    for half in HALVES {
        let inputs = [
            (common::randn_in(1, &[3, 6, 4, 5], 3.0, DType::F32)? - 2.0)?.to_dtype(half)?,
            common::randn_in(2, &[6], 1.0, DType::F32)?,
            common::randn_in(3, &[6], 0.5, DType::F32)?,
        ];
        let inputs64 = inputs.iter().map(|t| t.to_dtype(DType::F64)).collect::<Result<Vec<_>>>()?;
        let ours = |t: &[Tensor]| {
            GroupNorm::new(Param::from_tensor(&t[1])?, Param::from_tensor(&t[2])?, 2, EPS)?.forward(&t[0])
        };
        let reference = |t: &[Tensor]| {
            let grouped = t[0].reshape((3, 2, 3, 4, 5))?; // (batch, group, channel in group, h, w)
            let mean = grouped.mean_keepdim(&[2, 3, 4][..])?;
            let var = grouped.broadcast_sub(&mean)?.sqr()?.mean_keepdim(&[2, 3, 4][..])?;
            let normed =
                grouped.broadcast_sub(&mean)?.broadcast_div(&(var + EPS)?.sqrt()?)?.reshape((3, 6, 4, 5))?;
            normed.broadcast_mul(&t[1].reshape((1, 6, 1, 1))?)?.broadcast_add(&t[2].reshape((1, 6, 1, 1))?)
        };
        let (y, grads) = common::value_and_grads(ours, &inputs)?;
        let (y_ref, grads_ref) = common::value_and_grads(reference, &inputs64)?;
        assert_eq!((y.dtype(), grads[0].dtype()), (half, half));
        common::assert_close(
            &format!("group_norm {half:?} forward"),
            &y,
            &y_ref,
            common::tolerance(half, 1, 2.0),
        )?;
        common::assert_close(
            &format!("group_norm {half:?} grad x"),
            &grads[0],
            &grads_ref[0],
            common::tolerance(half, 2, 4.0),
        )?;
        common::assert_close(
            &format!("group_norm {half:?} grad weight"),
            &grads[1],
            &grads_ref[1],
            common::tolerance(half, 1, 2.0),
        )?;
        common::assert_close(
            &format!("group_norm {half:?} grad bias"),
            &grads[2],
            &grads_ref[2],
            common::tolerance(half, 1, 2.0),
        )?;
    }
    Ok(())
}

#[test]
fn near_fp16_overflow_norms_stay_finite_and_correct_where_half_statistics_overflow() -> Result<()> {
    let x = common::uniform_in(5, &[8, 2, 4, 4], 3e4, 6e4, DType::F16)?;
    let naive_mean = x.mean_keepdim(&[0, 2, 3][..])?; // candle's f16 sum of 128 values of ~4.5e4
    let naive_var = x.broadcast_sub(&naive_mean)?.sqr()?.mean_keepdim(&[0, 2, 3][..])?;
    assert!(!common::all_finite(&naive_var)?, "fp16 statistics overflow");
    let (w, b) = (Tensor::new(&[1.5f32, 0.5], &Device::Cpu)?, Tensor::new(&[0.1f32, -0.2], &Device::Cpu)?);
    let inputs = [x.clone(), w.clone(), b.clone()];
    let ones = Tensor::ones(2, DType::F32, &Device::Cpu)?;
    let (y, grads) =
        common::value_and_grads(|t| bn_layer(t, (&ones, &ones))?.forward_t(&t[0], true), &inputs)?;
    assert!(grads.iter().map(common::all_finite).all(|ok| ok.unwrap_or(false)), "finite gradients");
    let x64 = x.to_dtype(DType::F64)?;
    let (w64, b64) = (w.to_dtype(DType::F64)?, b.to_dtype(DType::F64)?);
    let y_ref = reference_norm(&x64, &w64, &b64, &[0, 2, 3], None)?;
    common::assert_close("batch_norm near fp16 overflow", &y, &y_ref, common::tolerance(DType::F16, 1, 2.0))?;
    let gn = GroupNorm::new(Param::from_tensor(&w)?, Param::from_tensor(&b)?, 1, EPS)?;
    let y_ref = reference_norm(
        &x64.reshape((8, 1, 32))?,
        &Tensor::ones(1, DType::F64, &Device::Cpu)?,
        &Tensor::zeros(1, DType::F64, &Device::Cpu)?,
        &[2],
        None,
    )?
    .reshape((8, 2, 4, 4))?
    .broadcast_mul(&w64.reshape((1, 2, 1, 1))?)?
    .broadcast_add(&b64.reshape((1, 2, 1, 1))?)?;
    common::assert_close(
        "group_norm near fp16 overflow",
        &gn.forward(&x)?,
        &y_ref,
        common::tolerance(DType::F16, 1, 2.0),
    )?;
    Ok(())
}

/// Parity with candle-nn: the same state loads, evaluation and the running statistics are the same
/// bits; in training the output differs from candle-nn's by the f32 roundings of the statistics (amp's
/// fused op sums them in f64 on the CPU): 256 units of f32 roundoff, normwise.
#[test]
fn norms_load_candle_nn_state_and_match_candle_nn_in_f32() -> Result<()> {
    let mut varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let theirs = candle_nn::batch_norm(3, BatchNormConfig::default(), vb.pp("bn"))?;
    let ours = batch_norm(3, BatchNormConfig::default(), vb.pp("bn"))?;
    let their_gn = candle_nn::group_norm(2, 6, EPS, vb.pp("gn"))?;
    let our_gn = group_norm(2, 6, EPS, vb.pp("gn"))?;
    for (i, name) in
        ["bn.weight", "bn.bias", "bn.running_mean", "gn.weight", "gn.bias"].into_iter().enumerate()
    {
        varmap.set_one(
            name,
            common::randn_in(10 + i as u64, &[if name.starts_with("gn") { 6 } else { 3 }], 1.0, DType::F32)?,
        )?;
    }
    varmap.set_one("bn.running_var", Tensor::new(&[0.5f32, 2.0, 1.5], &Device::Cpu)?)?;
    let x = common::randn_in(20, &[4, 3, 5, 5], 2.0, DType::F32)?;
    assert_eq!(values(&ours.forward_t(&x, false)?)?, values(&theirs.forward_t(&x, false)?)?, "eval");
    let initial = (ours.running_mean().copy()?, ours.running_var().copy()?);
    let their_y = theirs.forward_t(&x, true)?;
    let their_stats = (values(theirs.running_mean())?, values(theirs.running_var())?);
    assert_eq!(
        values(ours.running_mean())?,
        their_stats.0,
        "the running statistics are the VarMap's variables"
    );
    ours.running_mean().set(&initial.0)?;
    ours.running_var().set(&initial.1)?;
    let f32_tolerance = common::tolerance(DType::F32, 0, 0.0);
    common::assert_close("batch norm, train", &ours.forward_t(&x, true)?, &their_y, f32_tolerance)?;
    assert_eq!(
        (values(ours.running_mean())?, values(ours.running_var())?),
        their_stats,
        "updated statistics"
    );
    let names: Vec<_> =
        ours.params().iter().map(|(n, _)| *n).chain(ours.buffers().iter().map(|(n, _)| *n)).collect();
    assert_eq!(names, ["weight", "bias", "running_mean", "running_var"]);
    let x = common::randn_in(21, &[2, 6, 3, 4], 2.0, DType::F32)?;
    common::assert_close("group norm", &our_gn.forward(&x)?, &their_gn.forward(&x)?, f32_tolerance)?;
    Ok(())
}

#[test]
fn norms_are_pinned_fp32_whatever_they_are_asked() {
    let vb = VarBuilder::zeros(DType::F32, &Device::Cpu);
    let mut bn = batch_norm(3, 1e-5, vb.pp("bn")).unwrap();
    let mut gn = group_norm(1, 3, 1e-5, vb.pp("gn")).unwrap();
    let half = LayerPrecision { compute: amp::Precision::Bf16, output: None };
    bn.set_precision(half);
    gn.set_precision(half);
    assert!(bn.pinned_fp32() && gn.pinned_fp32());
    assert_eq!(
        (bn.precision().compute, gn.precision().compute),
        (amp::Precision::Fp32, amp::Precision::Fp32)
    );
}

#[test]
fn rms_norm_matches_f64_in_every_dtype_where_half_squares_overflow() -> Result<()> {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        // |x| up to about 1,500: x^2 overflows fp16 (65,504), so the mean of squares must be f32.
        let inputs = [
            common::randn_in(4, &[3, 5, 16], 500.0, DType::F32)?.to_dtype(dtype)?,
            (common::randn_in(5, &[16], 0.5, DType::F32)? + 1.0)?,
        ];
        let inputs64 = inputs.iter().map(|t| t.to_dtype(DType::F64)).collect::<Result<Vec<_>>>()?;
        let ours = |t: &[Tensor]| RmsNorm::new(Param::from_tensor(&t[1])?, EPS).forward(&t[0]);
        let reference = |t: &[Tensor]| {
            let rms = (t[0].sqr()?.mean_keepdim(2)? + EPS)?.sqrt()?;
            t[0].broadcast_div(&rms)?.broadcast_mul(&t[1])
        };
        let (y, grads) = common::value_and_grads(ours, &inputs)?;
        let (y_ref, grads_ref) = common::value_and_grads(reference, &inputs64)?;
        assert_eq!((y.dtype(), grads[0].dtype(), grads[1].dtype()), (dtype, dtype, DType::F32));
        let tolerance = |roundings, safety| common::tolerance(dtype, roundings, safety);
        common::assert_close(&format!("rms_norm {dtype:?} forward"), &y, &y_ref, tolerance(1, 2.0))?;
        common::assert_close(
            &format!("rms_norm {dtype:?} grad x"),
            &grads[0],
            &grads_ref[0],
            tolerance(2, 4.0),
        )?;
        common::assert_close(
            &format!("rms_norm {dtype:?} grad weight"),
            &grads[1],
            &grads_ref[1],
            tolerance(1, 2.0),
        )?;
    }
    Ok(())
}

#[test]
fn a_layer_norm_for_other_features_than_the_input_has_is_refused_not_a_panic() -> Result<()> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let norm = amp::nn::layer_norm(32, 1e-5, VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
    for dtype in [DType::F32, DType::BF16] {
        let x = Tensor::zeros((4, 16), dtype, &dev)?;
        let err = norm.forward(&x).expect_err("16 features into a norm of 32").to_string();
        assert!(err.contains("16 features") && err.contains("[32]"), "{err}");
    }
    Ok(())
}

/// Activations beyond `sqrt(f32::MAX)`, about 1.8e19, whose f32 squares overflow: on the CPU each norm
/// sums its statistics in f64 and normalises them as any other. (With the variance summed in f32 it is
/// infinite and every such row came out as zeros, as it does in candle-nn's norms.)
/// Output and gradients against f64 definitions, within 256 units of f32 roundoff plus 4 roundings of
/// safety 4, normwise; the running statistics, f32 values past `f32::MAX`, stay as they were.
#[test]
fn norms_normalise_activations_whose_f32_squares_overflow() -> Result<()> {
    let x = common::randn_in(30, &[4, 6, 3, 5], 1e20, DType::F32)?;
    assert!(!common::all_finite(&x.sqr()?)?, "the premise: f32 squares overflow");
    let inputs_with = |features: usize| -> Result<[Tensor; 3]> {
        let w = (common::randn_in(31, &[features], 0.5, DType::F32)? + 1.0)?;
        Ok([x.clone(), w, common::randn_in(32, &[features], 0.5, DType::F32)?])
    };
    let check = |what: &str,
                 inputs: &[Tensor],
                 ours: &dyn Fn(&[Tensor]) -> Result<Tensor>,
                 reference: &dyn Fn(&[Tensor]) -> Result<Tensor>|
     -> Result<()> {
        let inputs64 = inputs.iter().map(|t| t.to_dtype(DType::F64)).collect::<Result<Vec<_>>>()?;
        let (y, grads) = common::value_and_grads(ours, inputs)?;
        let (y_ref, grads_ref) = common::value_and_grads(reference, &inputs64)?;
        let tolerance = common::tolerance(DType::F32, 4, 4.0);
        common::assert_close(&format!("{what} forward"), &y, &y_ref, tolerance)?;
        for (i, (got, want)) in grads.iter().zip(&grads_ref).enumerate() {
            common::assert_close(&format!("{what} grad {i}"), got, want, tolerance)?;
        }
        Ok(())
    };
    // Over the last dimension, per-feature weight and bias.
    let last_dim = |t: &[Tensor], centred: bool| -> Result<Tensor> {
        let x = if centred { t[0].broadcast_sub(&t[0].mean_keepdim(3)?)? } else { t[0].clone() };
        let normed = x.broadcast_div(&(x.sqr()?.mean_keepdim(3)? + EPS)?.sqrt()?)?;
        let y = normed.broadcast_mul(&t[1])?;
        if centred {
            y.broadcast_add(&t[2])
        } else {
            Ok(y)
        }
    };
    let layer = |t: &[Tensor]| {
        let (w, b) = (Param::from_tensor(&t[1])?, Param::from_tensor(&t[2])?);
        amp::nn::LayerNorm::new(w, Some(b), EPS).forward(&t[0])
    };
    check("layer_norm", &inputs_with(5)?, &layer, &|t| last_dim(t, true))?;
    let rms = |t: &[Tensor]| RmsNorm::new(Param::from_tensor(&t[1])?, EPS).forward(&t[0]);
    check("rms_norm", &inputs_with(5)?[..2], &rms, &|t| last_dim(t, false))?;
    let group = |t: &[Tensor]| {
        GroupNorm::new(Param::from_tensor(&t[1])?, Param::from_tensor(&t[2])?, 2, EPS)?.forward(&t[0])
    };
    // Each sample's 2 groups of 3 channels x 15 values as a "channel" of its own: (4, 1, 2, 45).
    let group_reference = |t: &[Tensor]| {
        let (one, zero) =
            (Tensor::ones(1, DType::F64, &Device::Cpu)?, Tensor::zeros(1, DType::F64, &Device::Cpu)?);
        let normed =
            reference_norm(&t[0].reshape((4, 1, 2, 45))?, &one, &zero, &[3], None)?.reshape(t[0].shape())?;
        normed.broadcast_mul(&t[1].reshape((1, 6, 1, 1))?)?.broadcast_add(&t[2].reshape((1, 6, 1, 1))?)
    };
    check("group_norm", &inputs_with(6)?, &group, &group_reference)?;
    let ones = Tensor::ones(6, DType::F32, &Device::Cpu)?;
    let bn = bn_layer(&inputs_with(6)?, (&ones, &ones))?;
    let batch = |t: &[Tensor]| {
        let layer = BatchNorm::new(
            bn.running_mean().clone(),
            bn.running_var().clone(),
            Some((Param::from_tensor(&t[1])?, Param::from_tensor(&t[2])?)),
            BatchNormConfig::default(),
        )?;
        layer.forward_t(&t[0], true)
    };
    let batch_reference = |t: &[Tensor]| reference_norm(&t[0], &t[1], &t[2], &[0, 2, 3], None);
    check("batch_norm", &inputs_with(6)?, &batch, &batch_reference)?;
    assert_eq!(values(bn.running_mean())?, [1.0; 6], "the running mean is left as it was");
    assert_eq!(values(bn.running_var())?, [1.0; 6], "the running variance too");
    Ok(())
}

/// `BatchNormConfig { remove_mean: false, .. }` (the RMS norm of each channel): output, gradients and
/// the running statistics as candle-nn's (the running variance the same bits, the running mean left
/// as it is), in training and evaluation.
#[test]
fn batch_norm_without_mean_removal_matches_candle_nn() -> Result<()> {
    let config = BatchNormConfig { remove_mean: false, momentum: 0.3, ..Default::default() };
    let mut varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let ours = batch_norm(3, config, vb.pp("ours"))?;
    let theirs = candle_nn::batch_norm(3, config, vb.pp("theirs"))?;
    for (i, name) in ["weight", "bias"].into_iter().enumerate() {
        let value = (common::randn_in(40 + i as u64, &[3], 0.5, DType::F32)? + 1.0)?;
        for layer in ["ours", "theirs"] {
            varmap.set_one(format!("{layer}.{name}"), &value)?;
        }
    }
    let x = (common::randn_in(42, &[4, 3, 5, 5], 2.0, DType::F32)? + 0.5)?;
    let tolerance = common::tolerance(DType::F32, 0, 0.0);
    for train in [true, false] {
        let step = |layer: &dyn ModuleT| common::value_and_grad(|x| layer.forward_t(x, train), &x);
        let ((y, dx), (their_y, their_dx)) = (step(&ours)?, step(&theirs)?);
        common::assert_close(&format!("train={train} forward"), &y, &their_y, tolerance)?;
        common::assert_close(&format!("train={train} grad x"), &dx, &their_dx, tolerance)?;
    }
    assert_eq!(values(ours.running_var())?, values(theirs.running_var())?, "running variance");
    assert_eq!(values(ours.running_mean())?, [0.0; 3], "the running mean stays");
    let reference = |t: &[Tensor]| {
        let rms = (t[0].sqr()?.mean_keepdim(&[0, 2, 3][..])? + EPS)?.sqrt()?;
        t[0].broadcast_div(&rms)
    };
    let ones = Tensor::ones(3, DType::F32, &Device::Cpu)?;
    let unit =
        BatchNorm::new(Var::zeros(3, DType::F32, &Device::Cpu)?, Var::from_tensor(&ones)?, None, config)?;
    let y = unit.forward_t(&x, true)?;
    let y_ref = reference(&[x.to_dtype(DType::F64)?])?;
    common::assert_close("remove_mean false against f64", &y, &y_ref, tolerance)?;
    Ok(())
}
