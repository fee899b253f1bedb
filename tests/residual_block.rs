//! A residual block written the obvious way, with no casts, runs forward and backward under O0-O3 and
//! its gradients match the fp32 reference.
//!
//! Tolerance: in mixed precision every product operand (activation, weight, upstream gradient) is
//! rounded once to the half format, relative error at most u = 2^-(mantissa bits + 1), and products
//! accumulate in f32. A gradient of this block passes through at most four rounded operands on its
//! way (input, norm output, hidden activation, weight), each contributing about u to the normwise error
//! to first order; with O3's half storage of weights and outputs adding as many again, 16u bounds it with
//! margin: 0.0625 for bf16 (u = 2^-8), 0.0078 for fp16 (u = 2^-11).

mod common;

use amp::nn::{layer_norm, linear, LayerNorm, Linear};
use amp::{AmpConfig, AmpModule, AmpModuleExt, OptLevel, Precision};
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;

const WIDTH: usize = 32;
const HIDDEN: usize = 64;

#[derive(AmpModule)]
struct Residual {
    #[amp(fp32)]
    norm: LayerNorm,
    up: Linear,
    down: Linear,
}

impl Module for Residual {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x + self.down.forward(&self.up.forward(&self.norm.forward(x)?)?.relu()?)?
    }
}

fn block() -> Result<Residual> {
    let weights = common::random_weights(
        7,
        &[
            ("norm.weight", &[WIDTH], 0.5),
            ("norm.bias", &[WIDTH], 0.1),
            ("up.weight", &[HIDDEN, WIDTH], 0.2),
            ("up.bias", &[HIDDEN], 0.1),
            ("down.weight", &[WIDTH, HIDDEN], 0.2),
            ("down.bias", &[WIDTH], 0.1),
        ],
    )?;
    let vb = VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu);
    Ok(Residual {
        norm: layer_norm(WIDTH, 1e-5, vb.pp("norm"))?,
        up: linear(WIDTH, HIDDEN, vb.pp("up"))?,
        down: linear(HIDDEN, WIDTH, vb.pp("down"))?,
    })
}

/// Output (as f32) and the gradient of every parameter (as f32, by path) for `sum(block(x) * r)`.
fn forward_backward(config: AmpConfig) -> Result<(Tensor, Vec<(String, Tensor)>)> {
    let mut block = block()?;
    amp::initialize(&mut block, config).map_err(candle_core::Error::from)?;
    let inputs = common::random_weights(11, &[("x", &[16, WIDTH], 1.0), ("r", &[16, WIDTH], 1.0)])?;
    // The model's activations enter in its activation dtype: f32 except at O3 (amp's O1 and O2 keep
    // activations f32 between layers, where Apex O2 casts the inputs to half: README, "Precision levels").
    let x = inputs["x"].to_dtype(config.activation_precision().dtype())?;
    let y = block.forward(&x)?;
    assert_eq!(y.dtype(), x.dtype(), "the residual add keeps the activation dtype");
    let y = y.to_dtype(DType::F32)?;
    let grads = (&y * &inputs["r"])?.sum_all()?.backward()?;
    let mut out = Vec::new();
    for (path, param) in block.named_params() {
        let grad = param.grad(&path, &grads).map_err(candle_core::Error::wrap)?.ok_or_else(|| {
            candle_core::Error::Msg(format!("{path} has no gradient under {}", config.opt_level))
        })?;
        // A Linear's weight is read by amp's CPU GEMM as its source, the master (f32 unless O3 keeps
        // none), rounded while packing, and its bias through the master as well: their gradients have
        // the master's dtype. The LayerNorm's have the trainable's.
        let linear = !path.starts_with("norm");
        let expected = if linear { param.master().dtype() } else { param.trainable().dtype() };
        assert_eq!(grad.dtype(), expected, "{path} under {}", config.opt_level);
        out.push((path, grad.to_dtype(DType::F32)?));
    }
    Ok((y, out))
}

#[test]
fn residual_block_gradients_match_fp32_under_every_level() -> Result<()> {
    let reference = forward_backward(AmpConfig { opt_level: OptLevel::O0, half: Precision::Bf16 })?;
    assert_eq!(reference.1.len(), 6, "norm, up and down each have a weight and a bias");
    for half in [Precision::Bf16, Precision::Fp16] {
        let tolerance = 16.0 * half.epsilon() / 2.0;
        for opt_level in [OptLevel::O1, OptLevel::O2, OptLevel::O3] {
            let (y, grads) = forward_backward(AmpConfig { opt_level, half })?;
            let err = common::relative_error(&y, &reference.0)?;
            assert!(err < tolerance, "{opt_level} {half}: output error {err:.2e} > {tolerance:.2e}");
            for ((path, grad), (_, expected)) in grads.iter().zip(&reference.1) {
                let err = common::relative_error(grad, expected)?;
                assert!(
                    err < tolerance,
                    "{opt_level} {half}: {path} gradient error {err:.2e} > {tolerance:.2e}"
                );
                // Weight gradients are products of rounded operands; biases sum in f32 and may be exact.
                let is_weight = path.ends_with("weight") && !path.starts_with("norm");
                assert!(err > 0.0 || !is_weight, "{opt_level} {half}: {path} was not computed in half");
            }
        }
    }
    Ok(())
}

#[test]
fn o0_ignores_attributes_and_stays_fp32() -> Result<()> {
    let mut block = block()?;
    amp::initialize(&mut block, AmpConfig::new(OptLevel::O0, &Device::Cpu))
        .map_err(candle_core::Error::from)?;
    let plan = block.precision_plan();
    assert!(plan.rows.iter().all(|row| row.compute == Precision::Fp32), "{plan}");
    assert_eq!(plan.bytes_planned(), plan.bytes_fp32());
    Ok(())
}
