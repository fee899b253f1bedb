//! Checkpoints hold fp32 masters with candle-nn's names: an O2 checkpoint loads into an fp32 model and
//! back bit for bit, and a bad checkpoint is refused whole, naming every problem, with the model unchanged.

mod common;

use std::collections::HashMap;

use amp::nn::{layer_norm, linear, LayerNorm, Linear};
use amp::{AmpConfig, AmpModule, AmpModuleExt, OptLevel};
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};

#[derive(AmpModule)]
struct Net {
    #[amp(fp32)]
    norm: LayerNorm,
    hidden: Linear,
    #[amp(fp16)]
    out: Linear,
}

fn net(varmap: &VarMap) -> candle_core::Result<Net> {
    let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
    Ok(Net {
        norm: layer_norm(6, 1e-5, vb.pp("norm"))?,
        hidden: linear(6, 12, vb.pp("hidden"))?,
        out: linear(12, 3, vb.pp("out"))?,
    })
}

fn masters(model: &Net) -> Vec<(String, Vec<u32>)> {
    model
        .named_params()
        .into_iter()
        .map(|(name, p)| {
            let bits = p.master().as_tensor().flatten_all().and_then(|t| t.to_vec1::<f32>());
            (name, bits.map(|v| v.iter().map(|x| x.to_bits()).collect()).unwrap_or_default())
        })
        .collect()
}

fn tmp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("amp-test-{}-{name}.safetensors", std::process::id()))
}

#[test]
fn o2_checkpoint_round_trips_through_an_fp32_model_bit_for_bit() -> amp::Result<()> {
    let cpu = Device::Cpu;
    let mut o2 = net(&VarMap::new())?;
    amp::initialize(&mut o2, AmpConfig::new(OptLevel::O2, &cpu))?;
    // Give the masters values that half precision cannot hold exactly.
    for (_, p) in o2.named_params() {
        let noisy = (p.master().as_tensor() * (1.0 + 1e-6))?;
        p.master().set(&noisy)?;
        p.refresh_working()?;
    }
    let original = masters(&o2);
    let first = tmp("o2");
    amp::checkpoint::save(&o2, &first)?;

    let mut fp32 = net(&VarMap::new())?;
    amp::checkpoint::load(&mut fp32, &first)?;
    assert_eq!(masters(&fp32), original, "fp32 model holds the O2 masters exactly");
    let second = tmp("fp32");
    amp::checkpoint::save(&fp32, &second)?;

    let mut back = net(&VarMap::new())?;
    amp::initialize(&mut back, AmpConfig::new(OptLevel::O2, &cpu))?;
    amp::checkpoint::load(&mut back, &second)?;
    assert_eq!(masters(&back), original, "O2 -> fp32 -> O2 keeps the masters bit-identical");
    for (name, p) in back.named_params() {
        if let Some(working) = p.working() {
            let expected = p.master().as_tensor().to_dtype(working.dtype())?;
            let diff = (working.as_tensor().to_dtype(DType::F32)? - expected.to_dtype(DType::F32)?)?;
            assert_eq!(diff.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0, "{name}: working copy refreshed");
        }
    }
    std::fs::remove_file(first).ok();
    std::fs::remove_file(second).ok();
    Ok(())
}

#[test]
fn candle_nn_varmap_checkpoints_load() -> amp::Result<()> {
    let source = VarMap::new();
    let model = net(&source)?;
    let path = tmp("varmap");
    source.save(&path)?;
    let mut other = net(&VarMap::new())?;
    amp::initialize(&mut other, AmpConfig::new(OptLevel::O2, &Device::Cpu))?;
    amp::checkpoint::load(&mut other, &path)?;
    assert_eq!(masters(&other), masters(&model));
    std::fs::remove_file(path).ok();
    Ok(())
}

#[test]
fn bad_checkpoints_are_refused_whole_with_every_problem_named() -> amp::Result<()> {
    let model = net(&VarMap::new())?;
    let mut tensors: HashMap<String, Tensor> =
        model.named_params().into_iter().map(|(n, p)| (n, p.master().as_tensor().clone())).collect();
    tensors.remove("out.bias");
    tensors.insert("hidden.weight".into(), Tensor::zeros((12, 7), DType::F32, &Device::Cpu)?);
    tensors.insert("norm.bias".into(), Tensor::zeros(6, DType::F16, &Device::Cpu)?);
    tensors.insert("extra.weight".into(), Tensor::zeros(1, DType::F32, &Device::Cpu)?);
    // Every other tensor is valid and different: none of them may be applied.
    tensors.insert("norm.weight".into(), Tensor::full(5f32, 6, &Device::Cpu)?);
    let path = tmp("bad");
    candle_core::safetensors::save(&tensors, &path)?;

    let mut target = net(&VarMap::new())?;
    let before = masters(&target);
    let err = amp::checkpoint::load(&mut target, &path).unwrap_err().to_string();
    for expected in [
        "`out.bias` is missing",
        "`hidden.weight` has shape [12, 7] in the checkpoint, the model expects [12, 6]",
        "`norm.bias` is F16 in the checkpoint",
        "`extra.weight` is in the checkpoint but the model has no such parameter",
        "the model is unchanged",
    ] {
        assert!(err.contains(expected), "missing {expected:?} in:\n{err}");
    }
    assert_eq!(masters(&target), before, "nothing was half-applied");

    std::fs::write(&path, b"not a safetensors file").map_err(candle_core::Error::wrap)?;
    let err = amp::checkpoint::load(&mut target, &path).unwrap_err();
    assert!(matches!(err, amp::Error::CheckpointUnreadable { .. }), "{err:?}");
    // The parser's finding is both named in the message and kept as the source.
    let finding = std::error::Error::source(&err).expect("the parser's error as the source").to_string();
    let err = err.to_string();
    assert!(err.contains(path.to_string_lossy().as_ref()) && err.contains(&finding), "{err}");
    assert_eq!(masters(&target), before);
    std::fs::remove_file(&path).ok();

    // A missing file: the operating system's error, kind and all, is the source.
    let err = amp::checkpoint::load(&mut target, &path).unwrap_err();
    let Some(io) = std::error::Error::source(&err).and_then(|s| s.downcast_ref::<std::io::Error>()) else {
        panic!("an io::Error source: {err:?}")
    };
    assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
    assert!(err.to_string().contains("cannot read the file"), "{err}");
    Ok(())
}

/// A 1 MB model (one 512x512 linear layer), so that concurrent saves overlap.
fn wide(varmap: &VarMap) -> candle_core::Result<Vec<Linear>> {
    let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
    Ok(vec![linear(512, 512, vb.pp("wide"))?])
}

fn bits(model: &[Linear]) -> candle_core::Result<Vec<u32>> {
    let values = model[0].weight().master().as_tensor().flatten_all()?.to_vec1::<f32>()?;
    Ok(values.iter().map(|v| v.to_bits()).collect())
}

#[test]
fn two_writers_saving_to_one_path_never_mix_their_files() -> amp::Result<()> {
    // Two models with different weights, saved concurrently to one path, again and again: with a shared
    // temporary name one writer would rename the other's half-written file, or find it gone.
    let models = [wide(&VarMap::new())?, wide(&VarMap::new())?];
    let states = [bits(&models[0])?, bits(&models[1])?];
    assert_ne!(states[0], states[1]);
    let dir = std::env::temp_dir().join(format!("amp-two-writers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(candle_core::Error::wrap)?;
    let path = dir.join("shared.safetensors");
    std::thread::scope(|s| {
        let writers: Vec<_> = models
            .iter()
            .map(|model| s.spawn(|| (0..30).try_for_each(|_| amp::checkpoint::save(model, &path))))
            .collect();
        writers.into_iter().try_for_each(|w| w.join().expect("no panic"))
    })?;
    let mut loaded = wide(&VarMap::new())?;
    amp::checkpoint::load(&mut loaded, &path)?;
    assert!(states.contains(&bits(&loaded)?), "the file is one writer's checkpoint, whole");
    let left: Vec<_> = std::fs::read_dir(&dir).map_err(candle_core::Error::wrap)?.collect();
    assert_eq!(left.len(), 1, "no temporary file is left behind");
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

/// Two training states under one key (two scalers left with the default name, or a key and its own
/// folder) are refused before anything is written or loaded: one would have been saved or restored as
/// the other, without a word.
#[test]
fn two_states_under_one_key_are_refused_on_save_and_load() -> amp::Result<()> {
    use amp::checkpoint::TrainingState;
    use amp::scaler::ScalerConfig;
    use amp::GradScaler;
    let varmap = VarMap::new();
    let mut model = net(&varmap)?;
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O2, &Device::Cpu))?;
    let path = tmp("shared-key");
    let scaler = |scale: f32, name: &str| GradScaler::new(ScalerConfig::fixed(scale)).map(|s| s.named(name));
    let (mut g, mut d) = (scaler(8.0, "scaler")?, scaler(1024.0, "scaler")?);
    let err = amp::checkpoint::save_with(&model, &[&g, &d], &path).expect_err("refused").to_string();
    assert!(err.contains("share the checkpoint key `scaler`") && err.contains(".named("), "{err}");
    assert!(!path.exists(), "nothing written");
    let (mut a, mut ab) = (scaler(8.0, "a")?, scaler(1024.0, "a/b")?);
    assert!(amp::checkpoint::save_with(&model, &[&ab, &a], &path).is_err(), "a key and its folder");
    // Saved under distinct names, the same file cannot be loaded into two states of one name.
    let (g2, d2) = (scaler(8.0, "g")?, scaler(1024.0, "d")?);
    amp::checkpoint::save_with(&model, &[&g2, &d2], &path)?;
    let states: [&mut dyn TrainingState; 2] = [&mut g, &mut d];
    let err = amp::checkpoint::load_with(&mut model, &mut states.into_iter().collect::<Vec<_>>(), &path)
        .expect_err("refused")
        .to_string();
    assert!(err.contains("share the checkpoint key"), "{err}");
    let states: [&mut dyn TrainingState; 2] = [&mut a, &mut ab];
    assert!(
        amp::checkpoint::load_with(&mut model, &mut states.into_iter().collect::<Vec<_>>(), &path).is_err()
    );
    std::fs::remove_file(&path).ok();
    Ok(())
}

/// An O3 fp16 model keeps no fp32 copy: a checkpoint whose masters hold values beyond fp16's range
/// (65504) is refused, naming the parameter and the count, and the model keeps its values; within the
/// range, each value is rounded once into the fp16 storage.
#[test]
fn an_o3_fp16_model_refuses_values_its_storage_cannot_hold() -> amp::Result<()> {
    let cpu = Device::Cpu;
    let fp16 = AmpConfig::new(OptLevel::O3, &cpu).with_half(amp::Precision::Fp16);
    let source = net(&VarMap::new())?;
    let saved = tmp("o3-overflow");
    amp::checkpoint::save(&source, &saved)?;
    let mut o3 = net(&VarMap::new())?;
    amp::initialize(&mut o3, fp16)?;
    amp::checkpoint::load(&mut o3, &saved)?;
    let weight = |m: &Net| m.hidden.weight().master().as_tensor().clone();
    let want = source.hidden.weight().master().as_tensor().to_dtype(DType::F16)?;
    let same = weight(&o3).to_dtype(DType::F32)?.eq(&want.to_dtype(DType::F32)?)?;
    assert_eq!(same.min_all()?.to_scalar::<u8>()?, 1, "each value rounded once to fp16");

    let big = (source.hidden.weight().master().as_tensor().ones_like()? * 1e5)?;
    source.hidden.weight().master().set(&big)?;
    amp::checkpoint::save(&source, &saved)?;
    let before = weight(&o3).to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let refused = amp::checkpoint::load(&mut o3, &saved).expect_err("values beyond fp16 are refused");
    let message = refused.to_string();
    assert!(message.contains("`hidden.weight` holds 72 value(s) beyond the range of F16"), "{message}");
    assert!(message.contains("O2"), "says what to do: {message}");
    assert_eq!(weight(&o3).to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, before, "unchanged");
    std::fs::remove_file(saved).ok();
    Ok(())
}
