//! A trainable parameter with an optional fp32 master copy.

use candle_core::{Tensor, Var};

use crate::error::Result;
use crate::Precision;

/// How a parameter is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ParamStorage {
    /// One fp32 tensor, trained directly (O0, O1, and fp32 layers at every level).
    Fp32,
    /// An fp32 master that the optimizer updates, and a half working copy that the forward pass reads
    /// and backward differentiates (O2).
    MasterAndWorking(Precision),
    /// One half tensor, trained directly (O3).
    Half(Precision),
}

impl ParamStorage {
    /// The dtype of the tensor that the forward pass reads and gradients are taken for.
    pub fn trainable_precision(self) -> Precision {
        match self {
            ParamStorage::Fp32 => Precision::Fp32,
            ParamStorage::MasterAndWorking(p) | ParamStorage::Half(p) => p,
        }
    }

    /// Bytes per element held in memory by this storage.
    pub fn bytes_per_element(self) -> usize {
        match self {
            ParamStorage::Fp32 => 4,
            ParamStorage::MasterAndWorking(p) => 4 + p.size_in_bytes(),
            ParamStorage::Half(p) => p.size_in_bytes(),
        }
    }
}

/// A layer parameter.
///
/// The *trainable* variable is what forward reads and what `backward` produces a gradient for. Under O2
/// it is a half working copy and [`Param::master`] is a separate fp32 variable, the source of truth that
/// optimizers update and checkpoints save; otherwise the trainable variable is its own master.
#[derive(Clone, Debug)]
pub struct Param {
    trainable: Var,
    master: Option<Var>,
}

impl Param {
    /// A parameter trained directly, in the variable's own dtype.
    pub fn new(var: Var) -> Self {
        Param { trainable: var, master: None }
    }

    /// A parameter from a tensor (shares storage when the tensor already is a variable, as the tensors a
    /// `VarBuilder` over a `VarMap` returns are).
    pub fn from_tensor(tensor: &Tensor) -> Result<Self> {
        Ok(Param::new(Var::from_tensor(tensor)?))
    }

    /// The variable forward reads and gradients are taken for.
    pub fn trainable(&self) -> &Var {
        &self.trainable
    }

    /// The source of truth: the fp32 master under O2, else the trainable variable itself.
    pub fn master(&self) -> &Var {
        self.master.as_ref().unwrap_or(&self.trainable)
    }

    /// The half working copy, when there is a separate master.
    pub fn working(&self) -> Option<&Var> {
        self.master.as_ref().map(|_| &self.trainable)
    }

    /// How the parameter is stored now.
    pub fn storage(&self) -> ParamStorage {
        let trainable = Precision::from_dtype(self.trainable.dtype()).unwrap_or(Precision::Fp32);
        match (&self.master, trainable) {
            (Some(_), p) => ParamStorage::MasterAndWorking(p),
            (None, Precision::Fp32) => ParamStorage::Fp32,
            (None, p) => ParamStorage::Half(p),
        }
    }

    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.trainable.elem_count()
    }

    /// The parameter as a tensor of `precision` for use in forward: a no-op when it is stored so, else a
    /// differentiable cast (O1: the gradient flows back to the fp32 variable in fp32), served from the
    /// [`crate::CastCache`] when one is active.
    pub fn in_precision(&self, precision: Precision) -> candle_core::Result<Tensor> {
        crate::cast_cache::cast(self.trainable.as_tensor(), precision.dtype())
    }

    /// Converts the storage. Keeps the master's values exactly where one exists: going from O2 back to
    /// fp32 makes the master the trainable variable; going to O2 makes the current fp32 values the master.
    pub fn set_storage(&mut self, storage: ParamStorage) -> Result<()> {
        if storage == self.storage() {
            return Ok(());
        }
        let master = self.master().clone();
        *self = match storage {
            ParamStorage::Fp32 => Param::new(to_var(&master, Precision::Fp32)?),
            ParamStorage::Half(p) => Param::new(to_var(&master, p)?),
            ParamStorage::MasterAndWorking(p) => {
                let master = to_var(&master, Precision::Fp32)?;
                let working = Var::from_tensor(&master.as_tensor().to_dtype(p.dtype())?.detach())?;
                Param { trainable: working, master: Some(master) }
            }
        };
        Ok(())
    }

    /// Drops the fp32 master and keeps the working copy, the same variable, as the parameter's only
    /// storage (which then reads as [`ParamStorage::Half`]): ZeRO-1 with sharded masters, on the ranks
    /// that do not own this parameter. Whether there was a master.
    pub(crate) fn release_master(&mut self) -> bool {
        self.master.take().is_some()
    }

    /// Copies the master into the working copy (after an optimizer updated the master). No-op without one.
    pub fn refresh_working(&self) -> Result<()> {
        crate::CastCache::clear();
        if let Some(master) = &self.master {
            let half = master.as_tensor().to_dtype(self.trainable.dtype())?;
            self.trainable.set(&half)?;
        }
        Ok(())
    }
}

/// The variable itself when it already has `precision`, else a new variable with the converted values.
fn to_var(var: &Var, precision: Precision) -> Result<Var> {
    if var.dtype() == precision.dtype() {
        return Ok(var.clone());
    }
    Ok(Var::from_tensor(&var.as_tensor().to_dtype(precision.dtype())?.detach())?)
}
