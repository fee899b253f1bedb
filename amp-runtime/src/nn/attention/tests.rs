//! Self-attention fused into four ops (`ops::self_attention`) against the composition it replaces: the
//! output, x's gradient and every parameter's gradient, bit for bit, at every level and on every GEMM
//! path of this CPU and the software models; an input that needs no gradient, a second backward pass,
//! and amp's fused optimizer step (whose gradient sink the ops hand the weights' gradients to).

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_nn::VarMap;

use super::{multi_head_attention, MultiHeadAttention};
use crate::dispatch::{with_override, Override};
use crate::nn::{layer_norm, linear, linear_no_bias, LayerNorm};
use crate::optim::{AdamConfig, FusedAdamW, ParamGroups};
use crate::scaler::ScalerConfig;
use crate::varmap::SeededInit;
use crate::{AmpConfig, GradScaler, OptLevel, Precision};
use amp_kernels::gemm::GemmPath;

const EMBED: usize = 24;
const HEADS: usize = 3;

fn configs() -> [AmpConfig; 4] {
    let dev = Device::Cpu;
    [
        AmpConfig { opt_level: OptLevel::O0, half: Precision::Bf16 },
        AmpConfig::new(OptLevel::O2, &dev).with_half(Precision::Bf16),
        AmpConfig::new(OptLevel::O2, &dev).with_half(Precision::Fp16),
        AmpConfig::new(OptLevel::O3, &dev).with_half(Precision::Bf16),
    ]
}

/// Attention with seeded weights under `config`; without biases on `k_proj` and `out_proj` when
/// `biases` is false.
fn attention(config: AmpConfig, biases: bool, causal: bool) -> Result<MultiHeadAttention> {
    let varmap = VarMap::new();
    let vb = SeededInit::new(9).var_builder(&varmap, DType::F32, &Device::Cpu);
    let mut attn = if biases {
        multi_head_attention(EMBED, HEADS, vb)?
    } else {
        let proj = |name: &str, bias: bool| {
            if bias {
                linear(EMBED, EMBED, vb.pp(name))
            } else {
                linear_no_bias(EMBED, EMBED, vb.pp(name))
            }
        };
        let projections =
            [proj("q_proj", true)?, proj("k_proj", false)?, proj("v_proj", true)?, proj("out_proj", false)?];
        MultiHeadAttention::new(projections, HEADS)?
    };
    attn = attn.with_causal(causal);
    crate::initialize(&mut attn, config).map_err(candle_core::Error::wrap)?;
    Ok(attn)
}

/// The output, x's gradient (when x is a variable) and the parameters' gradients of `sum(y * g)`.
fn outputs(attn: &MultiHeadAttention, x: &Tensor, g: &Tensor, fused: bool) -> Result<Vec<(String, Tensor)>> {
    let y = if fused { attn.forward(x)? } else { attn.composed(x, x, attn.is_causal())? };
    let grads = (y.to_dtype(DType::F32)? * g)?.sum_all()?.backward()?;
    let mut all = vec![("y".to_string(), y)];
    if let Some(dx) = grads.get(x) {
        all.push(("dx".to_string(), dx.clone()));
    }
    all.extend(parameter_gradients(attn, &grads)?);
    Ok(all)
}

fn parameter_gradients(attn: &MultiHeadAttention, grads: &GradStore) -> Result<Vec<(String, Tensor)>> {
    let mut all = Vec::new();
    for (proj, name) in attn.projections().into_iter().zip(["q", "k", "v", "out"]) {
        let params = std::iter::once(("weight", proj.weight())).chain(proj.bias().map(|b| ("bias", b)));
        for (what, param) in params {
            let grad = param.grad(name, grads).map_err(candle_core::Error::wrap)?;
            all.push((format!("{name}.{what}"), grad.expect("a parameter's gradient").clone()));
        }
    }
    Ok(all)
}

fn assert_same(what: &str, fused: &[(String, Tensor)], apart: &[(String, Tensor)]) -> Result<()> {
    let names = |all: &[(String, Tensor)]| all.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(fused), names(apart), "{what}");
    for ((name, f), (_, a)) in fused.iter().zip(apart) {
        assert_eq!((f.dims(), f.dtype()), (a.dims(), a.dtype()), "{what}: {name}");
        // `==` on the values: an exact zero may differ in sign (candle adds a gradient to +0).
        let (f, a) = (f.to_dtype(DType::F32)?.flatten_all()?, a.to_dtype(DType::F32)?.flatten_all()?);
        let (f, a) = (f.to_vec1::<f32>()?, a.to_vec1::<f32>()?);
        for (i, (x, y)) in f.iter().zip(&a).enumerate() {
            assert!(x == y || (x.is_nan() && y.is_nan()), "{what}: {name}[{i}] fused {x:e}, apart {y:e}");
        }
    }
    Ok(())
}

#[test]
fn fused_self_attention_is_the_composition_bit_for_bit() -> Result<()> {
    let paths = [
        Override::Auto,
        Override::Path(GemmPath::Portable),
        Override::Path(GemmPath::Avx512Bf16Model),
        Override::Path(GemmPath::AmxBf16Model),
    ];
    for config in configs() {
        for over in paths {
            for (biases, causal, shape) in
                [(true, true, [2, 9, EMBED]), (false, false, [3, 5, EMBED]), (true, false, [1, 1, EMBED])]
            {
                let attn = attention(config, biases, causal)?;
                let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, &shape, &Device::Cpu)?)?;
                let g = Tensor::randn(0f32, 1.0, &shape, &Device::Cpu)?;
                let run = |fused| with_override(over, || outputs(&attn, &x, &g, fused));
                let fused = run(true).map_err(candle_core::Error::wrap)??;
                let apart = run(false).map_err(candle_core::Error::wrap)??;
                let what = format!("{config:?} {over:?} biases {biases} causal {causal} {shape:?}");
                assert_same(&what, &fused, &apart)?;
            }
        }
    }
    Ok(())
}

/// A seeded layer norm over the attention's features, with a weight and bias away from 1 and 0.
fn norm() -> Result<LayerNorm> {
    let varmap = VarMap::new();
    let vb = SeededInit::new(4).var_builder(&varmap, DType::F32, &Device::Cpu);
    let ln = layer_norm(EMBED, 1e-5, vb)?;
    for (param, shift) in [(ln.weight(), 1.0), (ln.bias().expect("a bias"), 0.0)] {
        let noise = (Tensor::randn(0f32, 0.3, EMBED, &Device::Cpu)? + shift)?;
        param.trainable().set(&noise)?;
    }
    Ok(ln)
}

/// As [`outputs`] for `attn(norm(x))`, or with `residual` `x + attn(norm(x))`, with the norm's
/// parameters' gradients.
fn normed_outputs(
    attn: &MultiHeadAttention,
    ln: &LayerNorm,
    (x, residual): (&Tensor, bool),
    g: &Tensor,
    fused: bool,
) -> Result<Vec<(String, Tensor)>> {
    let y = match (fused, residual) {
        (true, false) => attn.forward_normed(ln, x)?,
        (true, true) => attn.forward_residual(ln, x)?,
        (false, residual) => {
            let normed = ln.forward(x)?;
            let y = attn.composed(&normed, &normed, attn.is_causal())?;
            if residual {
                (x + y)?
            } else {
                y
            }
        }
    };
    let grads = (y.to_dtype(DType::F32)? * g)?.sum_all()?.backward()?;
    let mut all = vec![("y".to_string(), y)];
    if let Some(dx) = grads.get(x) {
        all.push(("dx".to_string(), dx.clone()));
    }
    all.extend(parameter_gradients(attn, &grads)?);
    for (what, param) in [("weight", ln.weight()), ("bias", ln.bias().expect("a bias"))] {
        let grad = param.grad("ln", &grads).map_err(candle_core::Error::wrap)?;
        all.push((format!("ln.{what}"), grad.expect("the norm's gradient").clone()));
    }
    Ok(all)
}

#[test]
fn normed_and_residual_self_attention_are_the_composition_bit_for_bit() -> Result<()> {
    let paths = [Override::Auto, Override::Path(GemmPath::Portable), Override::Path(GemmPath::AmxBf16Model)];
    for config in configs() {
        for over in paths {
            for (biases, causal, shape) in [(true, true, [2, 9, EMBED]), (false, false, [3, 5, EMBED])] {
                for residual in [false, true] {
                    let attn = attention(config, biases, causal)?;
                    let ln = norm()?;
                    let x = Var::from_tensor(&(Tensor::randn(0f32, 2.0, &shape, &Device::Cpu)? + 0.5)?)?;
                    let g = Tensor::randn(0f32, 1.0, &shape, &Device::Cpu)?;
                    let run =
                        |fused| with_override(over, || normed_outputs(&attn, &ln, (&x, residual), &g, fused));
                    let fused = run(true).map_err(candle_core::Error::wrap)?;
                    let apart = run(false).map_err(candle_core::Error::wrap)?;
                    let what = format!(
                        "normed, residual {residual}: {config:?} {over:?} biases {biases} causal {causal} {shape:?}"
                    );
                    match (fused, apart) {
                        (Ok(fused), Ok(apart)) => assert_same(&what, &fused, &apart)?,
                        // Under O3 the result is bf16, which `x + y` refuses to add to f32 either way.
                        (Err(fused), Err(apart)) => {
                            assert_eq!(first_line(&fused), first_line(&apart), "{what}")
                        }
                        (fused, apart) => panic!("{what}: fused {:?}, apart {:?}", fused.err(), apart.err()),
                    }
                }
            }
        }
    }
    Ok(())
}

#[test]
fn the_fused_ops_replace_the_composition_in_the_graph() -> Result<()> {
    let attn = attention(AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Bf16), true, true)?;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, 4, EMBED), &Device::Cpu)?)?;
    // Nodes of the activations' shape: `q`, `k`, `v`, the mix and the output in the composition, the
    // output alone fused (the three tokens between the ops hold one element each).
    let activations = |y: Tensor| {
        y.sorted_nodes().into_iter().filter(|t| !t.is_variable() && t.dims() == [2, 4, EMBED]).count()
    };
    assert_eq!(activations(attn.composed(&x, &x, true)?), 5);
    assert_eq!(activations(attn.forward(&x)?), 1);
    // With the norm: the norm's output joins them in the composition, not in the fused ops.
    let ln = norm()?;
    let normed = ln.forward(&x)?;
    assert_eq!(activations(attn.composed(&normed, &normed, true)?), 6);
    assert_eq!(activations(attn.forward_normed(&ln, &x)?), 1);
    // With the residual: the sum joins them in the composition; fused, the result is the sum.
    assert_eq!(activations((x.as_tensor() + attn.composed(&normed, &normed, true)?)?), 7);
    assert_eq!(activations(attn.forward_residual(&ln, &x)?), 1);
    Ok(())
}

#[test]
fn an_input_that_needs_no_gradient_gets_none_and_the_weights_the_same_ones() -> Result<()> {
    let attn = attention(AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Bf16), true, true)?;
    let x = Tensor::randn(0f32, 1.0, (2, 6, EMBED), &Device::Cpu)?;
    let g = Tensor::randn(0f32, 1.0, (2, 6, EMBED), &Device::Cpu)?;
    let (fused, apart) = (outputs(&attn, &x, &g, true)?, outputs(&attn, &x, &g, false)?);
    assert!(fused.iter().all(|(name, _)| name != "dx"), "a batch of data gets no gradient");
    assert_same("x without gradient", &fused, &apart)
}

#[test]
fn a_second_backward_pass_over_the_same_graph_gives_the_same_gradients() -> Result<()> {
    let attn = attention(AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Bf16), true, true)?;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, 5, EMBED), &Device::Cpu)?)?;
    let loss = attn.forward(&x)?.sqr()?.sum_all()?;
    let (first, second) = (loss.backward()?, loss.backward()?);
    let all = |grads: &GradStore| -> Result<Vec<(String, Tensor)>> {
        let mut all = parameter_gradients(&attn, grads)?;
        all.push(("dx".into(), grads.get(&x).expect("x's gradient").clone()));
        Ok(all)
    };
    assert_same("second pass", &all(&second)?, &all(&first)?)
}

/// One fused AdamW step through `GradScaler::step_fused` (amp's backward pass: the ops deposit the
/// weights' gradients in the gradient sink) from the same weights, fused and composed: the same
/// masters after it, bit for bit.
#[test]
fn a_fused_optimizer_step_leaves_the_same_weights() -> Result<()> {
    let dev = Device::Cpu;
    let mut stepped = Vec::new();
    for fused in [true, false] {
        let attn = attention(AmpConfig::new(OptLevel::O2, &dev).with_half(Precision::Bf16), true, true)?;
        let groups = ParamGroups::from_model(&attn).map_err(candle_core::Error::wrap)?;
        let mut optimizer = FusedAdamW::new(groups, AdamConfig { lr: 1e-2, ..AdamConfig::default() })
            .map_err(candle_core::Error::wrap)?;
        let mut scaler =
            GradScaler::for_model(&attn, ScalerConfig::default()).map_err(candle_core::Error::wrap)?;
        let x = Tensor::arange(0u32, (2 * 8 * EMBED) as u32, &dev)?.to_dtype(DType::F32)?;
        let x = (x.reshape((2, 8, EMBED))? * 0.01)?.sin()?;
        let y = if fused { attn.forward(&x)? } else { attn.composed(&x, &x, true)? };
        let loss = y.sqr()?.mean_all()?;
        scaler.step_fused(&loss, &mut optimizer, None).map_err(candle_core::Error::wrap)?;
        let masters = attn
            .projections()
            .into_iter()
            .flat_map(|l| [Some(l.weight()), l.bias()])
            .flatten()
            .map(|p| p.master().as_tensor().flatten_all()?.to_vec1::<f32>())
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
