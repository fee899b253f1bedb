//! `amp::nn` convolutions and dropout: forward and gradients in fp16 and bf16 against f64 references,
//! bf16 `Conv2d` where candle's own conv2d refuses bf16, and loading from candle-nn's constructors.
//!
//! Tolerances (normwise relative, `common::tolerance`): inputs and weights are f32 (O1: the layer casts
//! at use). A convolution's forward rounds the input and the weight to the half format, the f32-accumulated
//! result once, and the result plus the f32 bias once more: 4 roundings of `u` (2^-11 fp16, 2^-8 bf16).
//! Each gradient passes 3 rounded operands: the upstream gradient, the other operand, the result (the
//! bias gradient only the first). Safety factor 4: a sum of products with cancelling terms amplifies
//! relative operand errors by `|W||x| / |W x|`, measured 1-2 on these random data.

mod common;

use amp::nn::{batch_norm, conv1d, conv2d, BatchNorm, Conv1d, Conv1dConfig, Conv2d, Conv2dConfig, Dropout};
use amp::{
    AmpConfig, AmpModule, AmpModuleExt, Layer, LayerPrecision, OptLevel, Param, ParamStorage, Precision,
};
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{ModuleT, VarBuilder, VarMap};

const HALVES: [Precision; 2] = [Precision::Fp16, Precision::Bf16];

fn in_half(compute: Precision) -> LayerPrecision {
    LayerPrecision { compute, output: None }
}

fn conv2d_configs() -> [Conv2dConfig; 2] {
    [
        Conv2dConfig { padding: 1, stride: 2, ..Default::default() },
        Conv2dConfig { padding: 2, dilation: 2, groups: 2, ..Default::default() },
    ]
}

#[test]
fn candle_conv2d_refuses_bf16_on_cpu() -> Result<()> {
    let x = common::randn_in(1, &[2, 4, 8, 8], 1.0, DType::BF16)?;
    let w = common::randn_in(2, &[6, 4, 3, 3], 0.2, DType::BF16)?;
    let err = x.conv2d(&w, 1, 1, 1, 1).expect_err("candle 0.11 has no CPU bf16 conv2d");
    assert!(err.to_string().contains("unsupported dtype BF16"), "{err}");
    Ok(())
}

#[test]
fn conv2d_matches_f64_in_fp16_and_bf16_forward_and_backward() -> Result<()> {
    for config in conv2d_configs() {
        let inputs = [
            common::randn_in(1, &[2, 4, 9, 9], 1.0, DType::F32)?,
            common::randn_in(2, &[6, 4 / config.groups, 3, 3], 0.3, DType::F32)?,
            common::randn_in(3, &[6], 0.5, DType::F32)?,
        ];
        let inputs64 = inputs.iter().map(|t| t.to_dtype(DType::F64)).collect::<Result<Vec<_>>>()?;
        let reference = |t: &[Tensor]| {
            let c = &config;
            let y = t[0].conv2d(&t[1], c.padding, c.stride, c.dilation, c.groups)?;
            y.broadcast_add(&t[2].reshape((1, 6, 1, 1))?)
        };
        let (y_ref, grads_ref) = common::value_and_grads(reference, &inputs64)?;
        for half in HALVES {
            let layer = |t: &[Tensor]| {
                let mut conv =
                    Conv2d::new(Param::from_tensor(&t[1])?, Some(Param::from_tensor(&t[2])?), config);
                conv.set_precision(in_half(half));
                conv.forward(&t[0])
            };
            let (y, grads) = common::value_and_grads(layer, &inputs)?;
            assert_eq!(y.dtype(), DType::F32, "output returns in the input's dtype");
            let what = format!("conv2d {half} groups={}", config.groups);
            let err = common::assert_close(
                &format!("{what} forward"),
                &y,
                &y_ref,
                common::tolerance(half.dtype(), 4, 4.0),
            )?;
            assert!(err > common::unit_roundoff(half.dtype()) / 8.0, "{what}: no sign of half rounding");
            for (name, (grad, expected)) in ["x", "weight", "bias"].iter().zip(grads.iter().zip(&grads_ref)) {
                let tol = common::tolerance(half.dtype(), 3, 4.0);
                common::assert_close(&format!("{what} grad {name}"), grad, expected, tol)?;
            }
        }
    }
    Ok(())
}

#[test]
fn convolutions_accumulate_in_f32_in_both_half_formats() -> Result<()> {
    // 2304 = 256 channels x 3 x 3 products of 1 x 1: representable in fp16 and bf16, but an accumulator in
    // either format would stall (at 2048 in fp16, 256 in bf16), as candle's half sums do.
    for half in HALVES {
        let mut conv = Conv2d::new(
            Param::from_tensor(&Tensor::ones((1, 256, 3, 3), DType::F32, &Device::Cpu)?)?,
            None,
            Default::default(),
        );
        conv.set_precision(in_half(half));
        let y = conv.forward(&Tensor::ones((1, 256, 3, 3), half.dtype(), &Device::Cpu)?)?;
        assert_eq!(y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, [2304.0], "conv2d {half}");
        let mut conv = Conv1d::new(
            Param::from_tensor(&Tensor::ones((1, 768, 3), DType::F32, &Device::Cpu)?)?,
            None,
            Default::default(),
        );
        conv.set_precision(in_half(half));
        let y = conv.forward(&Tensor::ones((1, 768, 3), half.dtype(), &Device::Cpu)?)?;
        assert_eq!(y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, [2304.0], "conv1d {half}");
    }
    Ok(())
}

#[test]
fn conv1d_matches_f64_in_fp16_and_bf16_forward_and_backward() -> Result<()> {
    let config = Conv1dConfig { padding: 1, stride: 1, dilation: 2, ..Default::default() };
    let inputs = [
        common::randn_in(4, &[3, 5, 20], 1.0, DType::F32)?,
        common::randn_in(5, &[7, 5, 3], 0.3, DType::F32)?,
        common::randn_in(6, &[7], 0.5, DType::F32)?,
    ];
    let inputs64 = inputs.iter().map(|t| t.to_dtype(DType::F64)).collect::<Result<Vec<_>>>()?;
    let reference = |t: &[Tensor]| t[0].conv1d(&t[1], 1, 1, 2, 1)?.broadcast_add(&t[2].reshape((1, 7, 1))?);
    let (y_ref, grads_ref) = common::value_and_grads(reference, &inputs64)?;
    for half in HALVES {
        let layer = |t: &[Tensor]| {
            let mut conv = Conv1d::new(Param::from_tensor(&t[1])?, Some(Param::from_tensor(&t[2])?), config);
            conv.set_precision(in_half(half));
            conv.forward(&t[0])
        };
        let (y, grads) = common::value_and_grads(layer, &inputs)?;
        common::assert_close(
            &format!("conv1d {half} forward"),
            &y,
            &y_ref,
            common::tolerance(half.dtype(), 4, 4.0),
        )?;
        for (name, (grad, expected)) in ["x", "weight", "bias"].iter().zip(grads.iter().zip(&grads_ref)) {
            let tol = common::tolerance(half.dtype(), 3, 4.0);
            common::assert_close(&format!("conv1d {half} grad {name}"), grad, expected, tol)?;
        }
    }
    Ok(())
}

#[test]
fn convs_load_what_candle_nn_constructors_create_and_match_them_exactly_in_f32() -> Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    for (i, config) in conv2d_configs().into_iter().enumerate() {
        let theirs = candle_nn::conv2d(4, 6, 3, config, vb.pp(format!("c2_{i}")))?;
        let ours = conv2d(4, 6, 3, config, vb.pp(format!("c2_{i}")))?;
        let x = common::randn_in(7, &[2, 4, 9, 9], 1.0, DType::F32)?;
        let (a, b) = (ours.forward(&x)?, theirs.forward(&x)?);
        assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?, "conv2d {i}");
        let theirs = candle_nn::conv2d_no_bias(4, 6, 3, config, vb.pp(format!("n2_{i}")))?;
        let ours = amp::nn::conv2d_no_bias(4, 6, 3, config, vb.pp(format!("n2_{i}")))?;
        assert_eq!(
            ours.forward(&x)?.flatten_all()?.to_vec1::<f32>()?,
            theirs.forward(&x)?.flatten_all()?.to_vec1::<f32>()?
        );
    }
    let config = Conv1dConfig { padding: 1, ..Default::default() };
    let theirs = candle_nn::conv1d(5, 7, 3, config, vb.pp("c1"))?;
    let ours = conv1d(5, 7, 3, config, vb.pp("c1"))?;
    let x = common::randn_in(8, &[3, 5, 20], 1.0, DType::F32)?;
    assert_eq!(
        ours.forward(&x)?.flatten_all()?.to_vec1::<f32>()?,
        theirs.forward(&x)?.flatten_all()?.to_vec1::<f32>()?
    );
    let names: Vec<&str> = ours.params().iter().map(|(name, _)| *name).collect();
    assert_eq!(names, ["weight", "bias"]);
    let stored = varmap.data().lock().unwrap().get("c1.weight").cloned().expect("c1.weight in the VarMap");
    assert_eq!(
        ours.weight().trainable().as_tensor().id(),
        stored.as_tensor().id(),
        "shares the VarMap's variable"
    );
    Ok(())
}

#[test]
fn dropout_drops_and_scales_in_f32_and_is_the_identity_in_eval() -> Result<()> {
    let p = 0.3f32;
    for half in HALVES {
        let h = half.dtype();
        let mut dropout = Dropout::new(p)?;
        dropout.set_precision(in_half(half));
        // Half inputs away from 0, so a zero output means dropped.
        let x = (common::uniform_in(1, &[200, 500], 0.5, 4.0, DType::F32)?
            * common::randn_in(2, &[200, 500], 1.0, DType::F32)?.sign()?)?
        .to_dtype(h)?;
        let (y, grad) = common::value_and_grad(|x| dropout.forward_t(x, true), &x)?;
        assert_eq!((y.dtype(), grad.dtype()), (h, h));
        let kept = y.ne(0.0)?.to_dtype(DType::F32)?;
        let dropped = 1.0 - kept.mean_all()?.to_scalar::<f32>()?;
        // Binomial over 1e5 draws: standard deviation sqrt(p(1-p)/n) = 0.0014; 7 of them is 0.01.
        assert!((dropped - p).abs() < 0.01, "{half}: dropped {dropped}, expected {p}");
        // Survivors are x * (1/(1-p)) formed in f32 and rounded once: exactly that, bit for bit.
        let scale = 1.0 / (1.0 - p as f64);
        let expected = ((x.to_dtype(DType::F32)? * scale)? * &kept)?.to_dtype(h)?;
        assert_eq!(
            y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
            expected.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?
        );
        // Against f64: one rounding of the result (forward) and of the gradient, safety 2.
        let x64 = x.to_dtype(DType::F64)?;
        let mask64 = (kept.to_dtype(DType::F64)? * scale)?;
        let (y_ref, grad_ref) = common::value_and_grad(|x| x * &mask64, &x64)?;
        common::assert_close(&format!("dropout {half} forward"), &y, &y_ref, common::tolerance(h, 1, 2.0))?;
        common::assert_close(
            &format!("dropout {half} grad"),
            &grad,
            &grad_ref,
            common::tolerance(h, 1, 2.0),
        )?;
        let eval = dropout.forward_t(&x, false)?;
        assert_eq!(
            eval.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
            x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?
        );
    }
    assert!(Dropout::new(1.0).is_err() && Dropout::new(-0.1).is_err());
    Ok(())
}

#[derive(AmpModule)]
struct ConvBlock {
    conv: Conv2d,
    bn: BatchNorm,
    drop: Dropout,
}

#[test]
fn a_conv_batchnorm_dropout_block_trains_under_o2_bf16_on_cpu() -> Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let config = Conv2dConfig { padding: 1, ..Default::default() };
    let mut block = ConvBlock {
        conv: conv2d(3, 8, 3, config, vb.pp("conv"))?,
        bn: batch_norm(8, 1e-5, vb.pp("bn"))?,
        drop: Dropout::new(0.1)?,
    };
    amp::initialize(&mut block, AmpConfig { opt_level: OptLevel::O2, half: Precision::Bf16 })?;
    let plan = block.precision_plan();
    let computes: Vec<(String, Precision)> = plan.rows.iter().map(|r| (r.path.clone(), r.compute)).collect();
    assert_eq!(
        computes,
        [("conv".into(), Precision::Bf16), ("bn".into(), Precision::Fp32), ("drop".into(), Precision::Bf16)]
    );
    let x = common::randn_in(1, &[4, 3, 6, 6], 1.0, DType::F32)?;
    let y = block.drop.forward_t(&block.bn.forward_t(&block.conv.forward(&x)?, true)?, true)?;
    assert_eq!(y.dtype(), DType::F32, "O2 activations leave layers in f32");
    let grads = y.sqr()?.mean_all()?.backward()?;
    for (path, param) in block.named_params() {
        let grad =
            grads.get(param.trainable().as_tensor()).unwrap_or_else(|| panic!("{path} has no gradient"));
        let expected = if path.starts_with("conv") {
            ParamStorage::MasterAndWorking(Precision::Bf16)
        } else {
            ParamStorage::Fp32
        };
        assert_eq!(
            (param.storage(), grad.dtype()),
            (expected, expected.trainable_precision().dtype()),
            "{path}"
        );
        assert!(common::all_finite(grad)?, "{path}");
    }
    assert!(block.bn.buffers().iter().all(|(_, v)| v.dtype() == DType::F32), "running statistics stay f32");
    assert_ne!(block.bn.running_mean().to_vec1::<f32>()?, [0.0; 8], "and were updated");
    Ok(())
}
