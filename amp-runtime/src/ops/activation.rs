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

/// Checks every activation op's tests make: against candle's function, and half inputs rounded once.
#[cfg(test)]
pub(super) mod checks {
    use candle_core::{DType, Device, Result, Tensor, Var};
    use half::{bf16, f16};

    /// An op's value and gradient at `xs` against candle's own function and its backward, in f32:
    /// within `1e-5` of `max(1, |x|)`.
    pub(in crate::ops) fn agrees_with_candle(
        ours: fn(&Tensor) -> Result<Tensor>,
        theirs: fn(&Tensor) -> Result<Tensor>,
        xs: &[f32],
    ) -> Result<()> {
        let x = Var::new(xs, &Device::Cpu)?;
        let (ours, theirs) = (ours(x.as_tensor())?, theirs(x.as_tensor())?);
        let (g1, g2) = (ours.sum_all()?.backward()?, theirs.sum_all()?.backward()?);
        let pairs = [
            (ours.to_vec1::<f32>()?, theirs.to_vec1::<f32>()?),
            (g1.get(&x).expect("grad").to_vec1::<f32>()?, g2.get(&x).expect("grad").to_vec1::<f32>()?),
        ];
        for (a, b) in pairs {
            for ((&a, &b), &x) in a.iter().zip(&b).zip(xs) {
                assert!((a - b).abs() <= 1e-5 * x.abs().max(1.0), "at {x}: amp {a}, candle {b}");
            }
        }
        Ok(())
    }

    /// Half inputs at `xs` (rounded to the dtype): the value and the gradient of a loss with slope 0.5
    /// are the f32 kernel's `value_and_slope` of the exact input, rounded once to the input's dtype.
    pub(in crate::ops) fn half_inputs_are_rounded_once(
        op: fn(&Tensor) -> Result<Tensor>,
        value_and_slope: fn(f32) -> (f32, f32),
        xs: &[f32],
    ) -> Result<()> {
        for dtype in [DType::F16, DType::BF16] {
            let x = Var::from_tensor(&Tensor::new(xs, &Device::Cpu)?.to_dtype(dtype)?)?;
            let y = op(x.as_tensor())?;
            assert_eq!(y.dtype(), dtype);
            let dy = Tensor::ones_like(&y)?.affine(0.5, 0.0)?;
            let grads = (y.to_dtype(DType::F32)? * dy.to_dtype(DType::F32)?)?.sum_all()?.backward()?;
            let dx = grads.get(&x).expect("a gradient");
            assert_eq!(dx.dtype(), dtype);
            let widened = x.as_tensor().to_dtype(DType::F32)?.to_vec1::<f32>()?;
            let (y, dx) =
                (y.to_dtype(DType::F32)?.to_vec1::<f32>()?, dx.to_dtype(DType::F32)?.to_vec1::<f32>()?);
            for ((&x, &y), &dx) in widened.iter().zip(&y).zip(&dx) {
                let (want_y, want_dx) = value_and_slope(x);
                let round = |v: f32| match dtype {
                    DType::F16 => f16::from_f32(v).to_f32(),
                    _ => bf16::from_f32(v).to_f32(),
                };
                assert_eq!((y, dx), (round(want_y), round(0.5 * want_dx)), "{dtype:?} at {x}");
            }
        }
        Ok(())
    }
}
