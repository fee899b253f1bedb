//! Typed launches. Each checks what it can on the host (list counts, buffer sizes); what it cannot (that
//! the table's addresses are live buffers of the recorded types and lengths) is the caller's `unsafe`
//! promise.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, LaunchArgs, LaunchConfig, PushKernelArg};

use super::buffers::{DeviceScaler, DeviceTable, GradFactor, LambBuffers, NormBuffers};
use super::{CudaError, CudaKernels};
use crate::cuda::BLOCK_THREADS;
use crate::optim::{AdamParams, LambParams, SgdParams};
use crate::scale::ScaleRule;

/// What every optimizer launch reads besides its table and hyper-parameters.
#[derive(Clone, Copy, Debug)]
pub struct OptimizerStep<'a> {
    /// The optimizer's applied-step counter on the device (one `i64`).
    pub steps: &'a CudaSlice<i64>,
    /// The scaler whose flag says whether to skip.
    pub scaler: &'a DeviceScaler,
    /// What gradients are multiplied by.
    pub factor: GradFactor<'a>,
}

/// The device words every optimizer kernel takes after its table and tensor count, in its order:
/// step counter, skip flag, gradient factor.
struct StepWords<'a> {
    steps: &'a CudaSlice<i64>,
    bad_tensor: CudaView<'a, u32>,
    factor: FactorWord<'a>,
}

/// Where the gradient factor is read from.
enum FactorWord<'a> {
    InvScale(CudaView<'a, u32>),
    Clipped(CudaView<'a, f32>),
}

impl<'a> OptimizerStep<'a> {
    fn words(self) -> StepWords<'a> {
        let factor = match self.factor {
            GradFactor::InvScale => FactorWord::InvScale(self.scaler.inv_scale()),
            GradFactor::Clipped(norms) => FactorWord::Clipped(norms.out.slice(1..2)),
        };
        StepWords { steps: self.steps, bad_tensor: self.scaler.bad_tensor(), factor }
    }
}

/// Pushes `(table, n, steps, bad_tensor, grad_factor)`: how every optimizer kernel's arguments begin.
fn push_step_args<'a>(b: &mut LaunchArgs<'a>, table: &'a DeviceTable, n: &'a i32, words: &'a StepWords<'a>) {
    b.arg(&table.words).arg(n).arg(words.steps).arg(&words.bad_tensor);
    match &words.factor {
        FactorWord::InvScale(view) => b.arg(view),
        FactorWord::Clipped(view) => b.arg(view),
    };
}

fn blocks(table: &DeviceTable) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (table.blocks_u32(), 1, 1),
        block_dim: (BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn single() -> LaunchConfig {
    LaunchConfig { grid_dim: (1, 1, 1), block_dim: (BLOCK_THREADS, 1, 1), shared_mem_bytes: 0 }
}

fn expect_lists(table: &DeviceTable, lists: usize, kernel: &str) -> Result<(), CudaError> {
    if table.host().lists() == lists {
        Ok(())
    } else {
        Err(CudaError::Mismatch(format!(
            "{kernel} needs a table of {lists} lists, got {}",
            table.host().lists()
        )))
    }
}

fn expect_len<T>(buffer: &CudaSlice<T>, at_least: usize, what: &str) -> Result<(), CudaError> {
    if buffer.len() >= at_least {
        Ok(())
    } else {
        Err(CudaError::Mismatch(format!("{what} holds {} values, the launch needs {at_least}", buffer.len())))
    }
}

impl CudaKernels {
    /// Multiplies every gradient (list 0) by the scaler's inverse scale in place and records the first
    /// tensor holding a non-finite value in the scaler.
    ///
    /// # Safety
    /// `table`'s list 0 holds live device buffers on this device with the recorded lengths and types,
    /// not used by anything else until the launch completes.
    ///
    /// # Errors
    /// The driver's.
    pub unsafe fn unscale(
        &self,
        stream: &Arc<CudaStream>,
        table: &DeviceTable,
        scaler: &mut DeviceScaler,
    ) -> Result<(), CudaError> {
        if table.host().blocks() == 0 {
            return Ok(());
        }
        let (n, lists) = (table.tensors_i32(), table.host().lists() as i32);
        let (inv, bad) = (scaler.inv_scale(), scaler.bad_tensor());
        let mut b = stream.launch_builder(self.function("amp_unscale")?);
        b.arg(&table.words).arg(&n).arg(&lists).arg(&inv).arg(&bad);
        // SAFETY: the caller vouches for the table; the scaler views are live for the launch.
        unsafe { b.launch(blocks(table)) }?;
        Ok(())
    }

    /// Records the first tensor of list 0 holding a non-finite value, changing nothing.
    ///
    /// # Safety
    /// As [`CudaKernels::unscale`].
    ///
    /// # Errors
    /// The driver's.
    pub unsafe fn find_non_finite(
        &self,
        stream: &Arc<CudaStream>,
        table: &DeviceTable,
        scaler: &mut DeviceScaler,
    ) -> Result<(), CudaError> {
        if table.host().blocks() == 0 {
            return Ok(());
        }
        let (n, lists) = (table.tensors_i32(), table.host().lists() as i32);
        let bad = scaler.bad_tensor();
        let mut b = stream.launch_builder(self.function("amp_find_non_finite")?);
        b.arg(&table.words).arg(&n).arg(&lists).arg(&bad);
        // SAFETY: as above.
        unsafe { b.launch(blocks(table)) }?;
        Ok(())
    }

    /// The global L2 norm of list 0 times the inverse scale (per-tensor norms too), deterministic, and
    /// the gradient factor for the optimizer: the inverse scale times the clip coefficient of
    /// `max_norm` (PyTorch's `clip_grad_norm_`), or the inverse scale alone for `None`. Non-finite
    /// values (or a norm overflowing f32) mark the step skipped, so this is also the overflow check.
    ///
    /// # Safety
    /// As [`CudaKernels::unscale`] (read only).
    ///
    /// # Errors
    /// The driver's, or `norms` not sized for `table`.
    pub unsafe fn global_norm(
        &self,
        stream: &Arc<CudaStream>,
        table: &DeviceTable,
        scaler: &mut DeviceScaler,
        max_norm: Option<f32>,
        norms: &mut NormBuffers,
    ) -> Result<(), CudaError> {
        expect_len(&norms.partials, table.host().blocks(), "the norm partials")?;
        expect_len(&norms.per_tensor, table.host().tensors(), "the per-tensor norms")?;
        let (n, lists) = (table.tensors_i32(), table.host().lists() as i32);
        let (inv, bad) = (scaler.inv_scale(), scaler.bad_tensor());
        if table.host().blocks() > 0 {
            let mut b = stream.launch_builder(self.function("amp_sum_squares")?);
            b.arg(&table.words).arg(&n).arg(&lists).arg(&mut norms.partials).arg(&bad);
            // SAFETY: as above; partials has a slot per block (checked).
            unsafe { b.launch(blocks(table)) }?;
        }
        let max_norm = max_norm.unwrap_or(0.0);
        let mut b = stream.launch_builder(self.function("amp_norm_finish")?);
        b.arg(&table.first_block).arg(&n).arg(&norms.partials).arg(&inv).arg(&max_norm);
        b.arg(&mut norms.per_tensor).arg(&mut norms.out).arg(&bad);
        // SAFETY: first_block has n + 1 entries; the outputs are sized (checked).
        unsafe { b.launch(single()) }?;
        Ok(())
    }

    /// One fused Adam / AdamW step over a 7-list table (grad, master, exp_avg, exp_avg_sq,
    /// max_exp_avg_sq or 0, working copy or 0, each tensor's random stream), skipped on the device when
    /// the scaler's flag is set. The moments are f32 or bf16, as each tensor's
    /// [`TensorKind::state`](crate::cuda::TensorKind::state) says (bf16: rounded stochastically, as
    /// [`crate::optim::adam_step_bf16_state`]).
    /// `hp.step` is ignored: the step number is `step.steps` (applied steps before this one), which
    /// [`CudaKernels::count_step`] advances.
    ///
    /// # Safety
    /// Every address in `table` is a live device buffer of the recorded length and type (f32 for the
    /// master, the recorded state type for the state), used by nothing else until the launch completes.
    ///
    /// # Errors
    /// The driver's, or a table of the wrong shape.
    pub unsafe fn adam(
        &self,
        stream: &Arc<CudaStream>,
        table: &DeviceTable,
        step: OptimizerStep<'_>,
        hp: &AdamParams,
    ) -> Result<(), CudaError> {
        expect_lists(table, 7, "amp_adam")?;
        if table.host().blocks() == 0 {
            return Ok(());
        }
        let (n, words) = (table.tensors_i32(), step.words());
        let (decoupled, bias_correction) =
            (i32::from(hp.decoupled_weight_decay), i32::from(hp.bias_correction));
        let mut b = stream.launch_builder(self.function("amp_adam")?);
        push_step_args(&mut b, table, &n, &words);
        b.arg(&hp.lr).arg(&hp.beta1).arg(&hp.beta2).arg(&hp.eps).arg(&hp.weight_decay);
        b.arg(&decoupled).arg(&bias_correction);
        // SAFETY: the caller vouches for the table; every other argument is live for the launch.
        unsafe { b.launch(blocks(table)) }?;
        Ok(())
    }

    /// One fused SGD step over a 5-list table (grad, master, momentum buffer or 0, working copy or 0,
    /// each tensor's random stream), the buffer f32 or bf16 ([`crate::optim::sgd_step_bf16_state`]).
    /// `hp.first_step` is ignored: the device counter `step.steps` says whether the buffers are fresh.
    ///
    /// # Safety
    /// As [`CudaKernels::adam`].
    ///
    /// # Errors
    /// The driver's, or a table of the wrong shape.
    pub unsafe fn sgd(
        &self,
        stream: &Arc<CudaStream>,
        table: &DeviceTable,
        step: OptimizerStep<'_>,
        hp: &SgdParams,
    ) -> Result<(), CudaError> {
        expect_lists(table, 5, "amp_sgd")?;
        if table.host().blocks() == 0 {
            return Ok(());
        }
        let (n, words) = (table.tensors_i32(), step.words());
        let nesterov = i32::from(hp.nesterov);
        let mut b = stream.launch_builder(self.function("amp_sgd")?);
        push_step_args(&mut b, table, &n, &words);
        b.arg(&hp.lr).arg(&hp.weight_decay).arg(&hp.momentum).arg(&hp.dampening).arg(&nesterov);
        // SAFETY: as in `adam`.
        unsafe { b.launch(blocks(table)) }?;
        Ok(())
    }

    /// One fused LAMB step over a 6-list table (grad, master, exp_avg, exp_avg_sq, working copy or 0,
    /// each tensor's random stream), the moments f32 or bf16 ([`crate::optim::lamb_step_bf16_state`]):
    /// three launches (moments and partial norms, trust ratios, apply), none waited for.
    ///
    /// # Safety
    /// As [`CudaKernels::adam`].
    ///
    /// # Errors
    /// The driver's, or a table / buffers of the wrong shape.
    pub unsafe fn lamb(
        &self,
        stream: &Arc<CudaStream>,
        table: &DeviceTable,
        step: OptimizerStep<'_>,
        hp: &LambParams,
        scratch: &mut LambBuffers,
    ) -> Result<(), CudaError> {
        expect_lists(table, 6, "amp_lamb")?;
        expect_len(&scratch.partials, 2 * table.host().blocks(), "the LAMB partials")?;
        expect_len(&scratch.ratios, table.host().tensors(), "the LAMB ratios")?;
        if table.host().blocks() == 0 {
            return Ok(());
        }
        let (n, words) = (table.tensors_i32(), step.words());
        let decoupled = i32::from(hp.decoupled_weight_decay);
        let bias_correction = i32::from(hp.bias_correction);
        let (grad_averaging, always_adapt) = (i32::from(hp.grad_averaging), i32::from(hp.always_adapt));

        let mut b = stream.launch_builder(self.function("amp_lamb_moments")?);
        push_step_args(&mut b, table, &n, &words);
        b.arg(&hp.beta1).arg(&hp.beta2).arg(&hp.eps).arg(&hp.weight_decay);
        b.arg(&decoupled).arg(&bias_correction).arg(&grad_averaging).arg(&mut scratch.partials);
        // SAFETY: as in `adam`; partials has two slots per block (checked).
        unsafe { b.launch(blocks(table)) }?;

        let per_thread = 128u32;
        let grid = table.host().tensors().div_ceil(per_thread as usize) as u32;
        let mut b = stream.launch_builder(self.function("amp_lamb_ratios")?);
        b.arg(&table.first_block).arg(&n).arg(&words.bad_tensor).arg(&scratch.partials).arg(&hp.lr);
        b.arg(&hp.weight_decay).arg(&always_adapt).arg(&mut scratch.norms).arg(&mut scratch.ratios);
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (per_thread, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: norms and ratios are sized for the table (checked); first_block has n + 1 entries.
        unsafe { b.launch(cfg) }?;

        let mut b = stream.launch_builder(self.function("amp_lamb_apply")?);
        b.arg(&table.words).arg(&n).arg(words.steps).arg(&words.bad_tensor);
        b.arg(&hp.beta1).arg(&hp.beta2).arg(&hp.eps);
        b.arg(&hp.weight_decay).arg(&decoupled).arg(&bias_correction).arg(&scratch.ratios);
        // SAFETY: as in `adam`.
        unsafe { b.launch(blocks(table)) }?;
        Ok(())
    }

    /// Counts an applied step in `steps` unless the scaler's flag says the step was skipped. Launch it
    /// after the optimizer's kernels, before [`CudaKernels::scale_update`].
    ///
    /// # Errors
    /// The driver's.
    pub fn count_step(
        &self,
        stream: &Arc<CudaStream>,
        steps: &mut CudaSlice<i64>,
        scaler: &DeviceScaler,
    ) -> Result<(), CudaError> {
        let bad = scaler.bad_tensor();
        let mut b = stream.launch_builder(self.function("amp_count_step")?);
        b.arg(steps).arg(&bad);
        // SAFETY: one thread writes the first element of `steps` (at least one, from `alloc_zeros(1)`).
        unsafe { b.launch(LaunchConfig::for_num_elems(1)) }?;
        Ok(())
    }

    /// Records the step in the scaler (skipped when its flag is set), moves the scale, clears the flag.
    ///
    /// # Errors
    /// The driver's.
    pub fn scale_update(
        &self,
        stream: &Arc<CudaStream>,
        scaler: &mut DeviceScaler,
        config: &ScaleRule,
    ) -> Result<(), CudaError> {
        let dynamic = i32::from(config.dynamic);
        let mut b = stream.launch_builder(self.function("amp_scale_update")?);
        b.arg(&mut scaler.words).arg(&dynamic).arg(&config.growth_factor).arg(&config.backoff_factor);
        b.arg(&config.growth_interval).arg(&config.hysteresis).arg(&config.min_scale).arg(&config.max_scale);
        // SAFETY: one thread updates the scaler's words, which are STATE_WORDS long by construction.
        unsafe { b.launch(LaunchConfig::for_num_elems(1)) }?;
        Ok(())
    }

    /// Marks the step in flight as skipped with `reason` (a tensor index, or any value below
    /// `i32::MAX` the caller gives a meaning, such as "non-finite loss").
    ///
    /// # Errors
    /// The driver's.
    pub fn mark_skipped(
        &self,
        stream: &Arc<CudaStream>,
        scaler: &mut DeviceScaler,
        reason: i32,
    ) -> Result<(), CudaError> {
        let bad = scaler.bad_tensor();
        let mut b = stream.launch_builder(self.function("amp_mark_skipped")?);
        b.arg(&bad).arg(&reason);
        // SAFETY: one thread writes one word of the scaler.
        unsafe { b.launch(LaunchConfig::for_num_elems(1)) }?;
        Ok(())
    }
}
