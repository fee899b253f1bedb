//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod conv;

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A tensor of normally distributed values (Box-Muller over a seeded generator), `scale` times N(0, 1).
pub fn randn(rng: &mut StdRng, shape: &[usize], scale: f32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n)
        .map(|_| {
            let u1: f32 = rng.random_range(f32::EPSILON..1.0);
            let u2: f32 = rng.random_range(0.0..1.0);
            scale * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
        })
        .collect();
    Tensor::from_vec(values, shape, &Device::Cpu)
}

/// Named random weights for a `VarBuilder::from_tensors`.
pub fn random_weights(seed: u64, shapes: &[(&str, &[usize], f32)]) -> Result<HashMap<String, Tensor>> {
    let mut rng = StdRng::seed_from_u64(seed);
    shapes
        .iter()
        .map(|(name, shape, scale)| Ok((name.to_string(), randn(&mut rng, shape, *scale)?)))
        .collect()
}

/// `||a - b|| / ||b||` over all elements, in f64.
pub fn relative_error(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_dtype(DType::F64)?.flatten_all()?;
    let b = b.to_dtype(DType::F64)?.flatten_all()?;
    let diff = (&a - &b)?.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    let norm = b.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    Ok(diff / norm.max(f64::MIN_POSITIVE))
}

/// Unit roundoff `u = 2^-(mantissa bits + 1)` of a float dtype: the largest relative error of one
/// rounding to it (round to nearest). f16: 2^-11, bf16: 2^-8, f32: 2^-24.
pub fn unit_roundoff(dtype: DType) -> f64 {
    let mantissa = match dtype {
        DType::F16 => 10,
        DType::BF16 => 7,
        DType::F32 => 23,
        DType::F64 => 52,
        other => panic!("{other:?} is not a float dtype"),
    };
    2f64.powi(-(mantissa + 1))
}

/// A normwise relative tolerance derived from the format: `roundings` roundings to `dtype` on the path,
/// each contributing at most `u` to first order, times `safety`; plus `256 u_f32` for the f32 arithmetic
/// on the path (sums over up to a few hundred terms, each with relative error at most `n u_f32`).
pub fn tolerance(dtype: DType, roundings: usize, safety: f64) -> f64 {
    safety * roundings as f64 * unit_roundoff(dtype) + 256.0 * unit_roundoff(DType::F32)
}

/// Asserts `relative_error(got, want) <= tolerance` (and finite), prints the measured error, returns it.
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, tolerance: f64) -> Result<f64> {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes differ");
    let err = relative_error(got, want)?;
    eprintln!("{what}: relative error {err:.3e} (tolerance {tolerance:.3e})");
    assert!(
        err.is_finite() && err <= tolerance,
        "{what}: relative error {err:.3e} > tolerance {tolerance:.3e}"
    );
    Ok(err)
}

/// True when every element is finite.
pub fn all_finite(t: &Tensor) -> Result<bool> {
    let values = t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    Ok(values.iter().all(|v| v.is_finite()))
}

/// A seeded random tensor, `scale` times N(0, 1), rounded to `dtype` (so that references in f64 can use
/// exactly the values the half computation sees).
pub fn randn_in(seed: u64, shape: &[usize], scale: f32, dtype: DType) -> Result<Tensor> {
    randn(&mut StdRng::seed_from_u64(seed), shape, scale)?.to_dtype(dtype)
}

/// A seeded tensor of values uniform in `[lo, hi)`, rounded to `dtype`.
pub fn uniform_in(seed: u64, shape: &[usize], lo: f32, hi: f32, dtype: DType) -> Result<Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|_| rng.random_range(lo..hi)).collect();
    Tensor::from_vec(values, shape, &Device::Cpu)?.to_dtype(dtype)
}

/// `(y, dL/dx)` for `L = sum(f(x) * r)`, with `x` made a variable and `r` a fixed random tensor (seed 99)
/// of `y`'s shape, in `y`'s dtype: f32 values, so an f64 reference sees exactly the same `r`.
pub fn value_and_grad(f: impl Fn(&Tensor) -> Result<Tensor>, x: &Tensor) -> Result<(Tensor, Tensor)> {
    let var = candle_core::Var::from_tensor(x)?;
    let y = f(var.as_tensor())?;
    let r = randn_in(99, y.dims(), 1.0, DType::F32)?.to_dtype(y.dtype())?;
    let grads = (&y * r)?.sum_all()?.backward()?;
    let grad = grads.get(var.as_tensor()).cloned();
    Ok((y, grad.ok_or_else(|| candle_core::Error::Msg("the input received no gradient".into()))?))
}

/// `(y, [dL/d input_i])` for `L = sum(f(inputs) * r)`, with every input made a variable (pass them on to
/// layers through `Param::from_tensor`, which shares the variable) and `r` as in [`value_and_grad`].
pub fn value_and_grads(
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
) -> Result<(Tensor, Vec<Tensor>)> {
    let vars = inputs.iter().map(candle_core::Var::from_tensor).collect::<Result<Vec<_>>>()?;
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&tensors)?;
    let r = randn_in(99, y.dims(), 1.0, DType::F32)?.to_dtype(y.dtype())?;
    let grads = (&y * r)?.sum_all()?.backward()?;
    let missing = |i: usize| candle_core::Error::Msg(format!("input {i} received no gradient"));
    let grads = tensors.iter().enumerate().map(|(i, t)| grads.get(t).cloned().ok_or_else(|| missing(i)));
    Ok((y, grads.collect::<Result<Vec<_>>>()?))
}
