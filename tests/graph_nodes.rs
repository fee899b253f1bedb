//! amp's CPU ops take activations of any rank as they come: a Linear or a LayerNorm on `(batch, t,
//! features)` is one node of candle's graph, not a reshape, the op and a reshape back. Each node costs
//! candle's backward pass a zero-filled tensor of its size and an add into it; on the main job the
//! reshapes were 90 of 220 MiB of such sums a step. The values and every gradient are those of the same
//! layer on the input folded into a matrix, bit for bit, in fp32 and under O2 bf16 / fp16.

mod common;

use amp::nn::{layer_norm, linear, LayerNorm, Linear};
use amp::varmap::SeededInit;
use amp::{AmpConfig, AmpModule, OptLevel, Precision};
use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_nn::VarMap;

#[derive(AmpModule)]
struct Layers {
    fc: Linear,
    #[amp(fp32)]
    norm: LayerNorm,
}

const SHAPE: [usize; 3] = [3, 5, 24];
const OUTPUTS: usize = 16;

fn configs() -> [AmpConfig; 3] {
    let dev = Device::Cpu;
    [
        AmpConfig { opt_level: OptLevel::O0, half: Precision::Bf16 },
        AmpConfig::new(OptLevel::O2, &dev).with_half(Precision::Bf16),
        AmpConfig::new(OptLevel::O2, &dev).with_half(Precision::Fp16),
    ]
}

fn layers(config: AmpConfig) -> Result<Layers> {
    let varmap = VarMap::new();
    let vb = SeededInit::new(5).var_builder(&varmap, DType::F32, &Device::Cpu);
    let mut model = Layers {
        fc: linear(SHAPE[2], OUTPUTS, vb.pp("fc"))?,
        norm: layer_norm(SHAPE[2], 1e-5, vb.pp("norm"))?,
    };
    amp::initialize(&mut model, config).map_err(candle_core::Error::wrap)?;
    Ok(model)
}

/// Graph nodes of activations (rank 2 or more, not variables) from `y` back to the variables. (Under
/// O2 a Linear's bias, a half variable, is widened to f32 for the GEMM: a vector node of its own.)
fn activation_nodes(y: &Tensor) -> usize {
    y.sorted_nodes().into_iter().filter(|t| !t.is_variable() && t.rank() >= 2).count()
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
}

/// `y = layer(x)` and the gradients of `sum(y * g)` with respect to `x` and to the layer's parameters
/// (by name), as bits.
fn value_and_gradients(
    model: &Layers,
    layer: &dyn Fn(&Tensor) -> Result<Tensor>,
    x: &Var,
    g: &Tensor,
) -> Result<Vec<(String, Vec<u32>)>> {
    let y = layer(x.as_tensor())?;
    let grads = (y.to_dtype(DType::F32)? * g.reshape(y.dims())?)?.sum_all()?.backward()?;
    let mut all = vec![("y".to_string(), bits(&y.flatten_all()?)?)];
    all.push(("dx".into(), bits(grads.get(x).expect("x's gradient"))?));
    for (name, param) in [
        ("fc.weight", model.fc.weight()),
        ("fc.bias", model.fc.bias().expect("a bias")),
        ("norm.weight", model.norm.weight()),
        ("norm.bias", model.norm.bias().expect("a bias")),
    ] {
        if let Some(grad) = param.grad(name, &grads).map_err(candle_core::Error::wrap)? {
            all.push((name.into(), bits(grad)?));
        }
    }
    Ok(all)
}

#[test]
fn a_linear_and_a_layer_norm_on_a_3d_input_are_one_node_each_and_compute_what_they_do_on_a_matrix(
) -> Result<()> {
    for config in configs() {
        let model = layers(config)?;
        let x = common::randn_in(1, &SHAPE, 1.0, DType::F32)?;
        let g = common::randn_in(2, &[SHAPE[0] * SHAPE[1], OUTPUTS.max(SHAPE[2])], 1.0, DType::F32)?;
        for (what, layer) in [
            ("Linear", &(|x: &Tensor| model.fc.forward(x)) as &dyn Fn(&Tensor) -> Result<Tensor>),
            ("LayerNorm", &|x: &Tensor| model.norm.forward(x)),
        ] {
            let cols = layer(&x)?.dim(2)?;
            let g = g.narrow(1, 0, cols)?.contiguous()?;
            let x_var = Var::from_tensor(&x)?;
            let y = layer(x_var.as_tensor())?;
            assert_eq!(activation_nodes(&y), 1, "{what} under {config:?}: the op alone");
            assert_eq!(y.dims(), &[SHAPE[0], SHAPE[1], cols], "{what}");

            let folded = Var::from_tensor(&x.reshape((SHAPE[0] * SHAPE[1], SHAPE[2]))?)?;
            let on_3d = value_and_gradients(&model, layer, &x_var, &g)?;
            let on_matrix = value_and_gradients(&model, layer, &folded, &g)?;
            assert_eq!(on_3d.len(), on_matrix.len());
            for ((name, a), (_, b)) in on_3d.iter().zip(&on_matrix) {
                assert!(a == b, "{what} under {config:?}: {name} differs from the folded input's");
            }
        }
    }
    Ok(())
}

#[test]
fn a_strided_3d_input_is_read_as_its_contiguous_copy() -> Result<()> {
    let model = layers(configs()[1])?;
    // (t, batch, features) transposed to (batch, t, features): not contiguous.
    let x = common::randn_in(3, &[SHAPE[1], SHAPE[0], SHAPE[2]], 1.0, DType::F32)?.transpose(0, 1)?;
    assert!(!x.is_contiguous());
    let copy = x.contiguous()?;
    assert_eq!(bits(&model.fc.forward(&x)?)?, bits(&model.fc.forward(&copy)?)?, "Linear");
    assert_eq!(bits(&model.norm.forward(&x)?)?, bits(&model.norm.forward(&copy)?)?, "LayerNorm");
    Ok(())
}
