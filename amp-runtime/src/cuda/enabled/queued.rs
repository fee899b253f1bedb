//! A loss scaler's state on a CUDA device while deferred steps are queued: the device multiplies the
//! loss by its own scale, finds non-finite values, gates the optimizer, and moves the scale, so the
//! host waits for nothing until it reads the state ([`QueuedScaler::read`]).

use amp_kernels::cuda::{
    DeviceScaler, DeviceTable, GradFactor, LaunchTable, NormBuffers, TensorKind, CHUNK_ELEMENTS,
};
use amp_kernels::scale::ScaleRule;
use amp_kernels::Dtype;
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Device, Storage, Tensor};

use super::optimizer::DeviceGate;
use super::tensors::{device_ref, device_refs};
use super::{cuda_error, Gpu};
use crate::error::{Error, Result};
use crate::scaler::{ScaleState, ScalerConfig, SkipReason};

/// The skip reason [`QueuedScaler::abandon`] records (above any table index).
const OPTIMIZER_FAILED: usize = (i32::MAX - 1) as usize;

/// What a deferred step checks on the device besides the loss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum GradCheck {
    /// Every gradient for inf / NaN (read only).
    Finite,
    /// The global norm, which is the check too, and clipping to this norm.
    ClipNorm(f32),
}

/// The device state, as the host last read it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Reading {
    /// The scale's state, as [`ScaleState`] has it on the host.
    pub state: ScaleState,
    /// The check-table index of the most recent skip's first non-finite tensor (0: the loss).
    pub last_bad: Option<u32>,
    /// Overflows at the floor since the previous reading.
    pub new_floor_hits: u32,
}

/// The scaler's words on the device and what its steps reuse.
#[derive(Debug)]
pub(crate) struct QueuedScaler {
    gpu: Gpu,
    scaler: DeviceScaler,
    device: Device,
    /// Steps queued since the last [`read`](Self::read).
    queued: u64,
    floor_hits_seen: u32,
    /// Paths of the parameters in check-table order: `paths[k]` is table tensor `k + 1` (tensor 0 is
    /// an empty stand-in for the loss, so that index 0 can mean "the loss").
    paths: Vec<String>,
    /// Norm scratch space, kept while the table's `(tensors, blocks)` stay the same.
    norms: Option<((usize, usize), NormBuffers)>,
}

impl QueuedScaler {
    /// Uploads the host's state to the CUDA `device`.
    pub fn upload(device: &Device, state: &ScaleState) -> Result<Self> {
        let gpu = Gpu::of(device)?;
        let words = amp_kernels::cuda::ScaleState {
            growth_tracker: state.growth_tracker,
            steps: state.steps,
            skipped: state.skipped,
            applied: state.applied,
            ..amp_kernels::cuda::ScaleState::new(state.scale, state.hysteresis_left)
        };
        let scaler = DeviceScaler::new(&gpu.stream, &words).map_err(cuda_error)?;
        Ok(QueuedScaler {
            gpu,
            scaler,
            device: device.clone(),
            queued: 0,
            floor_hits_seen: 0,
            paths: Vec::new(),
            norms: None,
        })
    }

    /// The CUDA device the state is on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Steps queued since the last reading.
    pub fn queued(&self) -> u64 {
        self.queued
    }

    /// True when the queued steps checked exactly the parameters `paths`, in this order.
    pub fn checks<'a>(&self, paths: impl Iterator<Item = &'a str>) -> bool {
        self.paths.iter().map(String::as_str).eq(paths)
    }

    /// Sets the parameters the next steps check (read the queued steps first: their skip reasons are
    /// table indices into the old order).
    pub fn set_checked(&mut self, paths: Vec<String>) {
        self.paths = paths;
    }

    /// Why a step was skipped, from the check-table index the device recorded.
    pub fn skip_reason(&self, bad: Option<u32>) -> SkipReason {
        let param = match bad.map(|b| b as usize) {
            Some(0) => return SkipReason::NonFiniteLoss,
            Some(k) if k <= self.paths.len() => self.paths[k - 1].clone(),
            Some(k) if k == self.paths.len() + 1 => "(the global gradient norm overflows f32)".into(),
            Some(OPTIMIZER_FAILED) => "(none: the optimizer failed to queue its step)".into(),
            other => format!("(unknown: the device recorded {other:?})"),
        };
        SkipReason::GradientOverflow { param }
    }

    /// `loss` (in f32) times the device's current scale, for backward; the loss itself unless `scaled`.
    pub fn scaled_loss(&self, loss: &Tensor, scaled: bool) -> Result<Tensor> {
        if !scaled {
            return Ok(loss.clone());
        }
        let stream = &self.gpu.stream;
        let scale = stream.clone_dtod(&self.scaler.scale().map_err(cuda_error)?).map_err(cuda_error)?;
        let cuda = self.device.as_cuda_device()?.clone();
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(scale, cuda));
        let scale = Tensor::from_storage(storage, (), BackpropOp::none(), false);
        Ok(loss.broadcast_mul(&scale)?)
    }

    /// Queues the step's checks: `loss` (f32, contiguous) and the gradients `grads` of the parameters
    /// [`set_checked`](Self::set_checked) named, per `check`. Returns the gate the optimizer's kernels
    /// obey.
    pub fn check(&mut self, loss: &Tensor, grads: &[&Tensor], check: GradCheck) -> Result<DeviceGate<'_>> {
        if grads.len() != self.paths.len() {
            return Err(Error::Internal { what: "the checked parameters and gradients differ".into() });
        }
        let stream = &self.gpu.stream;
        let kernels = &self.gpu.kernels;
        let loss_ref = device_ref(loss, stream)?;
        let loss_table = LaunchTable::new(
            &[&[loss_ref.address]],
            &[loss_ref.len],
            &[TensorKind::grad(loss_ref.dtype)],
            CHUNK_ELEMENTS,
        )
        .map_err(cuda_error)?;
        let loss_table = DeviceTable::upload(stream, loss_table).map_err(cuda_error)?;
        // SAFETY: the table holds the address of `loss`, contiguous f32, alive until this step's
        // kernels ran (candle frees on the same stream); the kernel only reads it.
        unsafe { kernels.find_non_finite(stream, &loss_table, &mut self.scaler) }.map_err(cuda_error)?;

        let refs = device_refs(grads, stream)?;
        let mut addresses = vec![0];
        addresses.extend(refs.iter().map(|r| r.address));
        let mut lens = vec![0];
        lens.extend(refs.iter().map(|r| r.len));
        let mut kinds = vec![TensorKind::grad(Dtype::F32)];
        kinds.extend(refs.iter().map(|r| TensorKind::grad(r.dtype)));
        let table = LaunchTable::new(&[&addresses], &lens, &kinds, CHUNK_ELEMENTS).map_err(cuda_error)?;
        let table = DeviceTable::upload(stream, table).map_err(cuda_error)?;
        match check {
            // SAFETY: the table holds the gradients' addresses (and a null, empty stand-in at 0), live
            // until the step's kernels ran; read only.
            GradCheck::Finite => {
                unsafe { kernels.find_non_finite(stream, &table, &mut self.scaler) }.map_err(cuda_error)?
            }
            GradCheck::ClipNorm(max_norm) => {
                let shape = (table.host().tensors(), table.host().blocks());
                let norms = match self.norms.take() {
                    Some((kept, norms)) if kept == shape => norms,
                    _ => NormBuffers::new(stream, &table).map_err(cuda_error)?,
                };
                let norms = &mut self.norms.insert((shape, norms)).1;
                // SAFETY: as above; the buffers are sized for this table's shape.
                unsafe { kernels.global_norm(stream, &table, &mut self.scaler, Some(max_norm), norms) }
                    .map_err(cuda_error)?;
            }
        }
        let factor = match (&self.norms, check) {
            (Some((_, norms)), GradCheck::ClipNorm(_)) => GradFactor::Clipped(norms),
            _ => GradFactor::InvScale,
        };
        Ok(DeviceGate { scaler: &self.scaler, factor })
    }

    /// Records the queued step on the device and moves the scale there (`dynamic`: a dynamic, enabled
    /// scaler).
    pub fn update(&mut self, config: &ScalerConfig, dynamic: bool) -> Result<()> {
        let config = ScaleRule { dynamic, ..config.rule() };
        self.gpu.kernels.scale_update(&self.gpu.stream, &mut self.scaler, &config).map_err(cuda_error)?;
        self.queued += 1;
        Ok(())
    }

    /// Records the step whose checks were queued as skipped, because the optimizer failed to queue
    /// its update (the scale backs off as for an overflow; the step changed nothing unless the failure
    /// came half-way through its launches).
    pub fn abandon(&mut self, config: &ScalerConfig, dynamic: bool) -> Result<()> {
        let (kernels, stream) = (&self.gpu.kernels, &self.gpu.stream);
        kernels.mark_skipped(stream, &mut self.scaler, OPTIMIZER_FAILED as i32).map_err(cuda_error)?;
        self.update(config, dynamic)
    }

    /// Reads the state back (waiting for every queued step) and starts a new count of queued steps.
    pub fn read(&mut self) -> Result<Reading> {
        let reading = self.peek()?;
        self.floor_hits_seen += reading.new_floor_hits;
        self.queued = 0;
        Ok(reading)
    }

    /// Reads the state back without marking it read (for checkpoints).
    pub fn peek(&self) -> Result<Reading> {
        let words = self.scaler.read(&self.gpu.stream).map_err(cuda_error)?;
        if words.bad_tensor.is_some() {
            return Err(Error::Internal {
                what: "the device scaler's flag was left set between steps".into(),
            });
        }
        let state = ScaleState {
            scale: words.scale,
            growth_tracker: words.growth_tracker,
            hysteresis_left: words.hysteresis_left,
            steps: words.steps,
            skipped: words.skipped,
            applied: words.applied,
        };
        let new_floor_hits = words.floor_hits.wrapping_sub(self.floor_hits_seen);
        Ok(Reading { state, last_bad: words.last_bad_tensor, new_floor_hits })
    }
}

/// `loss` as the contiguous f32 tensor the device check reads.
pub(crate) fn loss_f32(loss: &Tensor) -> Result<Tensor> {
    Ok(loss.to_dtype(DType::F32)?.contiguous()?)
}
