//! The API as a user meets it: weight-decay groups asked of the layers, two optimizers in one checkpoint,
//! errors that say what happened and keep their source.

use std::error::Error as _;

use amp::checkpoint::{SavedState, TrainingState};
use amp::nn::{embedding, layer_norm, linear, Embedding, LayerNorm, Linear};
use amp::optim::{AdamConfig, FusedAdam, FusedOptimizer, FusedSgd, OptimParam, ParamGroups, SgdConfig};
use amp::scaler::ScalerConfig;
use amp::{AmpModule, AmpModuleExt, Error, GradScaler, Layer};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};

#[derive(AmpModule)]
struct Net {
    tokens: Embedding,
    #[amp(fp32)]
    norm: LayerNorm,
    head: Linear,
}

fn net() -> candle_core::Result<Net> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    Ok(Net {
        tokens: embedding(5, 4, vb.pp("tokens"))?,
        norm: layer_norm(4, 1e-5, vb.pp("norm"))?,
        head: linear(4, 3, vb.pp("head"))?,
    })
}

#[test]
fn the_layers_say_which_parameters_take_no_weight_decay() -> amp::Result<()> {
    let groups = ParamGroups::from_model(&net()?)?;
    let no_decay: Vec<(&str, bool)> =
        groups.params().iter().map(|p| (p.path.as_str(), p.is_bias_or_norm())).collect();
    assert_eq!(
        no_decay,
        [
            ("tokens.weight", false),
            ("norm.weight", true),
            ("norm.bias", true),
            ("head.weight", false),
            ("head.bias", true)
        ]
    );
    // Bare variables answer by shape: vectors are biases and norm scales.
    let vars = [
        candle_core::Var::zeros((3, 2), DType::F32, &Device::Cpu)?,
        candle_core::Var::zeros(3, DType::F32, &Device::Cpu)?,
    ];
    let bare: Vec<bool> =
        ParamGroups::from_vars(vars)?.params().iter().map(OptimParam::is_bias_or_norm).collect();
    assert_eq!(bare, [false, true]);
    Ok(())
}

#[test]
fn two_named_optimizers_share_one_checkpoint() -> amp::Result<()> {
    let model = net()?;
    let (first, second) =
        (AdamConfig { lr: 1e-2, ..AdamConfig::adamw() }, AdamConfig { lr: 1e-3, ..AdamConfig::adam() });
    let encoder =
        || ParamGroups::from_vars(model.tokens.params().into_iter().map(|(_, p)| p.master().clone()));
    let decoder = || ParamGroups::from_vars(model.head.params().into_iter().map(|(_, p)| p.master().clone()));
    let mut enc = FusedAdam::new(encoder()?, first)?.named("encoder");
    let mut dec = FusedAdam::new(decoder()?, second)?.named("decoder");
    let ids = Tensor::new(&[0u32, 3, 4], &Device::Cpu)?;
    let loss = model.head.forward(&model.tokens.forward(&ids)?)?.sqr()?.mean_all()?;
    let grads = loss.backward()?;
    enc.step(&grads)?;
    dec.step(&grads)?;
    let dir = std::env::temp_dir().join(format!("amp-api-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| Error::Internal { what: e.to_string() })?;
    let path = dir.join("two.safetensors");
    amp::checkpoint::save_with(&model, &[&enc, &dec], &path)?;

    let mut restored_enc = FusedAdam::new(encoder()?, first)?.named("encoder");
    let mut restored_dec = FusedAdam::new(decoder()?, second)?.named("decoder");
    let mut model = model;
    amp::checkpoint::load_with(&mut model, &mut [&mut restored_enc, &mut restored_dec], &path)?;
    for (original, restored) in [(&enc, &restored_enc), (&dec, &restored_dec)] {
        let (a, b) = (original.save_state()?, restored.save_state()?);
        assert_eq!(a.json, b.json);
        for ((name, x), (_, y)) in a.tensors.iter().zip(&b.tensors) {
            assert_eq!(x.flatten_all()?.to_vec1::<f32>()?, y.flatten_all()?.to_vec1::<f32>()?, "{name}");
        }
    }
    assert!(!restored_dec.config().decoupled_weight_decay, "the decoder is Adam, the encoder AdamW");
    std::fs::remove_dir_all(&dir).map_err(|e| Error::Internal { what: e.to_string() })?;
    Ok(())
}

#[test]
fn an_unreadable_saved_state_says_so_and_keeps_the_parser_error() -> amp::Result<()> {
    let scaler = GradScaler::new(ScalerConfig::default())?.named("fp16 scaler");
    let damaged = SavedState { json: "{\"config\": ".into(), tensors: Vec::new() };
    let err = scaler.check_state(&damaged).unwrap_err();
    assert!(matches!(&err, Error::SavedStateUnreadable { key, .. } if key == "fp16 scaler"), "{err}");
    assert!(
        err.source().is_some_and(|s| s.to_string().contains("EOF")),
        "the JSON error is its source: {err:?}"
    );

    let optimizer = FusedSgd::new(ParamGroups::from_model(&net()?)?, SgdConfig::default())?;
    assert!(matches!(optimizer.check_state(&damaged), Err(Error::SavedStateUnreadable { .. })));
    Ok(())
}

#[test]
fn settings_that_cannot_go_together_are_an_invalid_config() -> amp::Result<()> {
    let nesterov = SgdConfig { nesterov: true, momentum: 0.0, ..SgdConfig::default() };
    let err = FusedSgd::new(ParamGroups::from_model(&net()?)?, nesterov).unwrap_err();
    assert!(matches!(err, Error::InvalidOptimizerConfig { .. }), "{err}");
    assert_eq!(AdamConfig::adamw(), AdamConfig::default());
    Ok(())
}

#[test]
fn the_plan_of_a_model_is_reachable_from_the_crate_root() {
    let plan = net().map(|n| n.precision_plan().params()).unwrap_or(0);
    assert_eq!(plan, 5 * 4 + 4 + 4 + 4 * 3 + 3);
}
