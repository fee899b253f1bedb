//! A model of plain candle-nn layers, written as any candle user writes it, trained under amp through
//! `AmpVarMap`: fp32 (O0), bf16 O2 and fp16 O2 with the dynamic scaler, from the same initial weights
//! and data. The checkpoint of the bf16 run loads into an fp32 candle-nn model with `VarMap::load`.
//!
//! Tolerances: the task (a random linear teacher, 4 classes) starts near 2.1 nats from candle-nn's
//! initial weights; fp32 ends near 0.2 after 60 AdamW steps (mean of the last 5). The mixed runs must end
//! within 0.02 nats of fp32 (measured: 0.0001 for bf16 and fp16), and every run must fall below half
//! its first loss.

use amp::optim::{AdamConfig, FusedAdamW, ParamGroups};
use amp::scaler::ScalerConfig;
use amp::varmap::AmpVarMap;
use amp::{AmpConfig, AmpModuleExt, GradScaler, OptLevel, ParamStorage, Precision};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{LayerNorm, Linear, VarBuilder, VarMap};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const INPUTS: usize = 16;
const HIDDEN: usize = 64;
const CLASSES: usize = 4;
const BATCH: usize = 64;
const STEPS: usize = 60;

/// Plain candle-nn: two linears around a bias-free LayerNorm that the model computes in f32.
struct Classifier {
    fc1: Linear,
    norm: LayerNorm,
    fc2: Linear,
}

impl Classifier {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Self> {
        Ok(Classifier {
            fc1: candle_nn::linear(INPUTS, HIDDEN, vb.pp("fc1"))?,
            norm: candle_nn::layer_norm_no_bias(HIDDEN, 1e-5, vb.pp("norm"))?,
            fc2: candle_nn::linear(HIDDEN, CLASSES, vb.pp("fc2"))?,
        })
    }

    /// Logits in f32 for inputs in the model's dtype.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let dtype = x.dtype();
        let h = self.fc1.forward(x)?.gelu()?;
        let h = self.norm.forward(&h.to_dtype(DType::F32)?)?.to_dtype(dtype)?;
        self.fc2.forward(&h)?.to_dtype(DType::F32)
    }
}

struct Data {
    x: Tensor,
    labels: Tensor,
}

/// Inputs from N(0, 1), labels from a random linear teacher.
fn data(seed: u64, device: &Device) -> candle_core::Result<Vec<Data>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let teacher: Vec<f32> = (0..INPUTS * CLASSES).map(|_| rng.random_range(-1.0..1.0)).collect();
    (0..STEPS)
        .map(|_| {
            let x: Vec<f32> = (0..BATCH * INPUTS).map(|_| rng.random_range(-2.0..2.0)).collect();
            let labels: Vec<u32> = x
                .chunks(INPUTS)
                .map(|row| {
                    let score =
                        |c: usize| (0..INPUTS).map(|i| row[i] * teacher[i * CLASSES + c]).sum::<f32>();
                    (0..CLASSES).max_by(|&a, &b| score(a).total_cmp(&score(b))).unwrap_or(0) as u32
                })
                .collect();
            Ok(Data {
                x: Tensor::from_vec(x, (BATCH, INPUTS), device)?,
                labels: Tensor::from_vec(labels, BATCH, device)?,
            })
        })
        .collect()
}

/// Initial weights from candle-nn's own initializers, once, so that every run starts from them.
fn initial_weights(device: &Device) -> candle_core::Result<VarMap> {
    let varmap = VarMap::new();
    Classifier::new(VarBuilder::from_varmap(&varmap, DType::F32, device))?;
    Ok(varmap)
}

/// Trains a fresh model of `config` from `initial`; returns the map and the loss of every step.
fn train(config: AmpConfig, initial: &VarMap, batches: &[Data]) -> amp::Result<(AmpVarMap, Vec<f32>)> {
    let device = Device::Cpu;
    let varmap = AmpVarMap::new(config).keep_fp32_names(&["norm"])?.with_initial_from_varmap(initial)?;
    let vb = varmap.var_builder(&device);
    let model = Classifier::new(vb.clone())?;
    let mut optimizer = FusedAdamW::new(
        ParamGroups::from_model(&varmap)?,
        AdamConfig { lr: 1e-2, weight_decay: 0.0, ..AdamConfig::default() },
    )?;
    let mut scaler = GradScaler::for_model(&varmap, ScalerConfig::default())?;
    assert_eq!(scaler.is_enabled(), vb.dtype() == DType::F16, "fp16 and only fp16 scales the loss");
    let mut losses = Vec::new();
    for batch in batches {
        let logits = model.forward(&batch.x.to_dtype(vb.dtype())?)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &batch.labels)?;
        losses.push(loss.to_scalar::<f32>()?);
        scaler.step_fused(&loss, &mut optimizer, None)?;
    }
    Ok((varmap, losses))
}

fn configs() -> [(&'static str, AmpConfig); 3] {
    let cpu = Device::Cpu;
    [
        ("fp32 O0", AmpConfig::new(OptLevel::O0, &cpu)),
        ("bf16 O2", AmpConfig::new(OptLevel::O2, &cpu).with_half(Precision::Bf16)),
        ("fp16 O2", AmpConfig::new(OptLevel::O2, &cpu).with_half(Precision::Fp16)),
    ]
}

#[test]
fn a_candle_nn_model_trains_in_mixed_precision_and_matches_fp32() -> amp::Result<()> {
    let device = Device::Cpu;
    let batches = data(7, &device)?;
    let initial = initial_weights(&device)?;
    let mut finals = Vec::new();
    for (name, config) in configs() {
        let (_, losses) = train(config, &initial, &batches)?;
        let (first, last) = (losses[0], mean_of_last(&losses, 5));
        println!("{name}: first {first:.4}, last {last:.4}");
        assert!(last < 0.5 * first, "{name} does not learn: {first} -> {last}");
        finals.push((name, last));
    }
    let fp32 = finals[0].1;
    for (name, last) in &finals[1..] {
        assert!((last - fp32).abs() < 0.02, "{name} ends at {last:.4}, fp32 at {fp32:.4}");
    }
    Ok(())
}

fn mean_of_last(losses: &[f32], n: usize) -> f32 {
    losses[losses.len() - n..].iter().sum::<f32>() / n as f32
}

#[test]
fn the_map_holds_fp32_masters_and_hands_the_model_half_copies() -> amp::Result<()> {
    let device = Device::Cpu;
    let config = AmpConfig::new(OptLevel::O2, &device).with_half(Precision::Bf16);
    let varmap = AmpVarMap::new(config).keep_fp32_names(&["norm"])?;
    let _model = Classifier::new(varmap.var_builder(&device))?;
    let storage: Vec<(String, ParamStorage)> =
        varmap.named_params().into_iter().map(|(name, p)| (name, p.storage())).collect();
    let half = ParamStorage::MasterAndWorking(Precision::Bf16);
    let expected = [
        ("fc1.weight", half),
        ("fc1.bias", half),
        ("norm.weight", ParamStorage::Fp32),
        ("fc2.weight", half),
        ("fc2.bias", half),
    ];
    let expected: Vec<(String, ParamStorage)> = expected.iter().map(|(n, s)| (n.to_string(), *s)).collect();
    assert_eq!(storage, expected);
    let plan = varmap.precision_plan();
    assert_eq!(plan.rows.len(), 5);
    assert_eq!(plan.params(), INPUTS * HIDDEN + HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES);
    let table = plan.to_string();
    assert!(table.contains("fc1.weight") && table.contains("fp32 master + bf16"), "{table}");
    // The precision is fixed in the model: initialize refuses to change it.
    let mut varmap = varmap;
    let err = amp::initialize(&mut varmap, AmpConfig::new(OptLevel::O0, &device)).unwrap_err();
    assert!(matches!(err, amp::Error::StorageFixed { .. }), "{err}");
    Ok(())
}

#[test]
fn a_bf16_checkpoint_loads_into_an_fp32_candle_model_with_varmap_load() -> amp::Result<()> {
    let device = Device::Cpu;
    let batches = data(11, &device)?;
    let initial = initial_weights(&device)?;
    let config = AmpConfig::new(OptLevel::O2, &device).with_half(Precision::Bf16);
    let (varmap, _) = train(config, &initial, &batches[..10])?;
    let dir = std::env::temp_dir().join(format!("amp-byo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| amp::Error::Internal { what: e.to_string() })?;
    let path = dir.join("classifier.safetensors");
    amp::checkpoint::save(&varmap, &path)?;

    let mut fp32 = VarMap::new();
    let model = Classifier::new(VarBuilder::from_varmap(&fp32, DType::F32, &device))?;
    fp32.load(&path)?;
    for (name, param) in varmap.named_params() {
        let loaded = fp32.data().lock().map_err(|_| amp::Error::Internal { what: "lock".into() })?[&name]
            .as_tensor()
            .flatten_all()?
            .to_vec1::<f32>()?;
        let master = param.master().as_tensor().flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(loaded, master, "{name}: the checkpoint holds the fp32 master bit for bit");
    }
    let logits = model.forward(&batches[0].x)?;
    assert_eq!(logits.dims(), &[BATCH, CLASSES]);
    std::fs::remove_dir_all(&dir).map_err(|e| amp::Error::Internal { what: e.to_string() })?;
    Ok(())
}

#[test]
fn asking_again_for_a_tensor_with_another_shape_or_dtype_is_refused() -> amp::Result<()> {
    let device = Device::Cpu;
    let varmap = AmpVarMap::new(AmpConfig::new(OptLevel::O2, &device));
    let vb = varmap.var_builder(&device);
    let tied = vb.get((4, 3), "tied")?;
    assert_eq!(vb.get((4, 3), "tied")?.id(), tied.id(), "tied weights are one tensor");
    let shape = vb.get((3, 4), "tied").unwrap_err().to_string();
    assert!(shape.contains("`tied`") && shape.contains("[3, 4]") && shape.contains("[4, 3]"), "{shape}");
    let dtype =
        vb.get_with_hints_dtype((4, 3), "tied", Default::default(), DType::F16).unwrap_err().to_string();
    assert!(dtype.contains("F16") && dtype.contains("BF16"), "{dtype}");
    Ok(())
}

#[test]
fn batch_norm_statistics_are_buffers_that_checkpoints_save_and_optimizers_skip() -> amp::Result<()> {
    let device = Device::Cpu;
    let varmap = AmpVarMap::new(AmpConfig::new(OptLevel::O2, &device).with_half(Precision::Bf16));
    let _norm = candle_nn::batch_norm(3, 1e-5, varmap.var_builder(&device).pp("bn"))?;
    let params: Vec<String> = varmap.named_params().into_iter().map(|(name, _)| name).collect();
    let buffers: Vec<String> = varmap.named_buffers().into_iter().map(|(name, _)| name).collect();
    assert_eq!(params, ["bn.weight", "bn.bias"]);
    assert_eq!(buffers, ["bn.running_mean", "bn.running_var"]);
    assert_eq!(
        ParamGroups::from_model(&varmap)?.params().len(),
        2,
        "the optimizer never sees the statistics"
    );
    Ok(())
}

#[test]
fn initial_values_are_checked_against_the_model_and_unused_ones_listed() -> amp::Result<()> {
    let device = Device::Cpu;
    let config = AmpConfig::new(OptLevel::O2, &device);
    let good = [("fc1.weight".to_string(), Tensor::zeros((HIDDEN, INPUTS), DType::F32, &device)?)];
    let varmap = AmpVarMap::new(config)
        .with_initial(good)?
        .with_initial([("fc9.weight".to_string(), Tensor::zeros(1, DType::F32, &device)?)])?;
    let _model = Classifier::new(varmap.var_builder(&device))?;
    let fc1 = &varmap.named_params()[0].1;
    assert_eq!(
        fc1.master().as_tensor().sum_all()?.to_scalar::<f32>()?,
        0.0,
        "started from the initial value"
    );
    assert_eq!(varmap.unused_initial()?, ["fc9.weight"]);

    let wrong = [("fc1.weight".to_string(), Tensor::zeros((INPUTS, HIDDEN), DType::F32, &device)?)];
    let varmap = AmpVarMap::new(config).with_initial(wrong)?;
    let err = Classifier::new(varmap.var_builder(&device)).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("`fc1.weight`") && err.contains("[64, 16]") && err.contains("[16, 64]"), "{err}");
    Ok(())
}

#[test]
fn o3_hands_out_half_parameters_that_amps_optimizers_refuse() -> amp::Result<()> {
    let device = Device::Cpu;
    let varmap = AmpVarMap::new(AmpConfig::new(OptLevel::O3, &device).with_half(Precision::Bf16));
    let _model = Classifier::new(varmap.var_builder(&device))?;
    assert_eq!(varmap.named_params()[0].1.storage(), ParamStorage::Half(Precision::Bf16));
    let err = ParamGroups::from_model(&varmap).unwrap_err();
    assert!(matches!(err, amp::Error::NoFp32Master { .. }), "{err}");
    Ok(())
}

#[test]
fn a_seeded_map_draws_the_same_initial_weights_every_time_and_a_plain_varmap_the_same_ones() -> amp::Result<()>
{
    let device = Device::Cpu;
    let masters = |seed: u64| -> amp::Result<Vec<Vec<f32>>> {
        let config = AmpConfig::new(OptLevel::O2, &device).with_half(Precision::Bf16);
        let varmap = AmpVarMap::new(config).with_seed(seed)?;
        let _model = Classifier::new(varmap.var_builder(&device))?;
        let values = varmap.master_vars().into_iter().map(|v| v.as_tensor().flatten_all()?.to_vec1::<f32>());
        Ok(values.collect::<candle_core::Result<_>>()?)
    };
    assert_eq!(masters(3)?, masters(3)?);
    assert_ne!(masters(3)?, masters(4)?);
    // The same values through candle-nn's own VarMap, seeded the same way.
    let plain = VarMap::new();
    Classifier::new(amp::varmap::SeededInit::new(3).var_builder(&plain, DType::F32, &device))?;
    let data = plain.data().lock().expect("no other thread holds the map");
    let weight = data["fc1.weight"].as_tensor().flatten_all()?.to_vec1::<f32>()?;
    assert_eq!(weight, masters(3)?[0]);
    drop(data);
    // Seeding a map already handed out is refused: its tensors would mix two initializations.
    let varmap = AmpVarMap::new(AmpConfig::new(OptLevel::O0, &device));
    let _shared = varmap.clone();
    let err = varmap.with_seed(1).unwrap_err();
    assert!(err.to_string().contains("with_seed"), "{err}");
    Ok(())
}
