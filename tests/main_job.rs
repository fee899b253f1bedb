//! A fast version of the main job (`examples/train/main.rs`): a small decoder-only transformer learns a
//! generated Markov source from the same initial weights, data order and hyper-parameters in fp32 (O0),
//! bf16 (O2) and fp16 (O2 with dynamic loss scaling), and the mixed runs land where fp32 does; so does
//! bf16 O2 with the optimizer's moments in bf16 as well (`StateDtype::Bf16`).

use std::collections::HashMap;

#[path = "../examples/train/gpt.rs"]
mod gpt;
#[path = "../examples/train/markov.rs"]
#[allow(dead_code)] // the main job's constants and accessors this test does not use
mod markov;

use amp::optim::{AdamConfig, FusedAdamW, ParamGroups, StateDtype};
use amp::scaler::ScalerConfig;
use amp::{AmpConfig, GradScaler, OptLevel, Precision};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use gpt::{Gpt, GptShape};
use markov::{split, Markov};
use rand::rngs::StdRng;
use rand::SeedableRng;

const VOCAB: usize = 16;
const EMBED: usize = 32;
const SEQ: usize = 16;
const BATCH: usize = 16;
const STEPS: usize = 150;
const TAIL: usize = 15;

/// One block, two heads: the main job's model, smaller.
const SHAPE: GptShape = GptShape { vocab: VOCAB, embed: EMBED, heads: 2, layers: 1, seq: SEQ };

/// `STEPS` batches of `BATCH` sequences drawn from `source`, the draw fixed by `seed`.
fn batches(source: &Markov, seed: u64) -> candle_core::Result<Vec<(Tensor, Tensor)>> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..STEPS).map(|_| split(source.sequences(BATCH, SEQ, &mut rng), BATCH, SEQ, &Device::Cpu)).collect()
}

/// Trains from `weights` on `data`; the mean training loss of the last `TAIL` steps and the skip count.
fn train(
    weights: &HashMap<String, Tensor>,
    config: AmpConfig,
    state_dtype: StateDtype,
    data: &[(Tensor, Tensor)],
) -> amp::Result<(f32, u64)> {
    let mut model = Gpt::new(SHAPE, VarBuilder::from_tensors(weights.clone(), DType::F32, &Device::Cpu))?;
    amp::initialize(&mut model, config)?;
    let adam = AdamConfig { lr: 1e-2, weight_decay: 0.01, state_dtype, ..AdamConfig::default() };
    let mut optimizer = FusedAdamW::new(ParamGroups::from_model(&model)?, adam)?;
    let mut scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
    assert_eq!(scaler.is_enabled(), config.opt_level != OptLevel::O0 && config.half == Precision::Fp16);
    let mut losses = Vec::new();
    for (ids, targets) in data {
        let loss = amp::ops::loss::cross_entropy(&model.logits(ids)?, targets)?;
        scaler.step_fused(&loss, &mut optimizer, Some(1.0))?;
        losses.push(loss.to_dtype(DType::F32)?.to_scalar::<f32>()?);
    }
    Ok((losses[STEPS - TAIL..].iter().sum::<f32>() / TAIL as f32, scaler.state().skipped))
}

#[test]
fn bf16_and_fp16_land_where_fp32_does() -> amp::Result<()> {
    let source = Markov::with_size(7, VOCAB, 2);
    let floor = source.entropy_rate();
    let weights = Gpt::initial_weights(SHAPE, 5, &Device::Cpu)?;
    let data = batches(&source, 1)?;
    let fp32 = AmpConfig { opt_level: OptLevel::O0, half: Precision::Bf16 };
    let (reference, _) = train(&weights, fp32, StateDtype::F32, &data)?;
    // The same fp32 run on another draw of the data: how much the final loss moves for reasons that
    // have nothing to do with precision (measured: 0.8802 vs 0.8453, about 4%).
    let (other_order, _) = train(&weights, fp32, StateDtype::F32, &batches(&source, 2)?)?;
    let noise = (other_order - reference).abs();

    let initial = (VOCAB as f32).ln();
    let floor = floor as f32;
    println!(
        "floor {floor:.4}, ln V {initial:.4}, fp32 {reference:.4}, fp32 other data order {other_order:.4}"
    );
    for run in [reference, other_order] {
        assert!(run < 0.6 * initial && run - floor < 0.35, "fp32 did not learn: {run} (floor {floor})");
    }
    let runs = [
        (Precision::Bf16, StateDtype::F32),
        (Precision::Fp16, StateDtype::F32),
        (Precision::Bf16, StateDtype::Bf16),
    ];
    for (half, state_dtype) in runs {
        let config = AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(half);
        let (last, skipped) = train(&weights, config, state_dtype, &data)?;
        let half = format!("{half} ({state_dtype:?} optimizer state)");
        println!("{half} O2: {last:.4} ({skipped} skipped steps)");
        assert!(last < 0.6 * initial, "{half} O2 did not learn: {last}");
        // 5% relative: far above the precision effect seen here (under 0.1%), above the data-order
        // noise of fp32 itself, yet far below the distance between a trained and an untrained model.
        let gap = (last - reference).abs();
        assert!(
            gap <= 0.05 * reference,
            "{half} O2 final loss {last} is more than 5% from fp32's {reference} (data-order noise {noise})"
        );
        assert!(skipped <= 10, "{half} O2 skipped {skipped} of {STEPS} steps");
    }
    Ok(())
}
