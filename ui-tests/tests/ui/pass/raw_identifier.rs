// A field named with a raw identifier (`r#type`) carries its plain name in paths and parameter names,
// as candle-nn's `vb.pp("type")` names it, so checkpoints match.
use amp::nn::{linear, Linear};
use amp::{AmpModule, AmpModuleExt};
use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};

#[derive(AmpModule)]
struct Model {
    r#type: Linear,
}

fn main() -> candle_core::Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = Model { r#type: linear(4, 2, vb.pp("type"))? };
    let names: Vec<String> = model.named_params().into_iter().map(|(name, _)| name).collect();
    assert_eq!(names, ["type.weight", "type.bias"]);
    let mut stored: Vec<String> = varmap.data().lock().expect("unshared").keys().cloned().collect();
    stored.sort();
    assert_eq!(stored, ["type.bias", "type.weight"]);
    assert!(model.precision_plan().to_string().contains("type "));
    Ok(())
}
