//! Exports for inference (`checkpoint::export`): each weight in the precision its layer computes in,
//! buffers in f32; loaded back (`checkpoint::load_export`) at the same level the model computes what
//! the trained one did, bit for bit; candle-nn reads the file; a weight fp16 cannot hold refuses the
//! export with nothing written; `load` refuses an export, naming `load_export`.

mod common;

use amp::checkpoint::{export, load_export, ExportReport};
use amp::nn::{batch_norm, layer_norm, linear, BatchNorm, LayerNorm, Linear};
use amp::{AmpConfig, AmpModule, AmpModuleExt, Error, OptLevel, Precision};
use candle_core::{DType, Device, Module, ModuleT, Tensor};
use candle_nn::{VarBuilder, VarMap};

#[derive(AmpModule)]
struct Net {
    #[amp(fp32)]
    norm: LayerNorm,
    hidden: Linear,
    #[amp(fp16)]
    out: Linear,
    bn: BatchNorm,
}

impl Net {
    fn new(seed: u64) -> candle_core::Result<Net> {
        let weights = common::random_weights(
            seed,
            &[
                ("norm.weight", &[6], 1.0),
                ("norm.bias", &[6], 0.1),
                ("hidden.weight", &[12, 6], 0.5),
                ("hidden.bias", &[12], 0.1),
                ("out.weight", &[3, 12], 0.5),
                ("out.bias", &[3], 0.1),
            ],
        )?;
        let vb = VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu);
        let varmap = VarMap::new();
        let bn = batch_norm(3, 1e-5, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu).pp("bn"))?;
        Ok(Net {
            norm: layer_norm(6, 1e-5, vb.pp("norm"))?,
            hidden: linear(6, 12, vb.pp("hidden"))?,
            out: linear(12, 3, vb.pp("out"))?,
            bn,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.hidden.forward(&self.norm.forward(x)?)?.relu()?;
        self.bn.forward_t(&self.out.forward(&h)?, false)
    }
}

/// `Net` at O2 (bf16 by default on the CPU; `out` in fp16), its masters and running statistics moved
/// off their initial values so that every exported value is a trained one (masters that no half type
/// holds exactly).
fn trained(seed: u64) -> amp::Result<Net> {
    let mut net = Net::new(seed)?;
    amp::initialize(&mut net, AmpConfig::new(OptLevel::O2, &Device::Cpu))?;
    for (_, p) in net.named_params() {
        p.master().set(&((p.master().as_tensor() * 1.001)? + 1e-4)?)?;
        p.refresh_working()?;
    }
    for (_, b) in net.named_buffers() {
        b.set(&(b.as_tensor() + 0.25)?)?;
    }
    Ok(net)
}

fn tmp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("amp-export-{}-{name}.safetensors", std::process::id()))
}

fn bits(t: &Tensor) -> amp::Result<Vec<u32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect())
}

#[test]
fn an_export_holds_each_weight_in_its_compute_precision_and_loads_back_computing_the_same_bits(
) -> amp::Result<()> {
    let net = trained(1)?;
    let path = tmp("roundtrip");
    let report: ExportReport = export(&net, &path)?;
    println!("{report}");
    let dtypes: Vec<(&str, DType)> = report.tensors.iter().map(|(n, d)| (n.as_str(), *d)).collect();
    assert_eq!(
        dtypes,
        [
            ("norm.weight", DType::F32),
            ("norm.bias", DType::F32),
            ("hidden.weight", DType::BF16),
            ("hidden.bias", DType::BF16),
            ("out.weight", DType::F16),
            ("out.bias", DType::F16),
            ("bn.weight", DType::F32),
            ("bn.bias", DType::F32),
            ("bn.running_mean", DType::F32),
            ("bn.running_var", DType::F32),
        ]
    );
    assert!(report.bytes < report.bytes_fp32 * 3 / 4, "{report}");
    assert!(report.flushed_to_zero.is_empty(), "{report}");
    // The file's tensors: the working copies' bits (half layers), the masters' (fp32 layers).
    let file = candle_core::safetensors::load(&path, &Device::Cpu)?;
    for (name, p) in net.named_params() {
        let stored = p.working().map_or(p.master().as_tensor(), |w| w.as_tensor());
        assert_eq!(file[&name].dtype(), stored.dtype(), "{name}");
        assert_eq!(bits(&file[&name])?, bits(stored)?, "{name}");
    }

    // Loaded into a differently initialised model at the same level: the same outputs, bit for bit.
    let mut loaded = Net::new(2)?;
    amp::initialize(&mut loaded, AmpConfig::new(OptLevel::O2, &Device::Cpu))?;
    load_export(&mut loaded, &path)?;
    let x = common::randn(&mut <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(3), &[4, 6], 1.0)?;
    assert_eq!(bits(&loaded.forward(&x)?)?, bits(&net.forward(&x)?)?, "outputs after load_export");
    for ((name, b), (_, c)) in loaded.named_buffers().iter().zip(net.named_buffers()) {
        assert_eq!(bits(b.as_tensor())?, bits(c.as_tensor())?, "{name}");
    }

    // candle-nn reads it as any safetensors file, converting to the dtype asked.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &Device::Cpu)? };
    let weight = vb.get((12, 6), "hidden.weight")?;
    let working = net.hidden.weight().working().expect("an O2 working copy").as_tensor().clone();
    assert_eq!(bits(&weight)?, bits(&working)?);
    std::fs::remove_file(&path).ok();
    Ok(())
}

#[test]
fn load_refuses_an_export_naming_load_export_and_changes_nothing() -> amp::Result<()> {
    let net = trained(4)?;
    let path = tmp("not-a-checkpoint");
    export(&net, &path)?;
    let mut other = trained(5)?;
    let before: Vec<Vec<u32>> =
        other.named_params().iter().map(|(_, p)| bits(p.master().as_tensor())).collect::<amp::Result<_>>()?;
    let err = amp::checkpoint::load(&mut other, &path).unwrap_err();
    assert!(matches!(err, Error::CheckpointIsExport { .. }), "{err}");
    assert!(err.to_string().contains("checkpoint::load_export"), "{err}");
    let after: Vec<Vec<u32>> =
        other.named_params().iter().map(|(_, p)| bits(p.master().as_tensor())).collect::<amp::Result<_>>()?;
    assert_eq!(after, before);
    // A checkpoint, on the other hand, loads through load_export too (its f32 masters as they are).
    let checkpoint = tmp("a-checkpoint");
    amp::checkpoint::save(&net, &checkpoint)?;
    load_export(&mut other, &checkpoint)?;
    for ((name, a), (_, b)) in other.named_params().iter().zip(net.named_params()) {
        assert_eq!(bits(a.master().as_tensor())?, bits(b.master().as_tensor())?, "{name}");
    }
    std::fs::remove_file(&path).ok();
    std::fs::remove_file(&checkpoint).ok();
    Ok(())
}

#[test]
fn a_weight_fp16_cannot_hold_refuses_the_export_and_writes_nothing() -> amp::Result<()> {
    let net = trained(6)?;
    let weight = net.out.weight();
    let mut values = weight.master().as_tensor().flatten_all()?.to_vec1::<f32>()?;
    (values[0], values[5]) = (7e4, -1e5);
    weight.master().set(&Tensor::from_vec(values, (3, 12), &Device::Cpu)?)?;
    let path = tmp("overflow");
    let err = export(&net, &path).unwrap_err().to_string();
    assert!(err.contains("`out.weight` (2 in F16)") && err.contains("#[amp(bf16)]"), "{err}");
    assert!(!path.exists(), "nothing written");
    Ok(())
}

#[test]
fn values_too_small_for_fp16_are_counted() -> amp::Result<()> {
    let net = trained(7)?;
    let bias = net.out.bias().expect("a bias");
    bias.master().set(&Tensor::new(&[1e-9f32, -2e-8, 0.5], &Device::Cpu)?)?;
    let path = tmp("flush");
    let report = export(&net, &path)?;
    assert_eq!(report.flushed_to_zero, [("out.bias".to_string(), 2)], "{report}");
    assert!(report.to_string().contains("`out.bias`: 2 non-zero value(s)"), "{report}");
    std::fs::remove_file(&path).ok();
    Ok(())
}

#[test]
fn an_fp32_model_exports_in_fp32_and_a_damaged_export_is_refused() -> Result<(), Box<dyn std::error::Error>> {
    let mut net = Net::new(8)?;
    amp::initialize(&mut net, AmpConfig { opt_level: OptLevel::O0, half: Precision::Bf16 })?;
    let path = tmp("fp32");
    let report = export(&net, &path)?;
    assert!(report.tensors.iter().all(|(_, d)| *d == DType::F32), "{report}");
    assert_eq!(report.bytes, report.bytes_fp32);
    let mut bytes = std::fs::read(&path)?;
    let last = bytes.len() - 1;
    bytes[last] ^= 0x10;
    std::fs::write(&path, &bytes)?;
    let err = load_export(&mut Net::new(9)?, &path).unwrap_err();
    assert!(matches!(err, Error::CheckpointDamaged { .. }), "{err}");
    std::fs::remove_file(&path).ok();
    Ok(())
}
