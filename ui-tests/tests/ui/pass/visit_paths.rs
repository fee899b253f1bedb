// visit walks every layer in declaration order with its dotted path (tuple fields and container
// elements by index) and the innermost requested precision; skipped fields are not visited.
use amp::nn::{layer_norm, linear, LayerNorm, Linear};
use amp::module::Cursor;
use amp::{AmpModule, Layer, LayerSite, PrecisionSpec};
use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};

#[derive(AmpModule)]
struct Pair(#[amp(fp32)] LayerNorm, Linear);

#[derive(AmpModule)]
#[amp(default = bf16)]
struct Model {
    #[amp(fp16)]
    blocks: Vec<Pair>,
    head: Option<Linear>,
    #[amp(skip)]
    dropout: f32,
}

fn main() -> candle_core::Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let pair = |i: usize| -> candle_core::Result<Pair> {
        Ok(Pair(layer_norm(4, 1e-5, vb.pp(format!("n{i}")))?, linear(4, 4, vb.pp(format!("l{i}")))?))
    };
    let mut model =
        Model { blocks: vec![pair(0)?, pair(1)?], head: Some(linear(4, 2, vb.pp("head"))?), dropout: 0.1 };

    let mut seen = Vec::new();
    let mut record = |site: LayerSite<'_>, layer: &dyn Layer| {
        seen.push((site.path.to_string(), site.requested, layer.kind()))
    };
    model.visit(&mut Cursor::new(), &mut record);
    use PrecisionSpec::*;
    let expected = [
        ("blocks.0.0", Some(Fp32), "LayerNorm"),
        ("blocks.0.1", Some(Fp16), "Linear"),
        ("blocks.1.0", Some(Fp32), "LayerNorm"),
        ("blocks.1.1", Some(Fp16), "Linear"),
        ("head", Some(Bf16), "Linear"),
    ];
    let expected: Vec<_> =
        expected.iter().map(|&(path, spec, kind)| (path.to_string(), spec, kind)).collect();
    assert_eq!(seen, expected);

    let mut paths = Vec::new();
    let mut record_mut = |site: LayerSite<'_>, _: &mut dyn Layer| paths.push(site.path.to_string());
    model.visit_mut(&mut Cursor::new(), &mut record_mut);
    assert_eq!(paths, ["blocks.0.0", "blocks.0.1", "blocks.1.0", "blocks.1.1", "head"]);
    assert_eq!(model.dropout, 0.1);
    Ok(())
}
