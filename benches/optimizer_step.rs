//! Optimizer-step benchmark on the 25.2M-parameter / 98-tensor set of the performance baselines
//! (8 transformer layers, d = 512, ffn = 2048, plus a final norm), measured side by side in one run:
//! fused AdamW (fp32; mixed: f16 gradients, fp32 master and state, f16 working copy; mixed with bf16
//! moments), SGD with momentum and LAMB (mixed, f32 and bf16 state) against `candle_nn::AdamW` and against the machine's streaming bandwidth measured by the
//! same binary.
//!
//! Run: `cargo bench --bench optimizer_step`
//!
//! Bytes counted: fp32 AdamW reads p, g, m, v and writes p, m, v: 28 B/param. Mixed reads an f16 g,
//! p, m, v and writes p, m, v and the f16 working copy: 2 + 12 + 12 + 2 = 28 B/param; with bf16 moments
//! 2 + 8 + 8 + 2 = 20 B/param. SGD with momentum (mixed f16) reads g, p, buf and writes p, buf and the
//! copy: 2 + 8 + 8 + 2 = 20 B/param with an f32 buffer, 16 with a bf16 one. LAMB (mixed f16) makes
//! two passes: g, p, m, v read and m, v written, then p, m, v read and p and the copy written: 40
//! B/param with f32 moments, 28 with bf16 ones. The bandwidth
//! reference is an in-place stream update `a = a + s * b` (two reads, one write back to a line just
//! read: 12 B/element, all of it real traffic, as in the optimizer; a triad into a third array would pay
//! an uncounted write-allocate).

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use amp::nn::Linear;
use amp::optim::{
    AdamConfig, FusedAdam, FusedLamb, FusedOptimizer, FusedSgd, LambConfig, ParamGroups, SgdConfig,
    StateDtype,
};
use amp::{AmpConfig, AmpModuleExt, OptLevel, Param, Precision};
use amp_kernels::timing::Interleaved;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;
use rayon::prelude::*;

struct Counting;
static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The 98 tensor shapes: per layer qkv (1536x512), out (512x512), ffn (2048x512, 512x2048) with biases
/// and two layer norms; then a final norm. 25,220,096 values.
fn shapes() -> Vec<Vec<usize>> {
    let mut shapes = Vec::new();
    for _ in 0..8 {
        for (rows, cols) in [(1536, 512), (512, 512), (2048, 512), (512, 2048)] {
            shapes.push(vec![rows, cols]);
            shapes.push(vec![rows]);
        }
        shapes.extend([vec![512], vec![512], vec![512], vec![512]]);
    }
    shapes.extend([vec![512], vec![512]]);
    shapes
}

/// Gradients of `sum(0.01 * w)` for every variable: 0.01 everywhere, in each variable's dtype.
fn grads_for(vars: &[Var]) -> candle_core::Result<GradStore> {
    let mut loss = Tensor::new(0f32, &Device::Cpu)?;
    for v in vars {
        loss = (loss + (v.as_tensor() * 0.01)?.to_dtype(DType::F32)?.sum_all()?)?;
    }
    loss.backward()
}

fn main() -> amp::Result<()> {
    let shapes = shapes();
    let n: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    assert_eq!((shapes.len(), n), (98, 25_220_096));
    println!(
        "parameter set: {n} values in {} tensors, {} rayon threads",
        shapes.len(),
        rayon::current_num_threads()
    );

    let make = || -> candle_core::Result<Vec<Var>> {
        shapes.iter().map(|s| Var::ones(s.as_slice(), DType::F32, &Device::Cpu)).collect()
    };
    // fp32: fused and candle-nn on separate copies.
    let fused_vars = make()?;
    let fused_grads = grads_for(&fused_vars)?;
    let mut fused = FusedAdam::new(ParamGroups::from_vars(fused_vars)?, AdamConfig::default())?;
    let candle_vars = make()?;
    let candle_grads = grads_for(&candle_vars)?;
    let mut candle = candle_nn::AdamW::new(candle_vars, candle_nn::ParamsAdamW::default())?;
    // Mixed: fp32 masters with f16 working copies, f16 gradients.
    let mut mixed_model: Vec<Linear> =
        make()?.into_iter().map(|v| Linear::new(Param::new(v), None)).collect();
    amp::initialize(&mut mixed_model, AmpConfig { opt_level: OptLevel::O2, half: Precision::Fp16 })?;
    let mixed_grads = grads_for(&mixed_model.trainable_vars())?;
    let mut mixed = FusedAdam::new(ParamGroups::from_model(&mixed_model)?, AdamConfig::default())?;
    // Mixed models of their own (each optimizer moves its masters), with their f16 gradients.
    let mixed_model = || -> amp::Result<(Vec<Linear>, GradStore)> {
        let mut model: Vec<Linear> = make()?.into_iter().map(|v| Linear::new(Param::new(v), None)).collect();
        amp::initialize(&mut model, AmpConfig { opt_level: OptLevel::O2, half: Precision::Fp16 })?;
        let grads = grads_for(&model.trainable_vars())?;
        Ok((model, grads))
    };
    // The same with bf16 moments.
    let (bf16_model, bf16_grads) = mixed_model()?;
    let bf16_state = AdamConfig { state_dtype: StateDtype::Bf16, ..AdamConfig::default() };
    let mut bf16 = FusedAdam::new(ParamGroups::from_model(&bf16_model)?, bf16_state)?;
    // SGD with momentum, the buffer in f32 and in bf16.
    let sgd = SgdConfig { momentum: 0.9, ..SgdConfig::default() };
    let (sgd_model, sgd_grads) = mixed_model()?;
    let mut sgd32 = FusedSgd::new(ParamGroups::from_model(&sgd_model)?, sgd)?;
    let (sgd16_model, sgd16_grads) = mixed_model()?;
    let sgd16_config = SgdConfig { state_dtype: StateDtype::Bf16, ..sgd };
    let mut sgd16 = FusedSgd::new(ParamGroups::from_model(&sgd16_model)?, sgd16_config)?;
    // LAMB, the moments in f32 and in bf16.
    let (lamb_model, lamb_grads) = mixed_model()?;
    let mut lamb32 = FusedLamb::new(ParamGroups::from_model(&lamb_model)?, LambConfig::default())?;
    let (lamb16_model, lamb16_grads) = mixed_model()?;
    let lamb16_config = LambConfig { state_dtype: StateDtype::Bf16, ..LambConfig::default() };
    let mut lamb16 = FusedLamb::new(ParamGroups::from_model(&lamb16_model)?, lamb16_config)?;
    // Stream update over as many elements as the parameters.
    let (mut a, b) = (vec![1f32; n], vec![2f32; n]);
    let triad = |a: &mut [f32]| {
        a.par_chunks_mut(1 << 16).zip(b.par_chunks(1 << 16)).for_each(|(a, b)| {
            for (a, b) in a.iter_mut().zip(b) {
                *a += 1e-3 * b;
            }
        })
    };

    // Interleaved rounds (amp_kernels::timing, the harness of the kernels' bench too): stream, fused,
    // mixed, mixed with bf16 moments, SGD and LAMB with f32 and bf16 state, and candle-nn's AdamW every
    // third round (it is 50x slower).
    let mut harness = Interleaved::new(9, 0);
    let mut allocations = (0, 0, 0);
    for round in 0..9 {
        let mut r = harness.round();
        r.time(|| triad(black_box(&mut a)));
        r.time(|| fused.step(&fused_grads))?;
        r.time(|| mixed.step_scaled(&mixed_grads, 1.0))?;
        r.time(|| bf16.step_scaled(&bf16_grads, 1.0))?;
        r.time(|| sgd32.step_scaled(&sgd_grads, 1.0))?;
        r.time(|| sgd16.step_scaled(&sgd16_grads, 1.0))?;
        r.time(|| lamb32.step_scaled(&lamb_grads, 1.0))?;
        r.time(|| lamb16.step_scaled(&lamb16_grads, 1.0))?;
        if round % 3 == 0 {
            r.time(|| candle.step(&candle_grads))?;
        } else {
            r.skip();
        }
        if round == 1 {
            ALLOCATIONS.store(0, Ordering::SeqCst);
            COUNTING.store(true, Ordering::SeqCst);
            fused.step(&fused_grads)?;
            COUNTING.store(false, Ordering::SeqCst);
            allocations.0 = ALLOCATIONS.swap(0, Ordering::SeqCst);
            COUNTING.store(true, Ordering::SeqCst);
            mixed.step(&mixed_grads)?;
            COUNTING.store(false, Ordering::SeqCst);
            allocations.1 = ALLOCATIONS.swap(0, Ordering::SeqCst);
            COUNTING.store(true, Ordering::SeqCst);
            bf16.step(&bf16_grads)?;
            COUNTING.store(false, Ordering::SeqCst);
            allocations.2 = ALLOCATIONS.load(Ordering::SeqCst);
        }
    }
    let [stream, fused_ms, mixed_ms, bf16_ms, sgd32_ms, sgd16_ms, lamb32_ms, lamb16_ms, candle_ms] =
        [0, 1, 2, 3, 4, 5, 6, 7, 8].map(|case| harness.median_s(case) * 1e3);
    let gbs = |bytes_per: f64, ms: f64| bytes_per * n as f64 / ms / 1e6;
    let bandwidth = gbs(12.0, stream);
    println!();
    println!("| work | median ms | GB/s | of stream bandwidth | vs candle-nn AdamW | allocations/step |");
    println!("|---|---|---|---|---|---|");
    println!("| stream update a += s*b (12 B/elem) | {stream:.2} | {bandwidth:.1} | 100% | | |");
    for (name, bytes, ms, allocs) in [
        ("fused AdamW fp32 (28 B/param)", 28.0, fused_ms, Some(allocations.0)),
        ("fused AdamW mixed f16 (28 B/param)", 28.0, mixed_ms, Some(allocations.1)),
        ("fused AdamW mixed f16, bf16 moments (20 B/param)", 20.0, bf16_ms, Some(allocations.2)),
    ] {
        let rate = gbs(bytes, ms);
        let allocs = allocs.map_or(String::new(), |a| a.to_string());
        println!(
            "| {name} | {ms:.2} | {rate:.1} | {:.0}% | {:.1}x faster | {allocs} |",
            100.0 * rate / bandwidth,
            candle_ms / ms
        );
    }
    println!(
        "| candle_nn::AdamW fp32 | {candle_ms:.2} | {:.1} | {:.0}% | 1.0x | |",
        gbs(28.0, candle_ms),
        100.0 * gbs(28.0, candle_ms) / bandwidth
    );
    println!();
    println!(
        "bf16 moments: optimizer state {:.0} MB against {:.0} MB (f32 moments), step {:.2}x the time of the mixed \
         step with f32 moments",
        bf16.state_bytes() as f64 / 1e6,
        mixed.state_bytes() as f64 / 1e6,
        bf16_ms / mixed_ms
    );
    println!(
        "SGD momentum 0.9, mixed f16: f32 buffer {sgd32_ms:.2} ms (20 B/param, {:.1} GB/s), bf16 buffer \
         {sgd16_ms:.2} ms (16 B/param, {:.1} GB/s): {:.2}x the time, state {:.0} MB against {:.0} MB",
        gbs(20.0, sgd32_ms),
        gbs(16.0, sgd16_ms),
        sgd16_ms / sgd32_ms,
        sgd16.state_bytes() as f64 / 1e6,
        sgd32.state_bytes() as f64 / 1e6
    );
    println!(
        "LAMB, mixed f16: f32 moments {lamb32_ms:.2} ms (40 B/param, {:.1} GB/s), bf16 moments \
         {lamb16_ms:.2} ms (28 B/param, {:.1} GB/s): {:.2}x the time, state {:.0} MB against {:.0} MB",
        gbs(40.0, lamb32_ms),
        gbs(28.0, lamb16_ms),
        lamb16_ms / lamb32_ms,
        lamb16.state_bytes() as f64 / 1e6,
        lamb32.state_bytes() as f64 / 1e6
    );
    Ok(())
}
