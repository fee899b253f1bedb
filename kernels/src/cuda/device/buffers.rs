//! Device-resident buffers the launches share: the launch table, the scaler state, norm scratch space.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView};

use super::CudaError;
use crate::cuda::{LaunchTable, ScaleState, STATE_WORDS};

/// A [`LaunchTable`] uploaded to the device. Keep it while the addresses it holds stay valid (parameter
/// buffers do not move), and rebuild it when [`DeviceTable::describes`] says they changed.
#[derive(Debug)]
pub struct DeviceTable {
    host: LaunchTable,
    pub(super) words: CudaSlice<u64>,
    pub(super) first_block: CudaSlice<u64>,
}

impl DeviceTable {
    /// Uploads `table` (two small copies, asynchronous on `stream`).
    ///
    /// # Errors
    /// The driver's.
    pub fn upload(stream: &Arc<CudaStream>, table: LaunchTable) -> Result<Self, CudaError> {
        let words = stream.clone_htod(table.words())?;
        let first_block = stream.clone_htod(table.first_block())?;
        Ok(DeviceTable { host: table, words, first_block })
    }

    /// Whether this upload holds exactly `table` (so it can be reused instead of uploaded again).
    #[must_use]
    pub fn describes(&self, table: &LaunchTable) -> bool {
        self.host == *table
    }

    /// The host copy.
    #[must_use]
    pub fn host(&self) -> &LaunchTable {
        &self.host
    }

    pub(super) fn tensors_i32(&self) -> i32 {
        // LaunchTable::new refuses more than i32::MAX tensors.
        i32::try_from(self.host.tensors()).unwrap_or(i32::MAX)
    }

    pub(super) fn blocks_u32(&self) -> u32 {
        u32::try_from(self.host.blocks()).unwrap_or(u32::MAX)
    }
}

/// The loss scaler's state on the device ([`ScaleState`]'s words). Kernels read the inverse scale and
/// write the overflow flag through views of single words; the host reads it back only on request.
#[derive(Debug)]
pub struct DeviceScaler {
    pub(super) words: CudaSlice<u32>,
}

impl DeviceScaler {
    /// Uploads `state`.
    ///
    /// # Errors
    /// The driver's.
    pub fn new(stream: &Arc<CudaStream>, state: &ScaleState) -> Result<Self, CudaError> {
        Ok(DeviceScaler { words: stream.clone_htod(&state.to_words())? })
    }

    /// Overwrites the device state (loading a checkpoint).
    ///
    /// # Errors
    /// The driver's.
    pub fn write(&mut self, stream: &Arc<CudaStream>, state: &ScaleState) -> Result<(), CudaError> {
        stream.memcpy_htod(&state.to_words(), &mut self.words)?;
        Ok(())
    }

    /// Reads the state back: waits for every launch queued on `stream` so far.
    ///
    /// # Errors
    /// The driver's, or words the device cannot have written.
    pub fn read(&self, stream: &Arc<CudaStream>) -> Result<ScaleState, CudaError> {
        let words = stream.clone_dtoh(&self.words)?;
        let words: [u32; STATE_WORDS] =
            words.try_into().map_err(|_| CudaError::Mismatch("scaler state of the wrong size".into()))?;
        ScaleState::from_words(&words).ok_or_else(|| CudaError::Mismatch("corrupt scaler state".into()))
    }

    /// The current loss scale, as one f32 on the device: what the loss is multiplied by without the host
    /// knowing the value (copy it into a tensor of your own; the scaler's words change with each update).
    ///
    /// # Errors
    /// None in practice (a `u32` word holds an `f32`); a mismatch error rather than a panic.
    pub fn scale(&self) -> Result<CudaView<'_, f32>, CudaError> {
        let word = self.words.slice(ScaleState::SCALE_WORD..ScaleState::SCALE_WORD + 1);
        // SAFETY: every bit pattern is an f32, and the word is 4-byte aligned like the f32 it is.
        unsafe { word.transmute::<f32>(1) }
            .ok_or_else(|| CudaError::Mismatch("the scale word does not hold an f32".into()))
    }

    pub(super) fn inv_scale(&self) -> CudaView<'_, u32> {
        self.words.slice(ScaleState::INV_SCALE_WORD..ScaleState::INV_SCALE_WORD + 1)
    }

    pub(super) fn bad_tensor(&self) -> CudaView<'_, u32> {
        self.words.slice(ScaleState::BAD_TENSOR_WORD..ScaleState::BAD_TENSOR_WORD + 1)
    }
}

/// Scratch space of a global-norm launch for one table: per-block partial sums, per-tensor norms, and
/// `[global norm, gradient factor]`.
#[derive(Debug)]
pub struct NormBuffers {
    pub(super) partials: CudaSlice<f64>,
    pub(super) per_tensor: CudaSlice<f32>,
    pub(super) out: CudaSlice<f32>,
}

impl NormBuffers {
    /// Buffers sized for `table`.
    ///
    /// # Errors
    /// The driver's.
    pub fn new(stream: &Arc<CudaStream>, table: &DeviceTable) -> Result<Self, CudaError> {
        Ok(NormBuffers {
            partials: stream.alloc_zeros(table.host.blocks().max(1))?,
            per_tensor: stream.alloc_zeros(table.host.tensors().max(1))?,
            out: stream.alloc_zeros(2)?,
        })
    }

    /// `(global norm, gradient factor)` of the last norm launch; waits for the stream.
    ///
    /// # Errors
    /// The driver's.
    pub fn read(&self, stream: &Arc<CudaStream>) -> Result<(f32, f32), CudaError> {
        let out = stream.clone_dtoh(&self.out)?;
        Ok((out[0], out[1]))
    }

    /// Per-tensor norms of the last norm launch; waits for the stream.
    ///
    /// # Errors
    /// The driver's.
    pub fn read_per_tensor(&self, stream: &Arc<CudaStream>, tensors: usize) -> Result<Vec<f32>, CudaError> {
        let all = stream.clone_dtoh(&self.per_tensor)?;
        Ok(all[..tensors.min(all.len())].to_vec())
    }
}

/// Scratch space of a LAMB step for one table: per-block `(||p||^2, ||u||^2)` partials, per-tensor
/// `(||p||, ||u||)` and the per-tensor learning rate times trust ratio.
#[derive(Debug)]
pub struct LambBuffers {
    pub(super) partials: CudaSlice<f64>,
    pub(super) norms: CudaSlice<f32>,
    pub(super) ratios: CudaSlice<f32>,
}

impl LambBuffers {
    /// Buffers sized for `table`.
    ///
    /// # Errors
    /// The driver's.
    pub fn new(stream: &Arc<CudaStream>, table: &DeviceTable) -> Result<Self, CudaError> {
        Ok(LambBuffers {
            partials: stream.alloc_zeros(2 * table.host.blocks().max(1))?,
            norms: stream.alloc_zeros(2 * table.host.tensors().max(1))?,
            ratios: stream.alloc_zeros(table.host.tensors().max(1))?,
        })
    }

    /// Whether these buffers are large enough for `table` (so a later step can reuse them).
    #[must_use]
    pub fn fits(&self, table: &DeviceTable) -> bool {
        let (blocks, tensors) = (table.host.blocks(), table.host.tensors());
        self.partials.len() >= 2 * blocks && self.norms.len() >= 2 * tensors && self.ratios.len() >= tensors
    }

    /// Per-tensor `(||p||, ||u||)` of the last step; waits for the stream.
    ///
    /// # Errors
    /// The driver's.
    pub fn read_norms(&self, stream: &Arc<CudaStream>, tensors: usize) -> Result<Vec<(f32, f32)>, CudaError> {
        let all = stream.clone_dtoh(&self.norms)?;
        Ok(all.chunks_exact(2).take(tensors).map(|p| (p[0], p[1])).collect())
    }
}

/// What an optimizer launch multiplies gradients by.
#[derive(Clone, Copy, Debug)]
pub enum GradFactor<'a> {
    /// The scaler's inverse scale (unscale inline, no clipping).
    InvScale,
    /// The factor a [`global_norm`](super::CudaKernels::global_norm) launch wrote: inverse scale times
    /// the clip coefficient.
    Clipped(&'a NormBuffers),
}
