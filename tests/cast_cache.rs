//! Under O1 a weight used twice in one step is cast once while a `CastCache` is alive, with the same
//! forward result as without the cache. The gradient differs by rounding only: with one shared cast
//! node, backward sums the two uses' contributions in bf16 before widening to f32 (as PyTorch's
//! autocast cache does); without the cache each is widened first and summed in f32. One extra bf16
//! rounding of the sum bounds the difference by u = 2^-8 relative per element, 2^-7 normwise with margin.
//!
//! The products here run on candle's kernel, as they do on CUDA: amp's CPU GEMM casts nothing (it
//! rounds a weight while packing it), so there it leaves the cache nothing to serve.

mod common;

use amp::dispatch::{self, Override};
use amp::nn::{linear, Linear};
use amp::{AmpConfig, AmpModule, AmpModuleExt, CastCache, OptLevel};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};

#[derive(AmpModule)]
struct Shared {
    fc: Linear,
}

impl Module for Shared {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // The same layer applied twice: its weight and bias are cast twice per step without the cache.
        self.fc.forward(&self.fc.forward(x)?.tanh()?)
    }
}

fn loss_and_grad(model: &Shared, x: &Tensor) -> candle_core::Result<(f32, Vec<f32>)> {
    let loss = model.forward(x)?.sqr()?.sum_all()?;
    let grads = loss.backward()?;
    let weight = model.fc.weight().trainable();
    let grad = grads.get(weight.as_tensor()).expect("the weight has a gradient");
    Ok((loss.to_scalar()?, grad.flatten_all()?.to_vec1()?))
}

#[test]
fn a_reused_weight_is_cast_once_per_step() -> amp::Result<()> {
    dispatch::set_override(Override::Candle)?; // every test of this file
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut model = Shared { fc: linear(8, 8, vb.pp("fc"))? };
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O1, &Device::Cpu))?;
    let x = Tensor::ones((4, 8), DType::F32, &Device::Cpu)?;

    let uncached = loss_and_grad(&model, &x)?;
    let cache = CastCache::enter();
    let cached = loss_and_grad(&model, &x)?;
    assert_eq!(
        cache.hits(),
        1,
        "the weight is served from the cache on its second use (the bias is added in f32: no cast)"
    );
    drop(cache);
    assert_eq!(cached.0, uncached.0, "forward is identical");
    let (a, b) =
        (Tensor::new(cached.1.as_slice(), &Device::Cpu)?, Tensor::new(uncached.1.as_slice(), &Device::Cpu)?);
    let err = common::relative_error(&a, &b)?;
    assert!(err < 2f64.powi(-7), "gradient differs by {err:.2e}");

    // Dropping the guard forgets the casts: a changed weight is seen by the next step.
    model.fc.weight().master().set(&model.fc.weight().master().as_tensor().zeros_like()?)?;
    let after = loss_and_grad(&model, &x)?;
    assert_ne!(after.0, uncached.0);
    assert_eq!(model.precision_plan().rows[0].compute, amp::Precision::Bf16);
    Ok(())
}

#[test]
fn a_nested_guard_shares_the_outer_cache_and_dropping_it_keeps_the_cache() -> amp::Result<()> {
    dispatch::set_override(Override::Candle)?; // every test of this file
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut model = Shared { fc: linear(8, 8, vb.pp("fc"))? };
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O1, &Device::Cpu))?;
    let x = Tensor::ones((4, 8), DType::F32, &Device::Cpu)?;

    let outer = CastCache::enter();
    model.forward(&x)?;
    assert_eq!(outer.hits(), 1);
    {
        let inner = CastCache::enter();
        model.forward(&x)?;
        assert_eq!(inner.hits(), 3, "the inner guard sees the outer cache: both uses are hits");
    }
    model.forward(&x)?;
    assert_eq!(outer.hits(), 5, "dropping the inner guard kept the outer cache and its casts");
    drop(outer);
    let fresh = CastCache::enter();
    assert_eq!(fresh.hits(), 0, "the outermost guard's drop ended the cache");
    model.forward(&x)?;
    assert_eq!(fresh.hits(), 1, "the casts of the ended cache are gone: the first use casts again");
    Ok(())
}

/// Trains a fresh `Shared` model for `steps` steps with a cache per step, checking the hits each step;
/// returns the final weight's bits.
fn train_with_cache(seed: u64, steps: usize) -> amp::Result<Vec<u32>> {
    use amp::optim::{AdamConfig, FusedAdamW, FusedOptimizer, ParamGroups};
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut model = Shared { fc: linear(8, 8, vb.pp("fc"))? };
    // Seeded weights and bias: the runs are comparable bit for bit.
    for (i, (_, param)) in model.named_params().into_iter().enumerate() {
        let dims = param.master().dims().to_vec();
        param.master().set(&common::uniform_in(10 * seed + i as u64, &dims, -0.5, 0.5, DType::F32)?)?;
    }
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O1, &Device::Cpu))?;
    let mut adam = FusedAdamW::new(ParamGroups::from_model(&model)?, AdamConfig::default())?;
    for step in 0..steps {
        let x = common::uniform_in(1000 + step as u64, &[4, 8], -1.0, 1.0, DType::F32)?;
        let cache = CastCache::enter();
        let grads = model.forward(&x)?.sqr()?.sum_all()?.backward()?;
        assert_eq!(cache.hits(), 1, "step {step}: this thread's cache served this thread's second use");
        drop(cache);
        adam.step(&grads)?;
    }
    let bits = model.fc.weight().master().as_tensor().flatten_all()?.to_vec1::<f32>()?;
    Ok(bits.iter().map(|v| v.to_bits()).collect())
}

#[test]
fn two_threads_train_two_models_at_once_each_with_its_own_cache() -> amp::Result<()> {
    dispatch::set_override(Override::Candle)?; // every test of this file
    let alone = [train_with_cache(1, 30)?, train_with_cache(2, 30)?];
    let barrier = std::sync::Barrier::new(2);
    let together = std::thread::scope(|scope| {
        let handles: Vec<_> = [1, 2]
            .map(|seed| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    train_with_cache(seed, 30)
                })
            })
            .into_iter()
            .collect();
        handles.into_iter().map(|h| h.join().expect("no panic")).collect::<amp::Result<Vec<_>>>()
    })?;
    assert_eq!(together, alone, "concurrent runs equal the runs alone, bit for bit");
    assert_ne!(alone[0], alone[1]);
    Ok(())
}
