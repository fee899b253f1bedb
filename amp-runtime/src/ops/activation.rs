//! An elementwise activation as one candle op each way on the CPU: the forward pass writes `f(x)` and
//! the backward `dy * f'(x)`, each one read of its inputs and one write, computed in f32 and rounded
//! once to the dtype (the kernels' elementwise driver). GELU and SiLU are such ops.

use amp_kernels::{GradSlice, GradSliceMut};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

use super::elementwise::{elements, new_storage, part};

/// An activation's kernels and the names of its ops.
#[derive(Clone, Copy)]
pub(super) struct Activation {
    /// The names of the forward and the backward op.
    pub forward_name: &'static str,
    pub backward_name: &'static str,
    /// `y = f(x)`, `y` of any dtype.
    pub forward: fn(GradSlice<'_>, GradSliceMut<'_>),
    /// `dx = dy * f'(x)`, `dx` in `x`'s dtype.
    pub backward: fn(GradSlice<'_>, GradSlice<'_>, GradSliceMut<'_>),
}

impl Activation {
    /// `f(x)`, in `x`'s dtype (f32, f16 or bf16 on the CPU), differentiable.
    pub(super) fn apply(self, x: &Tensor) -> Result<Tensor> {
        x.contiguous()?.apply_op1(self)
    }
}

impl CustomOp1 for Activation {
    fn name(&self) -> &'static str {
        self.forward_name
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = elements(storage, layout)?;
        let y = new_storage(x.dtype(), x.len(), |at, y| (self.forward)(part(x, at, y.len()), y));
        Ok((y, layout.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(x.apply_op2(&dy.contiguous()?, Backward(*self))?))
    }
}

/// `dx = dy * f'(x)` in `x`'s dtype, from `x` and `dy` of any float dtype.
struct Backward(Activation);

impl CustomOp2 for Backward {
    fn name(&self) -> &'static str {
        self.0.backward_name
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, dy) = (elements(xs, xl)?, elements(gs, gl)?);
        let dx = new_storage(x.dtype(), x.len(), |at, dx| {
            let n = dx.len();
            (self.0.backward)(part(x, at, n), part(dy, at, n), dx)
        });
        Ok((dx, xl.shape().clone()))
    }
}
