//! `amp::nn` dropout and a convolution block: dropout's forward and gradient in fp16 and bf16 against
//! f64 references (one rounding of the result and of the gradient, safety 2), and a conv / batch-norm /
//! dropout block trained under O2 bf16 on the CPU. The convolutions themselves: `tests/nn_conv.rs`.

mod common;

use amp::nn::{batch_norm, conv2d, BatchNorm, Conv2d, Conv2dConfig, Dropout};
use amp::{AmpConfig, AmpModule, AmpModuleExt, Layer, LayerPrecision, OptLevel, ParamStorage, Precision};
use candle_core::{DType, Device, Module, Result};
use candle_nn::{ModuleT, VarBuilder, VarMap};

const HALVES: [Precision; 2] = [Precision::Fp16, Precision::Bf16];

fn in_half(compute: Precision) -> LayerPrecision {
    LayerPrecision { compute, output: None }
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
        let grad = param.grad(&path, &grads)?.unwrap_or_else(|| panic!("{path} has no gradient"));
        let expected = if path.starts_with("conv") {
            ParamStorage::MasterAndWorking(Precision::Bf16)
        } else {
            ParamStorage::Fp32
        };
        // The kernel's gradient comes out of amp's GEMM in f32, keyed by the master (the default
        // gradient route, as for a Linear), and so does the bias's, summed in f32.
        let dtype =
            if path.starts_with("conv") { DType::F32 } else { expected.trainable_precision().dtype() };
        assert_eq!((param.storage(), grad.dtype()), (expected, dtype), "{path}");
        assert!(common::all_finite(grad)?, "{path}");
    }
    assert!(block.bn.buffers().iter().all(|(_, v)| v.dtype() == DType::F32), "running statistics stay f32");
    assert_ne!(block.bn.running_mean().to_vec1::<f32>()?, [0.0; 8], "and were updated");
    Ok(())
}
