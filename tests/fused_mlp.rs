//! `amp::nn::gelu_mlp(x, up, down)`: the values and every gradient of `down(gelu(up(x)))` written as the
//! two layers (`down.forward(&up.forward_gelu(x)?)`), bit for bit, in fp32, under O2 bf16 / fp16 and O3,
//! with and without biases, on matrices and on `(batch, t, features)`; through candle's backward pass and
//! through amp's fused step (whose gradient sink the fused ops hand the weights' gradients to). The
//! hidden activation between the two ops is kept out of candle's graph, so the tests also run a second
//! backward pass over the same graph, an input that needs no gradient, a layer kept in fp32 beside a half
//! one, and candle's kernel forced (where the two layers run one after the other).

mod common;

use amp::dispatch::{self, Override};
use amp::nn::{
    gelu_mlp, gelu_mlp_normed, gelu_mlp_residual, layer_norm, linear, linear_no_bias, LayerNorm, Linear,
};
use amp::optim::{AdamConfig, FusedAdamW, ParamGroups};
use amp::scaler::ScalerConfig;
use amp::varmap::SeededInit;
use amp::{AmpConfig, AmpModule, GradScaler, OptLevel, Precision};
use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_nn::VarMap;

#[derive(AmpModule)]
struct Mlp {
    up: Linear,
    down: Linear,
}

/// The same perceptron with its down-projection kept in fp32 whatever the level.
#[derive(AmpModule)]
struct MixedMlp {
    up: Linear,
    #[amp(fp32)]
    down: Linear,
}

const FEATURES: usize = 24;
const HIDDEN: usize = 72;

fn configs() -> [AmpConfig; 4] {
    let dev = Device::Cpu;
    [
        AmpConfig { opt_level: OptLevel::O0, half: Precision::Bf16 },
        AmpConfig::new(OptLevel::O2, &dev).with_half(Precision::Bf16),
        AmpConfig::new(OptLevel::O2, &dev).with_half(Precision::Fp16),
        AmpConfig::new(OptLevel::O3, &dev).with_half(Precision::Bf16),
    ]
}

fn layers(seed: u64, biases: bool) -> Result<(Linear, Linear)> {
    let varmap = VarMap::new();
    let vb = SeededInit::new(seed).var_builder(&varmap, DType::F32, &Device::Cpu);
    if biases {
        Ok((linear(FEATURES, HIDDEN, vb.pp("up"))?, linear(HIDDEN, FEATURES, vb.pp("down"))?))
    } else {
        Ok((linear_no_bias(FEATURES, HIDDEN, vb.pp("up"))?, linear(HIDDEN, FEATURES, vb.pp("down"))?))
    }
}

fn model(config: AmpConfig, biases: bool) -> Result<Mlp> {
    let (up, down) = layers(3, biases)?;
    let mut model = Mlp { up, down };
    amp::initialize(&mut model, config).map_err(candle_core::Error::wrap)?;
    Ok(model)
}

fn forward(up: &Linear, down: &Linear, x: &Tensor, fused: bool) -> Result<Tensor> {
    if fused {
        gelu_mlp(x, up, down)
    } else {
        down.forward(&up.forward_gelu(x)?)
    }
}

/// The output, x's gradient and the parameters' gradients of `sum(y * g)` (candle's backward pass).
fn outputs(up: &Linear, down: &Linear, x: &Var, g: &Tensor, fused: bool) -> Result<Vec<(String, Tensor)>> {
    let y = forward(up, down, x, fused)?;
    let grads = (y.to_dtype(DType::F32)? * g)?.sum_all()?.backward()?;
    let mut all = vec![("y".to_string(), y), ("dx".to_string(), grads.get(x).expect("x's gradient").clone())];
    for (layer, name) in [(up, "up"), (down, "down")] {
        let params = std::iter::once(("weight", layer.weight())).chain(layer.bias().map(|b| ("bias", b)));
        for (what, param) in params {
            let grad = param.grad(name, &grads).map_err(candle_core::Error::wrap)?;
            all.push((format!("{name}.{what}"), grad.expect("a gradient").clone()));
        }
    }
    Ok(all)
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
}

fn assert_same(what: &str, fused: &[(String, Tensor)], apart: &[(String, Tensor)]) -> Result<()> {
    assert_eq!(fused.len(), apart.len(), "{what}");
    for ((name, f), (_, a)) in fused.iter().zip(apart) {
        assert_eq!((f.dims(), f.dtype()), (a.dims(), a.dtype()), "{what}: {name}");
        // `==` on the values: an exact zero may differ in sign (candle adds the unfused activation's
        // gradient to +0, which turns -0 into +0).
        let (f, a) = (f.to_dtype(DType::F32)?.flatten_all()?, a.to_dtype(DType::F32)?.flatten_all()?);
        let (f, a) = (f.to_vec1::<f32>()?, a.to_vec1::<f32>()?);
        for (i, (x, y)) in f.iter().zip(&a).enumerate() {
            assert!(x == y || (x.is_nan() && y.is_nan()), "{what}: {name}[{i}] fused {x:e}, apart {y:e}");
        }
    }
    Ok(())
}

#[test]
fn the_fused_perceptron_is_the_two_layers_bit_for_bit_at_every_level() -> Result<()> {
    for config in configs() {
        for (biases, shape) in [(true, &[3usize, 5, FEATURES][..]), (false, &[7, FEATURES][..])] {
            let model = model(config, biases)?;
            let x = Var::from_tensor(&common::randn_in(11, shape, 1.0, DType::F32)?)?;
            let mut out_shape = shape.to_vec();
            *out_shape.last_mut().expect("dims") = FEATURES;
            let g = common::randn_in(12, &out_shape, 1.0, DType::F32)?;
            let fused = outputs(&model.up, &model.down, &x, &g, true)?;
            let apart = outputs(&model.up, &model.down, &x, &g, false)?;
            assert_same(&format!("{config:?}, biases {biases}"), &fused, &apart)?;
        }
    }
    Ok(())
}

/// The output, x's gradient and every parameter's gradient of `sum(y * g)` for the perceptron of
/// `ln(x)` (with `residual`, `x` plus it): `gelu_mlp_normed` / `gelu_mlp_residual` (fused) or the norm,
/// the two layers and the add one after the other.
fn normed_outputs(
    ln: &LayerNorm,
    (up, down): (&Linear, &Linear),
    (x, residual): (&Var, bool),
    g: &Tensor,
    fused: bool,
) -> Result<Vec<(String, Tensor)>> {
    let y = match (fused, residual) {
        (true, false) => gelu_mlp_normed(ln, x, up, down)?,
        (true, true) => gelu_mlp_residual(ln, x, up, down)?,
        (false, false) => forward(up, down, &ln.forward(x)?, false)?,
        (false, true) => (x.as_tensor() + forward(up, down, &ln.forward(x)?, false)?)?,
    };
    let grads = (y.to_dtype(DType::F32)? * g)?.sum_all()?.backward()?;
    let mut all = vec![("y".to_string(), y), ("dx".to_string(), grads.get(x).expect("x's gradient").clone())];
    let params = [("up.weight", up.weight()), ("down.weight", down.weight()), ("ln.weight", ln.weight())];
    let biases = [("up.bias", up.bias()), ("down.bias", down.bias()), ("ln.bias", ln.bias())];
    for (name, param) in params.into_iter().chain(biases.into_iter().filter_map(|(n, b)| Some((n, b?)))) {
        let grad = param.grad(name, &grads).map_err(candle_core::Error::wrap)?;
        all.push((name.to_string(), grad.expect("a gradient").clone()));
    }
    Ok(all)
}

#[test]
fn the_normed_and_residual_perceptrons_are_the_composition_bit_for_bit_at_every_level() -> Result<()> {
    let varmap = VarMap::new();
    let ln = layer_norm(FEATURES, 1e-5, SeededInit::new(8).var_builder(&varmap, DType::F32, &Device::Cpu))?;
    ln.weight().trainable().set(&(common::randn_in(21, &[FEATURES], 0.3, DType::F32)? + 1.0)?)?;
    ln.bias().expect("a bias").trainable().set(&common::randn_in(22, &[FEATURES], 0.3, DType::F32)?)?;
    for config in configs() {
        for (biases, shape) in [(true, &[3usize, 5, FEATURES][..]), (false, &[7, FEATURES][..])] {
            let model = model(config, biases)?;
            let x = Var::from_tensor(&(common::randn_in(23, shape, 2.0, DType::F32)? + 0.5)?)?;
            let mut out_shape = shape.to_vec();
            *out_shape.last_mut().expect("dims") = FEATURES;
            let g = common::randn_in(24, &out_shape, 1.0, DType::F32)?;
            for residual in [false, true] {
                let fused = normed_outputs(&ln, (&model.up, &model.down), (&x, residual), &g, true);
                let apart = normed_outputs(&ln, (&model.up, &model.down), (&x, residual), &g, false);
                let what = format!("normed, residual {residual}: {config:?}, biases {biases}");
                match (fused, apart) {
                    (Ok(fused), Ok(apart)) => assert_same(&what, &fused, &apart)?,
                    // Under O3 the result is bf16, which `x + y` refuses to add to f32 either way.
                    (Err(fused), Err(apart)) => assert_eq!(first_line(&fused), first_line(&apart), "{what}"),
                    (fused, apart) => panic!("{what}: fused {:?}, apart {:?}", fused.err(), apart.err()),
                }
            }
        }
    }
    Ok(())
}

#[test]
fn the_norms_output_and_the_hidden_activation_stay_out_of_the_graph() -> Result<()> {
    let varmap = VarMap::new();
    let ln = layer_norm(FEATURES, 1e-5, SeededInit::new(8).var_builder(&varmap, DType::F32, &Device::Cpu))?;
    let model = model(AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Bf16), true)?;
    let x = Var::from_tensor(&common::randn_in(25, &[2, 6, FEATURES], 1.0, DType::F32)?)?;
    // Activations: the norm's output, the hidden one and the result apart; the result alone fused.
    let activations = |y: Tensor| {
        y.sorted_nodes()
            .into_iter()
            .filter(|t| !t.is_variable() && t.elem_count() >= 2 * 6 * FEATURES)
            .count()
    };
    assert_eq!(activations(forward(&model.up, &model.down, &ln.forward(&x)?, false)?), 3);
    assert_eq!(activations(gelu_mlp_normed(&ln, &x, &model.up, &model.down)?), 1);
    let apart = (x.as_tensor() + forward(&model.up, &model.down, &ln.forward(&x)?, false)?)?;
    assert_eq!(activations(apart), 4);
    assert_eq!(activations(gelu_mlp_residual(&ln, &x, &model.up, &model.down)?), 1);
    Ok(())
}

#[test]
fn a_layer_kept_in_fp32_beside_a_half_one_reads_what_it_would_read_apart() -> Result<()> {
    let (up, down) = layers(5, true)?;
    let mut mixed = MixedMlp { up, down };
    amp::initialize(&mut mixed, AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Bf16))
        .map_err(candle_core::Error::wrap)?;
    let x = Var::from_tensor(&common::randn_in(13, &[2, 9, FEATURES], 1.0, DType::F32)?)?;
    let g = common::randn_in(14, &[2, 9, FEATURES], 1.0, DType::F32)?;
    let fused = outputs(&mixed.up, &mixed.down, &x, &g, true)?;
    let apart = outputs(&mixed.up, &mixed.down, &x, &g, false)?;
    assert_same("bf16 up, fp32 down", &fused, &apart)
}

#[test]
fn a_second_backward_pass_over_the_same_graph_gives_the_same_gradients() -> Result<()> {
    let model = model(AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Bf16), true)?;
    let x = Var::from_tensor(&common::randn_in(15, &[4, FEATURES], 1.0, DType::F32)?)?;
    let loss = gelu_mlp(&x, &model.up, &model.down)?.sqr()?.sum_all()?;
    let (first, second) = (loss.backward()?, loss.backward()?);
    let grad = |grads: &candle_core::backprop::GradStore| -> Result<Vec<u32>> {
        let dw = model.up.weight().grad("up", grads).map_err(candle_core::Error::wrap)?;
        bits(dw.expect("a gradient"))
    };
    assert_eq!(grad(&first)?, grad(&second)?);
    assert_eq!(bits(first.get(&x).expect("dx"))?, bits(second.get(&x).expect("dx"))?);
    Ok(())
}

#[test]
fn an_input_that_needs_no_gradient_gets_none_and_the_weights_still_do() -> Result<()> {
    let model = model(AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Bf16), true)?;
    let x = common::randn_in(16, &[4, FEATURES], 1.0, DType::F32)?;
    let y = gelu_mlp(&x, &model.up, &model.down)?;
    let grads = y.sqr()?.sum_all()?.backward()?;
    assert!(grads.get(&x).is_none(), "a batch of data gets no gradient");
    for (layer, name) in [(&model.up, "up"), (&model.down, "down")] {
        let dw = layer.weight().grad(name, &grads).map_err(candle_core::Error::wrap)?;
        let dw = dw.expect("a weight's gradient").to_dtype(DType::F32)?;
        assert!(dw.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0, "{name}'s weight gradient is not zero");
    }
    Ok(())
}

#[test]
fn with_candles_kernel_forced_it_is_the_two_layers() -> Result<()> {
    let model = model(AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Bf16), true)?;
    let x = Var::from_tensor(&common::randn_in(17, &[6, FEATURES], 1.0, DType::F32)?)?;
    let g = common::randn_in(18, &[6, FEATURES], 1.0, DType::F32)?;
    let run =
        |fused| dispatch::with_override(Override::Candle, || outputs(&model.up, &model.down, &x, &g, fused));
    let (fused, apart) =
        (run(true).map_err(candle_core::Error::wrap)??, run(false).map_err(candle_core::Error::wrap)??);
    assert_same("candle's kernel", &fused, &apart)
}

#[test]
fn shapes_that_do_not_chain_are_refused_with_the_linear_error() -> Result<()> {
    let varmap = VarMap::new();
    let vb = SeededInit::new(1).var_builder(&varmap, DType::F32, &Device::Cpu);
    let (up, down) = (linear(FEATURES, HIDDEN, vb.pp("up"))?, linear(HIDDEN + 1, FEATURES, vb.pp("down"))?);
    let x = Tensor::zeros((2, FEATURES), DType::F32, &Device::Cpu)?;
    let err = gelu_mlp(&x, &up, &down).expect_err("mismatched hidden sizes").to_string();
    assert!(err.contains(&format!("input has {HIDDEN} features")), "{err}");
    let narrow = Tensor::zeros((2, FEATURES - 1), DType::F32, &Device::Cpu)?;
    let err = gelu_mlp(&narrow, &up, &up).expect_err("x too narrow").to_string();
    assert!(err.contains(&format!("input has {} features", FEATURES - 1)), "{err}");
    Ok(())
}

/// One fused AdamW step through `GradScaler::step_fused` (amp's backward pass: the products deposit the
/// weights' gradients in the gradient sink) from the same weights, fused and apart: the same weights
/// after it, bit for bit.
#[test]
fn a_fused_optimizer_step_leaves_the_same_weights() -> Result<()> {
    let dev = Device::Cpu;
    let mut stepped = Vec::new();
    for fused in [true, false] {
        let model = model(AmpConfig::new(OptLevel::O2, &dev).with_half(Precision::Bf16), true)?;
        let mut optimizer = FusedAdamW::new(
            ParamGroups::from_model(&model).map_err(candle_core::Error::wrap)?,
            AdamConfig { lr: 1e-2, ..AdamConfig::default() },
        )
        .map_err(candle_core::Error::wrap)?;
        let mut scaler =
            GradScaler::for_model(&model, ScalerConfig::default()).map_err(candle_core::Error::wrap)?;
        let x = common::randn_in(19, &[2, 8, FEATURES], 1.0, DType::F32)?;
        let y = common::randn_in(20, &[2, 8, FEATURES], 1.0, DType::F32)?;
        let loss = amp::ops::loss::mse(&forward(&model.up, &model.down, &x, fused)?, &y)?;
        scaler.step_fused(&loss, &mut optimizer, None).map_err(candle_core::Error::wrap)?;
        let masters = [&model.up, &model.down]
            .into_iter()
            .flat_map(|l| [Some(l.weight()), l.bias()])
            .flatten()
            .map(|p| bits(p.master().as_tensor()))
            .collect::<Result<Vec<_>>>()?;
        stepped.push(masters);
    }
    assert_eq!(stepped[0], stepped[1]);
    Ok(())
}

/// An error's message without the backtrace candle appends.
fn first_line(e: &candle_core::Error) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}
