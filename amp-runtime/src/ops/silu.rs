//! SiLU (swish), `x sigmoid(x)`, the activation of Llama's and Mistral's SwiGLU blocks, in one pass
//! forward and one pass backward, computed in f32 for every float dtype.
//!
//! candle's `Tensor::silu` computes the same function, but its backward is a chain of tensor ops (a
//! negation, an exponential, a sum, a reciprocal, products), each a pass over memory into a fresh
//! buffer and, for half tensors, each rounded to the half dtype. Here the backward writes
//! `dx = dy (s + x s (1 - s))` with `s = sigmoid(x)` in one pass, in f32, rounded once
//! ([`amp_kernels::silu`]).

use candle_core::{DType, Result, Tensor};

use super::activation::Activation;

/// SiLU, `x / (1 + e^-x)` (the function of `Tensor::silu` and `candle_nn::ops::silu`), `x`'s dtype.
///
/// On the CPU, for f32, f16 and bf16, one pass forward and one backward, computed in f32 and rounded
/// once. Elsewhere (CUDA, f64) this is `x.silu()`.
///
/// ```
/// use amp_runtime::ops;
/// use candle_core::{Device, Tensor};
///
/// let x = Tensor::new(&[-1.0f32, 0.0, 2.0], &Device::Cpu)?;
/// let y = ops::silu(&x)?.to_vec1::<f32>()?;
/// assert!((y[0] + 0.268_941).abs() < 1e-6 && y[1] == 0.0 && (y[2] - 1.761_594).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn silu(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::F32 | DType::F16 | DType::BF16 if x.device().is_cpu() => SILU.apply(x),
        _ => x.silu(),
    }
}

/// SiLU's kernels as one op each way.
const SILU: Activation = Activation {
    forward_name: "amp-silu",
    backward_name: "amp-silu-backward",
    forward: amp_kernels::silu::forward,
    backward: amp_kernels::silu::backward,
};

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::ops::activation::checks;

    fn inputs() -> Vec<f32> {
        // -20..20 in steps of 1/1024, and values past the exponential's underflow: 40,966 elements.
        (-20_480..=20_480).map(|i| i as f32 / 1024.0).chain([-100.0, -1e-3, 1e-3, 100.0, 0.0]).collect()
    }

    #[test]
    fn f32_value_and_gradient_are_within_a_few_ulps_of_the_f64_reference() -> Result<()> {
        let xs = inputs();
        let x = Var::new(xs.as_slice(), &Device::Cpu)?;
        let y = silu(x.as_tensor())?;
        let grads = y.sum_all()?.backward()?;
        let (y, dx) = (y.to_vec1::<f32>()?, grads.get(&x).expect("a gradient").to_vec1::<f32>()?);
        for ((&x, &y), &dx) in xs.iter().zip(&y).zip(&dx) {
            let x64 = f64::from(x);
            let s = 1.0 / (1.0 + (-x64).exp());
            let (want_y, want_dx) = (x64 * s, s + x64 * s * (1.0 - s));
            let tolerance = 8.0 * f64::from(f32::EPSILON) * x64.abs().max(1.0);
            assert!((f64::from(y) - want_y).abs() <= tolerance, "silu({x}) = {y}, reference {want_y}");
            assert!((f64::from(dx) - want_dx).abs() <= tolerance, "silu'({x}) = {dx}, reference {want_dx}");
        }
        Ok(())
    }

    /// Half inputs: the f32 function of the exact input, rounded once (value and gradient), where
    /// candle's backward rounds each of its steps to the half dtype.
    #[test]
    fn half_inputs_are_computed_in_f32_and_rounded_once() -> Result<()> {
        checks::half_inputs_are_rounded_once(silu, amp_kernels::silu::value_and_slope, &inputs())
    }

    /// In bf16 candle's backward rounds each of its steps (exponential, sum, reciprocal, products) to
    /// bf16; amp's rounds once.
    #[test]
    fn a_bf16_gradient_is_closer_to_f64_than_candles() -> Result<()> {
        let xs: Vec<f32> = (-4096..4096).map(|i| i as f32 / 512.0).collect();
        let x = Var::from_tensor(&Tensor::new(xs.as_slice(), &Device::Cpu)?.to_dtype(DType::BF16)?)?;
        let exact: Vec<f64> = x
            .as_tensor()
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?
            .iter()
            .map(|&x| {
                let s = 1.0 / (1.0 + (-x).exp());
                s + x * s * (1.0 - s)
            })
            .collect();
        let error = |y: Tensor| -> Result<f64> {
            let grads = y.sum_all()?.backward()?;
            let dx = grads.get(&x).expect("a gradient").to_dtype(DType::F64)?.to_vec1::<f64>()?;
            let diff: f64 = dx.iter().zip(&exact).map(|(a, b)| (a - b).powi(2)).sum();
            Ok((diff / exact.iter().map(|b| b * b).sum::<f64>()).sqrt())
        };
        let (ours, theirs) = (error(silu(x.as_tensor())?)?, error(x.as_tensor().silu()?)?);
        eprintln!("bf16 silu gradient: relative error amp {ours:.3e}, candle {theirs:.3e}");
        // One bf16 rounding: at most 2^-8 relative, about 2^-8 / sqrt(3) normwise.
        assert!(ours < 2f64.powi(-8), "amp {ours:e}");
        assert!(ours < 0.75 * theirs, "amp {ours:e}, candle {theirs:e}");
        Ok(())
    }

    #[test]
    fn agrees_with_candles_silu_and_its_backward() -> Result<()> {
        checks::agrees_with_candle(silu, |x| x.silu(), &inputs())
    }
}
