//! `amp::nn::MultiHeadAttention`: f64 references in fp16 and bf16, the causal mask, the attention
//! products in the projections' compute precision, traversal by `amp::initialize`, candle-nn weights.
//!
//! Tolerance (normwise relative, `common::tolerance`): count the roundings to the half format on the way
//! from `x` to `y`: `x` (1); each of the q, k, v projections rounds its weight, its product and its
//! biased sum (3 x 3); the scores, the probabilities and `probs v` (3); the output projection's weight,
//! product and biased sum (3): 16 roundings of `u` (2^-11 fp16, 2^-8 bf16). The scale 1/sqrt(16) is
//! exact and softmax is f32. Safety factor 2: the softmax amplifies the scores' relative error by
//! about `|s|`, which is 1-2 on these data. Gradients retrace the same roundings (the upstream gradient
//! replaces `x`): same count, same factor.

mod common;

use amp::dispatch::Override;
use amp::nn::{layer_norm, linear, multi_head_attention, LayerNorm, Linear, MultiHeadAttention};
use amp::{AmpConfig, AmpModule, AmpModuleExt, OptLevel, Param, ParamStorage, Precision};
use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{VarBuilder, VarMap};

const EMBED: usize = 32;
const HEADS: usize = 2;

/// Weights `[wq, bq, wk, bk, wv, bv, wo, bo]`, f32.
fn weights() -> Result<Vec<Tensor>> {
    (0..8)
        .map(|i| {
            let shape: &[usize] = if i % 2 == 0 { &[EMBED, EMBED] } else { &[EMBED] };
            common::randn_in(40 + i as u64, shape, if i % 2 == 0 { 0.25 } else { 0.1 }, DType::F32)
        })
        .collect()
}

/// Attention written out in the tensors' dtype (f64 for the reference), from `[x, weights..]`.
fn reference(t: &[Tensor], causal: bool) -> Result<Tensor> {
    let (batch, len, _) = t[0].dims3()?;
    let d = EMBED / HEADS;
    let project = |x: &Tensor, i: usize| x.broadcast_matmul(&t[i].t()?)?.broadcast_add(&t[i + 1]);
    let heads = |x: Tensor| x.reshape((batch, len, HEADS, d))?.transpose(1, 2)?.contiguous();
    let (q, k, v) = (heads(project(&t[0], 1)?)?, heads(project(&t[0], 3)?)?, heads(project(&t[0], 5)?)?);
    let mut scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
    if causal {
        let mask: Vec<f64> = (0..len)
            .flat_map(|i| (0..len).map(move |j| if j > i { f64::NEG_INFINITY } else { 0.0 }))
            .collect();
        scores = scores
            .broadcast_add(&Tensor::from_vec(mask, (len, len), &Device::Cpu)?.to_dtype(scores.dtype())?)?;
    }
    let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
    let mixed = probs.matmul(&v)?.transpose(1, 2)?.reshape((batch, len, EMBED))?;
    project(&mixed, 7)
}

/// Our attention on the weights `t[1..]`, initialized under `config`.
fn ours(t: &[Tensor], config: AmpConfig, causal: bool) -> Result<MultiHeadAttention> {
    let proj = |i: usize| {
        Ok::<_, candle_core::Error>(Linear::new(
            Param::from_tensor(&t[i])?,
            Some(Param::from_tensor(&t[i + 1])?),
        ))
    };
    let mut attn =
        MultiHeadAttention::new([proj(1)?, proj(3)?, proj(5)?, proj(7)?], HEADS)?.with_causal(causal);
    amp::initialize(&mut attn, config)?;
    Ok(attn)
}

/// On amp's GEMM (the scale, mask and softmax one fused op) and on candle's kernel (CUDA, or forced as
/// here: its output is rounded to the compute precision, so `q` is scaled before `q k^T` and the mask and
/// softmax are candle ops), against the same f64 reference and tolerance.
#[test]
fn attention_matches_f64_in_fp16_and_bf16_forward_and_backward() -> Result<()> {
    let mut inputs = vec![common::randn_in(1, &[2, 7, EMBED], 1.0, DType::F32)?];
    inputs.extend(weights()?);
    let inputs64 = inputs.iter().map(|t| t.to_dtype(DType::F64)).collect::<Result<Vec<_>>>()?;
    let names = ["x", "wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo"];
    for (causal, over) in [false, true].into_iter().flat_map(|c| [(c, Override::Auto), (c, Override::Candle)])
    {
        let (y_ref, grads_ref) = common::value_and_grads(|t| reference(t, causal), &inputs64)?;
        for half in [Precision::Fp16, Precision::Bf16] {
            let config = AmpConfig { opt_level: OptLevel::O1, half };
            let (y, grads) = amp::dispatch::with_override(over, || {
                common::value_and_grads(|t| ours(t, config, causal)?.forward(&t[0]), &inputs)
            })
            .map_err(candle_core::Error::wrap)??;
            assert_eq!(y.dtype(), DType::F32, "O1 returns f32 activations");
            let tol = common::tolerance(half.dtype(), 16, 2.0);
            let err = common::assert_close(
                &format!("attention {half} causal={causal} {over:?} forward"),
                &y,
                &y_ref,
                tol,
            )?;
            assert!(err > common::unit_roundoff(half.dtype()) / 8.0, "{half}: no sign of half rounding");
            for ((name, grad), expected) in names.iter().zip(&grads).zip(&grads_ref) {
                if *name == "bk" {
                    continue; // below: its exact value is 0
                }
                common::assert_close(
                    &format!("attention {half} causal={causal} {over:?} grad {name}"),
                    grad,
                    expected,
                    tol,
                )?;
            }
            // Adding bk shifts every score of a query by the same q.bk, which softmax ignores: the exact
            // gradient is 0 (the f64 one is 1e-17). What is left is rounding noise of sums whose terms are
            // as large as those of bq's gradient, so measure it against that.
            let noise = grads[4].sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()? as f64;
            let scale = grads_ref[2].sqr()?.sum_all()?.sqrt()?.to_scalar::<f64>()?;
            eprintln!(
                "attention {half} causal={causal} {over:?} grad bk: |g| / |g_bq| = {:.3e} (tolerance {tol:.3e})",
                noise / scale
            );
            assert!(noise <= tol * scale, "grad bk is not noise: {noise:.3e} vs {scale:.3e}");
        }
    }
    Ok(())
}

#[test]
fn causal_attention_ignores_the_future_exactly() -> Result<()> {
    let mut inputs = vec![common::randn_in(2, &[1, 6, EMBED], 1.0, DType::F32)?];
    inputs.extend(weights()?);
    for half in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
        let config = AmpConfig { opt_level: if half.is_half() { OptLevel::O1 } else { OptLevel::O0 }, half };
        let attn = ours(&inputs, config, true)?;
        let x = &inputs[0];
        let changed = Tensor::cat(&[x.narrow(1, 0, 5)?, (x.narrow(1, 5, 1)? * 100.0)?], 1)?;
        let (a, b) = (attn.forward(x)?, attn.forward(&changed)?);
        let past = |t: &Tensor| t.narrow(1, 0, 5)?.flatten_all()?.to_vec1::<f32>();
        assert_eq!(past(&a)?, past(&b)?, "{half}: positions 0..5 do not see position 5");
        assert_ne!(
            a.narrow(1, 5, 1)?.flatten_all()?.to_vec1::<f32>()?,
            b.narrow(1, 5, 1)?.flatten_all()?.to_vec1::<f32>()?
        );
        let full = ours(&inputs, config, false)?;
        assert_ne!(
            past(&full.forward(x)?)?,
            past(&full.forward(&changed)?)?,
            "{half}: without the mask it does"
        );
    }
    Ok(())
}

#[derive(AmpModule)]
struct Block {
    #[amp(fp32)]
    norm: LayerNorm,
    #[amp(bf16)]
    attn: MultiHeadAttention,
    head: Linear,
}

#[test]
fn initialize_reaches_the_projections_and_the_attention_computes_in_their_precision() -> Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut block = Block {
        norm: layer_norm(EMBED, 1e-5, vb.pp("norm"))?,
        attn: multi_head_attention(EMBED, HEADS, vb.pp("attn"))?.with_causal(true),
        head: linear(EMBED, 4, vb.pp("head"))?,
    };
    assert_eq!(block.attn.compute_precision(), Precision::Fp32, "fp32 until initialized");
    amp::initialize(&mut block, AmpConfig { opt_level: OptLevel::O2, half: Precision::Fp16 })?;
    assert_eq!(block.attn.compute_precision(), Precision::Bf16, "the field's #[amp(bf16)] reaches q_proj");
    let paths: Vec<String> = block.named_params().into_iter().map(|(path, _)| path).collect();
    for name in ["q_proj", "k_proj", "v_proj", "out_proj"] {
        assert!(
            paths.contains(&format!("attn.{name}.weight")) && paths.contains(&format!("attn.{name}.bias")),
            "{paths:?}"
        );
    }
    for (path, param) in block.named_params() {
        let expected = match &path[..4] {
            "norm" => ParamStorage::Fp32,
            "attn" => ParamStorage::MasterAndWorking(Precision::Bf16),
            _ => ParamStorage::MasterAndWorking(Precision::Fp16),
        };
        assert_eq!(param.storage(), expected, "{path}");
    }
    assert!(Block::PLAN.to_string().contains("q_proj"), "{}", Block::PLAN);
    // Under O2 every working copy receives a gradient through the bf16 attention.
    let x = common::randn_in(3, &[2, 5, EMBED], 1.0, DType::F32)?;
    let y = block.head.forward(&block.attn.forward(&block.norm.forward(&x)?)?)?;
    assert_eq!(y.dtype(), DType::F32);
    let grads = y.sqr()?.sum_all()?.backward()?;
    for (path, param) in block.named_params() {
        assert!(param.grad(&path, &grads)?.is_some(), "{path} has no gradient");
    }
    Ok(())
}

#[test]
fn attention_loads_candle_nn_linears_and_matches_them_in_f32() -> Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let names = ["q_proj", "k_proj", "v_proj", "out_proj"];
    let theirs: Vec<candle_nn::Linear> =
        names.iter().map(|n| candle_nn::linear(EMBED, EMBED, vb.pp("attn").pp(*n))).collect::<Result<_>>()?;
    let attn = multi_head_attention(EMBED, HEADS, vb.pp("attn"))?;
    let mut t = vec![common::randn_in(4, &[2, 6, EMBED], 1.0, DType::F32)?];
    for linear in &theirs {
        t.push(linear.weight().clone());
        t.push(linear.bias().expect("candle_nn::linear has a bias").clone());
    }
    // Same weights; our f32 path and the written-out one may order their f32 sums differently: 256 u_f32.
    common::assert_close(
        "attention vs candle-nn weights",
        &attn.forward(&t[0])?,
        &reference(&t, false)?,
        common::tolerance(DType::F32, 0, 1.0),
    )?;
    Ok(())
}

#[test]
fn projections_that_do_not_fit_together_and_inputs_that_are_not_batches_are_refused() -> Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let made = std::cell::Cell::new(0);
    let proj = |name: &str, outputs: usize, inputs: usize| {
        made.set(made.get() + 1);
        linear(inputs, outputs, vb.pp(format!("{name}{}", made.get())))
    };
    let refusal = |projections: [Linear; 4]| match MultiHeadAttention::new(projections, 2) {
        Ok(_) => panic!("projections that do not fit were taken"),
        Err(e) => e.to_string(),
    };
    let err = refusal([proj("q", 8, 8)?, proj("k", 4, 8)?, proj("v", 8, 8)?, proj("o", 8, 8)?]);
    assert!(err.contains("k_proj writes 4 features and q_proj 8"), "{err}");
    let err = refusal([proj("q", 8, 8)?, proj("k", 8, 8)?, proj("v", 7, 8)?, proj("o", 8, 7)?]);
    assert!(err.contains("2 heads do not divide v_proj's 7 features"), "{err}");
    let err = refusal([proj("q", 8, 8)?, proj("k", 8, 6)?, proj("v", 8, 8)?, proj("o", 8, 8)?]);
    assert!(err.contains("k_proj reads 6 features and v_proj 8"), "{err}");
    let err = refusal([proj("q", 8, 8)?, proj("k", 8, 8)?, proj("v", 6, 8)?, proj("o", 8, 8)?]);
    assert!(err.contains("out_proj reads 8 features, but v_proj writes 6"), "{err}");
    // Values of another width than queries and keys are attention too.
    MultiHeadAttention::new([proj("q", 8, 8)?, proj("k", 8, 8)?, proj("v", 6, 8)?, proj("o", 8, 6)?], 2)?;

    let attn = multi_head_attention(8, 2, vb.pp("attn"))?;
    let norm = layer_norm(8, 1e-5, vb.pp("ln"))?;
    let single = Tensor::zeros((5, 8), DType::F32, &Device::Cpu)?;
    for err in
        [attn.forward(&single), attn.forward_normed(&norm, &single), attn.forward_residual(&norm, &single)]
    {
        let err = err.expect_err("a single sequence without its batch dimension").to_string();
        assert!(err.contains("must be (batch, t, features), got shape [5, 8]"), "{err}");
        assert!(err.contains("`.unsqueeze(0)`"), "{err}");
    }
    assert_eq!(attn.forward(&single.unsqueeze(0)?)?.dims(), &[1, 5, 8]);
    Ok(())
}
