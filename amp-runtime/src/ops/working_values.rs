//! An fp32 master read through its half working copy's values: the op behind
//! [`crate::GradientRoute::Master`] for parameters that are added rather than multiplied (biases).
//!
//! Under O2 a bias is added in f32. Read as a cast of its half working copy, its gradient (a sum over
//! the batch, formed in f32) goes back through the cast and is rounded to half; read through this op,
//! the forward sees the same values (the working copy widened, exactly) and the gradient reaches the
//! master unchanged, in f32, as a weight's does from amp's GEMM.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::elementwise::elements;
use super::gemm::deposit;

/// `working` widened to f32, differentiated as `master`: backward hands the gradient to `master` as it
/// is. `master` is f32 and `working` a CPU tensor of its shape.
pub(crate) fn read_through_master(master: &Tensor, working: &Tensor) -> Result<Tensor> {
    if master.dims() != working.dims() {
        return Err(candle_core::Error::ShapeMismatchBinaryOp {
            lhs: master.shape().clone(),
            rhs: working.shape().clone(),
            op: "amp-working-values",
        });
    }
    master.apply_op1(WorkingValues(working.contiguous()?))
}

/// The op: its argument is the master, its values the working copy's.
struct WorkingValues(Tensor);

impl CustomOp1 for WorkingValues {
    fn name(&self) -> &'static str {
        "amp-working-values"
    }

    fn cpu_fwd(&self, _master: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (storage, working_layout) = self.0.storage_and_layout();
        let candle_core::Storage::Cpu(storage) = &*storage else {
            return Err(candle_core::Error::Msg(
                "amp-working-values: the working copy is off the CPU".into(),
            ));
        };
        let values = elements(storage, working_layout)?;
        let mut wide = vec![0f32; values.len()];
        amp_kernels::convert::widen(values, &mut wide);
        Ok((CpuStorage::F32(wide), layout.shape().clone()))
    }

    fn bwd(&self, master: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        deposit(master, Some(grad.clone()))
    }
}
