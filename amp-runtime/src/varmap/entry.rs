//! One tensor a model asked its `VarBuilder` for: a trainable parameter (fp32 master, maybe a half
//! working copy) or a buffer (BatchNorm's running statistics), seen by amp as a one-tensor layer.

use candle_core::{DType, Var};

use crate::error::{Error, Result};
use crate::{Layer, LayerPrecision, Param, ParamStorage, Precision};

/// Names candle-nn gives tensors that are state, not parameters: they are never trained.
const BUFFER_SUFFIXES: [&str; 3] = ["running_mean", "running_var", "num_batches_tracked"];

/// A tensor of an [`AmpVarMap`](super::AmpVarMap).
pub(super) struct Entry {
    pub name: String,
    pub kind: EntryKind,
}

pub(super) enum EntryKind {
    Param(Param),
    Buffer(Var),
}

impl Entry {
    /// True for names candle-nn uses for non-trainable state.
    pub fn is_buffer_name(name: &str) -> bool {
        BUFFER_SUFFIXES.iter().any(|suffix| name.ends_with(suffix))
    }

    /// The tensor the model holds: the trainable variable of a parameter, or the buffer.
    pub fn handed_out(&self) -> &Var {
        match &self.kind {
            EntryKind::Param(param) => param.trainable(),
            EntryKind::Buffer(var) => var,
        }
    }

    /// A parameter whose values start from `master` (f32), stored as `storage`.
    pub fn param(name: String, master: Var, storage: ParamStorage) -> Result<Self> {
        let mut param = Param::new(master);
        param.set_storage(storage)?;
        Ok(Entry { name, kind: EntryKind::Param(param) })
    }

    /// A buffer kept in `dtype`, the dtype the model computes with it in.
    pub fn buffer(name: String, values: Var, dtype: DType) -> Result<Self> {
        let var = if values.dtype() == dtype {
            values
        } else {
            Var::from_tensor(&values.as_tensor().to_dtype(dtype)?.detach())?
        };
        Ok(Entry { name, kind: EntryKind::Buffer(var) })
    }
}

/// How a parameter the model asked for in `requested` is stored: fp32 when the model asked for f32 or
/// a rule keeps it; else half, with an fp32 master unless the level is O3.
pub(super) fn storage_for(
    requested: DType,
    keep_fp32: bool,
    opt_level: crate::OptLevel,
) -> Result<ParamStorage> {
    let requested = Precision::from_dtype(requested)?;
    Ok(match requested {
        Precision::Fp32 => ParamStorage::Fp32,
        _ if keep_fp32 => ParamStorage::Fp32,
        half if opt_level == crate::OptLevel::O3 => ParamStorage::Half(half),
        half => ParamStorage::MasterAndWorking(half),
    })
}

impl Layer for Entry {
    fn kind(&self) -> &'static str {
        match self.kind {
            EntryKind::Param(_) => "Tensor",
            EntryKind::Buffer(_) => "Buffer",
        }
    }

    /// fp32 parameters stay fp32: their dtype is fixed in the model.
    fn pinned_fp32(&self) -> bool {
        self.precision().compute == Precision::Fp32
    }

    fn params(&self) -> Vec<(&'static str, &Param)> {
        match &self.kind {
            EntryKind::Param(param) => vec![("", param)],
            EntryKind::Buffer(_) => Vec::new(),
        }
    }

    fn params_mut(&mut self) -> Vec<(&'static str, &mut Param)> {
        match &mut self.kind {
            EntryKind::Param(param) => vec![("", param)],
            EntryKind::Buffer(_) => Vec::new(),
        }
    }

    /// The dtype the model computes with this tensor in: the one it was handed.
    fn precision(&self) -> LayerPrecision {
        let compute = Precision::from_dtype(self.handed_out().dtype()).unwrap_or(Precision::Fp32);
        LayerPrecision { compute, output: None }
    }

    /// Nothing to set: the model's own code decides its arithmetic.
    fn set_precision(&mut self, _precision: LayerPrecision) {}

    fn buffers(&self) -> Vec<(&'static str, &Var)> {
        match &self.kind {
            EntryKind::Param(_) => Vec::new(),
            EntryKind::Buffer(var) => vec![("", var)],
        }
    }

    fn storage_fixed(&self) -> bool {
        true
    }

    /// Vectors are biases and norm scales: the usual "no weight decay" set.
    fn no_weight_decay(&self, _param: &str) -> bool {
        self.handed_out().rank() <= 1
    }
}

/// The error for a tensor asked for again with another shape or dtype.
pub(super) fn conflict(name: &str, reason: String) -> Error {
    Error::InvalidVarMapUse { reason: format!("`{name}`: {reason}") }
}
