//! GELU (tanh approximation) in one pass forward and one pass backward, computed in f32 for every
//! float dtype.
//!
//! candle's `Tensor::gelu` computes the same function, but its backward is a chain of tensor ops
//! (a power, a tanh, several products and sums), each a pass over memory into a fresh buffer, in the
//! tensor's own dtype. Measured with `perf` on the main job's bf16 step, that chain (with its `powf`,
//! `tanhf` and page faults) took about a quarter of the step. Here the forward writes
//! `0.5 x (1 + tanh(u))` with `u = sqrt(2/pi) (x + 0.044715 x^3)`, and the backward writes
//! `dx = dy (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2))` with `t = tanh(u)`: one
//! read of `x` (and `dy`), one write, the arithmetic in f32 and the result rounded once to the dtype
//! ([`amp_kernels::gelu`], vectorised for the widest extension the CPU has).

use amp_kernels::Dtype;
use candle_core::{CpuStorage, DType, Layout, Result, Tensor};

use super::activation::Activation;
use super::elementwise::{elements, elements_mut, new_storage, part};

/// GELU with the tanh approximation (the function of `Tensor::gelu` and of GPT-2 / BERT), `x`'s dtype.
///
/// On the CPU, for f32, f16 and bf16, one pass forward and one backward, computed in f32 and rounded
/// once. Elsewhere (CUDA, f64) this is `x.gelu()`.
///
/// ```
/// use amp_runtime::ops;
/// use candle_core::{Device, Tensor};
///
/// let x = Tensor::new(&[-1.0f32, 0.0, 2.0], &Device::Cpu)?;
/// let y = ops::gelu(&x)?.to_vec1::<f32>()?;
/// assert!((y[0] + 0.158_808).abs() < 1e-6 && y[1] == 0.0 && (y[2] - 1.954_598).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::F32 | DType::F16 | DType::BF16 if x.device().is_cpu() => GELU.apply(x),
        _ => x.gelu(),
    }
}

/// `gelu(x)` of a whole contiguous storage (a fresh product), in a new storage of its dtype.
pub(super) fn gelu_of(x: &CpuStorage, len: usize) -> Result<CpuStorage> {
    let x = elements(x, &Layout::contiguous(len))?;
    Ok(new_storage(x.dtype(), x.len(), |at, y| amp_kernels::gelu::forward(part(x, at, y.len()), y)))
}

/// `dy * gelu'(x)` in `x`'s dtype, for a whole contiguous storage `x` and `dy` of its length.
pub(super) fn gelu_gradient(x: &CpuStorage, dy: &CpuStorage, dy_layout: &Layout) -> Result<CpuStorage> {
    let dy = elements(dy, dy_layout)?;
    let x = elements(x, &Layout::contiguous(dy.len()))?;
    Ok(new_storage(x.dtype(), x.len(), |at, dx| {
        let n = dx.len();
        amp_kernels::gelu::backward(part(x, at, n), part(dy, at, n), dx)
    }))
}

/// `dy * gelu'(x)` for a whole contiguous storage `x`, a `(rows, cols)` matrix, and `dy` of its size,
/// rounded once to `dtype`, with the f32 sums of the columns of the f32 values (before that rounding),
/// taken as [`super::column_sums`] takes them: a Linear's product's gradient through GELU and the
/// Linear's bias gradient.
pub(super) fn gelu_gradient_with_column_sums(
    x: &CpuStorage,
    dy: &CpuStorage,
    dy_layout: &Layout,
    dtype: Dtype,
    cols: usize,
) -> Result<(CpuStorage, Vec<f32>)> {
    let dy = elements(dy, dy_layout)?;
    let x = elements(x, &Layout::contiguous(dy.len()))?;
    let mut dx = new_storage(dtype, x.len(), |_, _| {});
    let mut sums = vec![0f32; cols];
    amp_kernels::gelu::backward_with_column_sums(x, dy, elements_mut(&mut dx, x.len())?, cols, &mut sums);
    Ok((dx, sums))
}

/// GELU's kernels as one op each way.
const GELU: Activation = Activation {
    forward_name: "amp-gelu",
    backward_name: "amp-gelu-backward",
    forward: amp_kernels::gelu::forward,
    backward: amp_kernels::gelu::backward,
};

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::ops::activation::checks;

    /// The function and its derivative in f64.
    fn reference(x: f64) -> (f64, f64) {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let t = (c * (x + 0.044715 * x * x * x)).tanh();
        (0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x))
    }

    fn inputs() -> Vec<f32> {
        // -12..12 in steps of 1/1024, plus values where tanh saturates and zero: 24,582 elements, the
        // outputs written in three whole blocks and a part of one (`new_storage`).
        (-12_288..=12_288).map(|i| i as f32 / 1024.0).chain([-40.0, -1e-3, 1e-3, 40.0, 0.0]).collect()
    }

    #[test]
    fn f32_value_and_gradient_are_within_a_few_ulps_of_the_f64_reference() -> Result<()> {
        let xs = inputs();
        let x = Var::new(xs.as_slice(), &Device::Cpu)?;
        let y = gelu(x.as_tensor())?;
        let grads = y.sum_all()?.backward()?;
        let (y, dx) = (y.to_vec1::<f32>()?, grads.get(&x).expect("a gradient").to_vec1::<f32>()?);
        for ((&x, &y), &dx) in xs.iter().zip(&y).zip(&dx) {
            let (want_y, want_dx) = reference(f64::from(x));
            // tanh in f32 (a few ulps) times terms of magnitude up to |x|, plus cancellation in 1 + t
            // for negative x: an absolute error of a few f32 ulps of max(1, |x|).
            let tolerance = 8.0 * f64::from(f32::EPSILON) * f64::from(x.abs()).max(1.0);
            assert!((f64::from(y) - want_y).abs() <= tolerance, "gelu({x}) = {y}, reference {want_y}");
            assert!((f64::from(dx) - want_dx).abs() <= tolerance, "gelu'({x}) = {dx}, reference {want_dx}");
        }
        Ok(())
    }

    #[test]
    fn half_inputs_are_computed_in_f32_and_rounded_once() -> Result<()> {
        checks::half_inputs_are_rounded_once(gelu, amp_kernels::gelu::value_and_slope, &inputs())
    }

    #[test]
    fn agrees_with_candles_gelu_and_its_backward() -> Result<()> {
        checks::agrees_with_candle(gelu, |x| x.gelu(), &inputs())
    }

    #[test]
    fn a_strided_input_is_read_in_its_logical_order() -> Result<()> {
        let x = Tensor::arange(0f32, 12.0, &Device::Cpu)?.affine(0.25, -1.5)?.reshape((3, 4))?.t()?;
        let want = x.contiguous()?.gelu()?.to_vec2::<f32>()?;
        let got = gelu(&x)?.to_vec2::<f32>()?;
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            assert!((g - w).abs() <= 1e-6, "{g} vs {w}");
        }
        Ok(())
    }
}
