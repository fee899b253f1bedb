//! Helpers shared by the integration tests.
#![allow(dead_code)]

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
