//! The first step names every trainable parameter that received no gradient. candle-nn's `LayerNorm`
//! with a bias runs the fused `layer_norm` kernel on a contiguous input, and that kernel has no
//! backward: the norm's weight and bias, and the linear before it, silently never train.

use amp::optim::{AdamConfig, FusedAdamW, ParamGroups};
use amp::scaler::{LikelyCause, MissingGradients, ScalerConfig};
use amp::varmap::AmpVarMap;
use amp::{AmpConfig, AmpModuleExt, Error, GradScaler, OptLevel};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{LayerNorm, Linear, VarBuilder, VarMap};

struct WithCandleLayerNorm {
    fc1: Linear,
    norm: LayerNorm,
    fc2: Linear,
}

impl WithCandleLayerNorm {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Self> {
        Ok(WithCandleLayerNorm {
            fc1: candle_nn::linear(6, 8, vb.pp("fc1"))?,
            norm: candle_nn::layer_norm(8, 1e-5, vb.pp("norm"))?,
            fc2: candle_nn::linear(8, 2, vb.pp("fc2"))?,
        })
    }

    fn loss(&self, dtype: DType) -> candle_core::Result<Tensor> {
        let x =
            Tensor::arange(0f32, 24.0, &Device::Cpu)?.reshape((4, 6))?.affine(0.1, -1.0)?.to_dtype(dtype)?;
        let y = self.fc2.forward(&self.norm.forward(&self.fc1.forward(&x)?)?)?;
        y.to_dtype(DType::F32)?.sqr()?.mean_all()
    }
}

fn values(varmap: &AmpVarMap) -> amp::Result<Vec<Vec<f32>>> {
    varmap
        .named_params()
        .iter()
        .map(|(_, p)| Ok(p.master().as_tensor().flatten_all()?.to_vec1::<f32>()?))
        .collect()
}

#[test]
fn a_candle_layer_norm_is_named_with_its_cause_and_nothing_changes() -> amp::Result<()> {
    let device = Device::Cpu;
    let varmap = AmpVarMap::new(AmpConfig::new(OptLevel::O2, &device));
    let vb = varmap.var_builder(&device);
    let model = WithCandleLayerNorm::new(vb.clone())?;
    let mut optimizer = FusedAdamW::new(ParamGroups::from_model(&varmap)?, AdamConfig::default())?;
    let mut scaler = GradScaler::for_model(&varmap, ScalerConfig::default())?;
    let before = values(&varmap)?;

    let err = scaler.step_fused(&model.loss(vb.dtype())?, &mut optimizer, None).unwrap_err();
    let Error::NoGradient { params } = &err else { panic!("expected NoGradient, got {err}") };
    assert_eq!(params.paths(), ["fc1.weight", "fc1.bias", "norm.weight", "norm.bias"]);
    let causes: Vec<LikelyCause> = params.0.iter().map(|p| p.cause).collect();
    use LikelyCause::{CandleFusedNorm, NoPathFromLoss};
    assert_eq!(causes, [NoPathFromLoss, NoPathFromLoss, CandleFusedNorm, CandleFusedNorm]);
    let message = err.to_string();
    assert!(
        message.contains("4 trainable parameter(s)") && message.contains("candle issue #3011"),
        "{message}"
    );
    assert!(message.contains("MissingGradients::Warn"), "says how to allow frozen parameters: {message}");
    assert_eq!(values(&varmap)?, before, "a refused step changes no weight");
    Ok(())
}

#[test]
fn as_a_warning_the_step_trains_the_parameters_that_have_gradients() -> amp::Result<()> {
    let device = Device::Cpu;
    let varmap = AmpVarMap::new(AmpConfig::new(OptLevel::O0, &device));
    let model = WithCandleLayerNorm::new(varmap.var_builder(&device))?;
    let mut optimizer = FusedAdamW::new(ParamGroups::from_model(&varmap)?, AdamConfig::default())?;
    let mut scaler =
        GradScaler::for_model(&varmap, ScalerConfig::default())?.on_missing_gradients(MissingGradients::Warn);
    let before = values(&varmap)?;
    assert!(scaler.step_fused(&model.loss(DType::F32)?, &mut optimizer, None)?.applied());
    let after = values(&varmap)?;
    let changed: Vec<bool> = before.iter().zip(&after).map(|(b, a)| b != a).collect();
    // fc1.weight, fc1.bias, norm.weight, norm.bias, fc2.weight, fc2.bias
    assert_eq!(changed, [false, false, false, false, true, true]);
    Ok(())
}

#[test]
fn a_plain_candle_varmap_and_the_generic_step_are_checked_too() -> amp::Result<()> {
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let model = WithCandleLayerNorm::new(VarBuilder::from_varmap(&varmap, DType::F32, &device))?;
    let mut optimizer = FusedAdamW::new(ParamGroups::from_varmap(&varmap)?, AdamConfig::default())?;
    let err = GradScaler::disabled().step_fused(&model.loss(DType::F32)?, &mut optimizer, None).unwrap_err();
    let Error::NoGradient { params } = &err else { panic!("expected NoGradient, got {err}") };
    // A VarMap lists its variables by name.
    assert_eq!(params.paths(), ["fc1.bias", "fc1.weight", "norm.bias", "norm.weight"]);

    let amp_map = AmpVarMap::new(AmpConfig::new(OptLevel::O0, &device));
    let model = WithCandleLayerNorm::new(amp_map.var_builder(&device))?;
    let err = GradScaler::disabled().step(&amp_map, &model.loss(DType::F32)?, |_| Ok(())).unwrap_err();
    assert!(matches!(err, Error::NoGradient { .. }), "{err}");
    Ok(())
}

#[test]
fn a_loss_that_depends_on_no_parameter_says_so() -> amp::Result<()> {
    let device = Device::Cpu;
    let varmap = AmpVarMap::new(AmpConfig::new(OptLevel::O0, &device));
    let model = WithCandleLayerNorm::new(varmap.var_builder(&device))?;
    let mut optimizer = FusedAdamW::new(ParamGroups::from_model(&varmap)?, AdamConfig::default())?;
    let detached = model.loss(DType::F32)?.detach();
    let err = GradScaler::disabled().step_fused(&detached, &mut optimizer, None).unwrap_err();
    let Error::NoGradient { params } = &err else { panic!("expected NoGradient, got {err}") };
    assert!(params.0.iter().all(|p| p.cause == LikelyCause::LossDetached), "{err}");
    Ok(())
}
