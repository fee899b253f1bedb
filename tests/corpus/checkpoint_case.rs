//! One bad-checkpoint case, shared by the regression test that replays the corpus
//! (`tests/checkpoint_corpus.rs`) and the fuzz target (`fuzz/fuzz_targets/checkpoint_load.rs`): load
//! arbitrary bytes into a fresh fp16 O2 model with an AdamW optimizer and a loss scaler, and check what
//! must hold whatever the bytes are: the load returns, and when it refuses the file, its error names the
//! file and nothing changed.
#![allow(dead_code)] // each includer uses a part

use std::path::Path;

use amp::checkpoint::TrainingState;
use amp::nn::{linear, Linear};
use amp::optim::{AdamConfig, FusedAdamW, ParamGroups};
use amp::scaler::ScalerConfig;
use amp::{AmpConfig, AmpModuleExt, GradScaler, OptLevel, Precision};
use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};

/// The model every case loads into: `4 -> 8 -> 2`, two linear layers.
pub type Model = Vec<Linear>;

/// A fresh model (fp16 O2: fp32 masters, fp16 working copies), its AdamW optimizer and its scaler.
pub fn fresh() -> amp::Result<(Model, FusedAdamW, GradScaler)> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut model = vec![linear(4, 8, vb.pp("hidden"))?, linear(8, 2, vb.pp("out"))?];
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Fp16))?;
    let adam = FusedAdamW::new(ParamGroups::from_model(&model)?, AdamConfig::default())?;
    let scaler = GradScaler::new(ScalerConfig { init_scale: 256.0, ..Default::default() })?;
    Ok((model, adam, scaler))
}

/// Every bit of the model and states: masters, working copies, saved states.
pub fn state_bits(model: &Model, adam: &FusedAdamW, scaler: &GradScaler) -> amp::Result<Vec<Vec<u32>>> {
    let bits = |t: &candle_core::Tensor| -> amp::Result<Vec<u32>> {
        let values = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(values.iter().map(|v| v.to_bits()).collect())
    };
    let mut all = Vec::new();
    for (_, p) in model.named_params() {
        all.push(bits(p.master().as_tensor())?);
        if let Some(working) = p.working() {
            all.push(bits(working.as_tensor())?);
        }
    }
    for state in [adam as &dyn TrainingState, scaler] {
        let saved = state.save_state()?;
        all.push(saved.json.bytes().map(u32::from).collect());
        for (_, t) in &saved.tensors {
            all.push(bits(t)?);
        }
    }
    Ok(all)
}

/// What loading `bytes` (written to `file`) did: `Ok(true)` loaded, `Ok(false)` refused properly,
/// `Err` a broken promise (an error that does not name the file, or a refused load that changed
/// something). A panic or an abort inside is a broken promise too, found by whoever calls this.
pub fn check_case(bytes: &[u8], file: &Path) -> Result<bool, String> {
    std::fs::write(file, bytes).map_err(|e| format!("cannot write the case: {e}"))?;
    let (mut model, mut adam, mut scaler) = fresh().map_err(|e| e.to_string())?;
    let before = state_bits(&model, &adam, &scaler).map_err(|e| e.to_string())?;
    let loaded = amp::checkpoint::load_with(&mut model, &mut [&mut adam, &mut scaler], file);
    let Err(err) = loaded else { return Ok(true) };
    let message = err.to_string();
    if !message.contains(file.to_string_lossy().as_ref()) {
        return Err(format!("the error does not name the file: {message}"));
    }
    let after = state_bits(&model, &adam, &scaler).map_err(|e| e.to_string())?;
    if after != before {
        return Err(format!("a refused load changed the model or a state: {message}"));
    }
    Ok(false)
}
