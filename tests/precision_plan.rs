//! The static plan, the run-time plan and the traversal of a nested model: paths, precisions, counts.

use amp::nn::{embedding, layer_norm, linear, Embedding, LayerNorm, Linear};
use amp::{AmpConfig, AmpModule, AmpModuleExt, OptLevel, ParamStorage, PlanNode, Precision, PrecisionSpec};
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};

#[derive(AmpModule)]
struct Mlp {
    up: Linear,
    #[amp(fp16)]
    down: Linear,
}

#[derive(AmpModule)]
#[amp(default = bf16)]
struct Model {
    embed: Embedding,
    #[amp(fp32)]
    norm: LayerNorm,
    layers: Vec<Mlp>,
    head: Option<Linear>,
    #[amp(skip)]
    name: String,
}

#[derive(AmpModule)]
struct Bf16Only {
    #[amp(bf16)]
    fc: Linear,
    #[amp(fp32)]
    norm: LayerNorm,
}

/// Paths of the model as `VarBuilder` names them, so the traversal's paths are checkpoint names.
fn model(vb: VarBuilder<'_>) -> Result<Model> {
    let layers = (0..2)
        .map(|i| {
            let vb = vb.pp(format!("layers.{i}"));
            Ok(Mlp { up: linear(8, 16, vb.pp("up"))?, down: linear(16, 8, vb.pp("down"))? })
        })
        .collect::<Result<_>>()?;
    Ok(Model {
        embed: embedding(10, 8, vb.pp("embed"))?,
        norm: layer_norm(8, 1e-5, vb.pp("norm"))?,
        layers,
        head: Some(linear(8, 10, vb.pp("head"))?),
        name: "tiny".into(),
    })
}

#[test]
fn static_plan_lists_fields_with_their_requested_precision() {
    let PlanNode::Struct { default, fields } = Model::PLAN.node else { panic!("a struct plan") };
    assert_eq!(default, Some(PrecisionSpec::Bf16));
    let names: Vec<_> = fields.iter().map(|f| (f.name, f.precision)).collect();
    assert_eq!(
        names,
        [
            ("embed", Some(PrecisionSpec::Bf16)),
            ("norm", Some(PrecisionSpec::Fp32)),
            ("layers", Some(PrecisionSpec::Bf16)),
            ("head", Some(PrecisionSpec::Bf16)),
        ],
        "skipped fields are absent; fields without attribute get the struct default"
    );
    assert!(matches!(fields[2].plan.node, PlanNode::Repeated { container: "Vec", .. }));
    let text = Model::PLAN.to_string();
    assert!(text.contains("down: Linear fp16"), "{text}");
}

#[test]
fn needs_loss_scaling_is_computed_through_nesting() {
    const { assert!(Model::NEEDS_LOSS_SCALING) };
    const { assert!(Mlp::NEEDS_LOSS_SCALING) };
    const { assert!(!Bf16Only::NEEDS_LOSS_SCALING) };
}

#[test]
fn traversal_gives_checkpoint_paths_precisions_and_counts() -> Result<()> {
    let varmap = VarMap::new();
    let mut model = model(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O2, &Device::Cpu))
        .map_err(candle_core::Error::from)?;

    let plan = model.precision_plan();
    let rows: Vec<_> = plan.rows.iter().map(|r| (r.path.as_str(), r.kind, r.compute, r.params)).collect();
    assert_eq!(
        rows,
        [
            ("embed", "Embedding", Precision::Bf16, 80),
            ("norm", "LayerNorm", Precision::Fp32, 16),
            ("layers.0.up", "Linear", Precision::Bf16, 8 * 16 + 16),
            ("layers.0.down", "Linear", Precision::Fp16, 16 * 8 + 8),
            ("layers.1.up", "Linear", Precision::Bf16, 144),
            ("layers.1.down", "Linear", Precision::Fp16, 136),
            ("head", "Linear", Precision::Bf16, 90),
        ]
    );
    // O2: half layers hold an fp32 master and a 2-byte working copy; the norm stays plain fp32.
    assert_eq!(plan.rows[0].storage, ParamStorage::MasterAndWorking(Precision::Bf16));
    assert_eq!(plan.rows[1].storage, ParamStorage::Fp32);
    assert_eq!(plan.bytes_fp32(), 4 * plan.params());
    assert_eq!(plan.bytes_planned(), 6 * (plan.params() - 16) + 4 * 16);
    assert!(plan.computes_in_fp16());
    assert_eq!(model.name, "tiny", "skipped fields are left alone");

    // Traversal paths are the VarBuilder names: every master is the VarMap's own variable.
    let mut names: Vec<_> = model.named_params().into_iter().map(|(path, _)| path).collect();
    names.sort();
    let mut stored: Vec<_> = varmap
        .data()
        .lock()
        .map_err(|_| candle_core::Error::Msg("poisoned".into()))?
        .keys()
        .cloned()
        .collect();
    stored.sort();
    assert_eq!(names, stored);
    let printed = plan.to_string();
    assert!(printed.contains("layers.1.down") && printed.contains("fp32 master + fp16"), "{printed}");
    Ok(())
}

#[test]
fn initialize_back_to_o0_restores_the_masters_exactly() -> Result<()> {
    let varmap = VarMap::new();
    let mut model = model(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
    let before: Vec<Vec<f32>> =
        model.master_vars().iter().map(|v| v.as_tensor().flatten_all()?.to_vec1()).collect::<Result<_>>()?;
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O2, &Device::Cpu))
        .map_err(candle_core::Error::from)?;
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O0, &Device::Cpu))
        .map_err(candle_core::Error::from)?;
    let after: Vec<Vec<f32>> = model
        .trainable_vars()
        .iter()
        .map(|v| v.as_tensor().flatten_all()?.to_vec1())
        .collect::<Result<_>>()?;
    assert_eq!(before, after);
    assert!(model.precision_plan().rows.iter().all(|r| r.storage == ParamStorage::Fp32));
    Ok(())
}
