//! ReLU in one pass forward and one pass backward, on its own or as the epilogue of a Linear.
//!
//! candle's `Tensor::relu` backward is a chain of five tensor ops (a zero tensor, a comparison, a cast
//! of the mask, a product, and the sum into a fresh zero gradient), each a pass over memory into a fresh
//! buffer. Measured on the MLP bench (`cargo bench --bench mlp_step`: three ReLUs over 256 x 1024
//! activations), candle's ReLU with its backward took 2.5 ms of a 13.7 ms bf16 step (the step without
//! any ReLU: 11.2 ms); fused into the layers (`Linear::forward_relu`), 12.0 ms. Here the forward
//! clamps in place and the backward masks the gradient by the output in one pass
//! ([`amp_kernels::relu`]): PyTorch's convention, slope 0 at 0, a NaN kept in the forward.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::elementwise::{elements, new_storage, part};

/// `max(x, 0)` in `x`'s dtype (a NaN stays NaN), differentiable: the gradient passes where the output
/// is positive (slope 0 at 0, as in PyTorch).
///
/// On the CPU, for f32, f16 and bf16, one pass forward and one backward. Elsewhere (CUDA, f64) this is
/// `x.relu()`, whose gradient at 0 is candle's (1).
///
/// ```
/// use amp_runtime::ops;
/// use candle_core::{Device, Tensor};
///
/// let x = Tensor::new(&[-1.5f32, 0.0, 2.0], &Device::Cpu)?;
/// assert_eq!(ops::relu(&x)?.to_vec1::<f32>()?, [0.0, 0.0, 2.0]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn relu(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::F32 | DType::F16 | DType::BF16 if x.device().is_cpu() => x.contiguous()?.apply_op1(Relu),
        _ => x.relu(),
    }
}

/// The gradient of a ReLU's input from its output `y` and the output's gradient `dy`, in `dy`'s dtype
/// (for ops whose forward ends in a ReLU).
pub(crate) fn relu_backward(y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    y.contiguous()?.apply_op2(&dy.contiguous()?, ReluBackward)
}

/// `y = relu(x)` in place on a fresh product's storage.
pub(crate) fn relu_in_place(storage: &mut CpuStorage) -> Result<()> {
    let y: amp_kernels::GradSliceMut<'_> = match storage {
        CpuStorage::F32(v) => v.as_mut_slice().into(),
        CpuStorage::F16(v) => v.as_mut_slice().into(),
        CpuStorage::BF16(v) => v.as_mut_slice().into(),
        other => {
            let dtype = candle_core::backend::BackendStorage::dtype(&*other);
            return Err(candle_core::Error::UnsupportedDTypeForOp(dtype, "amp relu"));
        }
    };
    amp_kernels::relu::forward_in_place(y);
    Ok(())
}

struct Relu;

impl CustomOp1 for Relu {
    fn name(&self) -> &'static str {
        "amp-relu"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = elements(storage, layout)?;
        let y = new_storage(x.dtype(), x.len(), |at, y| amp_kernels::relu::forward(part(x, at, y.len()), y));
        Ok((y, layout.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(relu_backward(y, dy)?))
    }
}

/// `dx = y > 0 ? dy : 0`, in `dy`'s dtype.
struct ReluBackward;

impl CustomOp2 for ReluBackward {
    fn name(&self) -> &'static str {
        "amp-relu-backward"
    }

    fn cpu_fwd(
        &self,
        ys: &CpuStorage,
        yl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (y, dy) = (elements(ys, yl)?, elements(gs, gl)?);
        if y.len() != dy.len() {
            return Err(candle_core::Error::ShapeMismatchBinaryOp {
                lhs: yl.shape().clone(),
                rhs: gl.shape().clone(),
                op: "amp-relu-backward",
            });
        }
        let dx = new_storage(dy.dtype(), dy.len(), |at, dx| {
            let n = dx.len();
            amp_kernels::relu::backward(part(y, at, n), part(dy, at, n), dx)
        });
        Ok((dx, gl.shape().clone()))
    }
}
