//! The `VarBuilder` backend of [`AmpVarMap`]: creates each tensor once, as its fp32 master plus what
//! the model receives, and hands the same tensor back when a name is asked for again (tied weights).

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;

use super::entry::{conflict, storage_for, Entry};
use super::{AmpVarMap, State};
use crate::error::Result;

pub(super) struct Backend(pub AmpVarMap);

impl SimpleBackend for Backend {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: candle_nn::Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        Ok(self.0.tensor(name, Some((&shape, init)), dtype, device)?)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
        Ok(self.0.tensor(name, None, dtype, device)?)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.lock().is_ok_and(|state| state.index.contains_key(name) || state.initial.contains_key(name))
    }
}

impl AmpVarMap {
    /// The tensor the model receives for `name`: the existing one, else a new entry from the initial
    /// values or, when the shape is known, the model's initializer.
    fn tensor(
        &self,
        name: &str,
        create: Option<(&Shape, candle_nn::Init)>,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let mut state = self.lock()?;
        if let Some(&index) = state.index.get(name) {
            return existing(&state.entries[index], create.map(|(shape, _)| shape), dtype);
        }
        let values = match state.initial.remove(name) {
            Some(tensor) => initial_values(name, tensor, create.map(|(shape, _)| shape), device)?,
            None => match create {
                Some((shape, init)) => match self.shared.seed {
                    Some(seeded) => Var::from_tensor(
                        &seeded.values(name, shape, init, device)?.to_dtype(fill_dtype(dtype))?,
                    )?,
                    None => init.var(shape.clone(), fill_dtype(dtype), device)?,
                },
                None => {
                    return Err(conflict(
                        name,
                        "the model reads it without a shape and no initial value has it".into(),
                    ))
                }
            },
        };
        let entry = self.new_entry(name, values, dtype)?;
        let tensor = entry.handed_out().as_tensor().clone();
        push(&mut state, entry);
        Ok(tensor)
    }

    fn new_entry(&self, name: &str, values: Var, dtype: DType) -> Result<Entry> {
        if Entry::is_buffer_name(name) || !dtype.is_float() {
            return Entry::buffer(name.to_string(), values, dtype);
        }
        let keep = self.keeps_fp32(name, values.dims());
        let storage = storage_for(dtype, keep, self.shared.config.opt_level)?;
        let master = if values.dtype() == DType::F32 {
            values
        } else {
            Var::from_tensor(&values.as_tensor().to_dtype(DType::F32)?.detach())?
        };
        Entry::param(name.to_string(), master, storage)
    }
}

/// The dtype a new tensor's initializer fills: f32 for floats (the master), else the requested one.
fn fill_dtype(requested: DType) -> DType {
    if requested.is_float() {
        DType::F32
    } else {
        requested
    }
}

fn push(state: &mut State, entry: Entry) {
    state.index.insert(entry.name.clone(), state.entries.len());
    state.entries.push(entry);
}

/// A name asked for again: same tensor, after checking the shape and dtype agree with the first time.
fn existing(entry: &Entry, shape: Option<&Shape>, dtype: DType) -> Result<Tensor> {
    let tensor = entry.handed_out().as_tensor();
    if let Some(shape) = shape {
        if shape.dims() != tensor.dims() {
            let reason = format!(
                "asked for with shape {:?}, it was created with shape {:?}",
                shape.dims(),
                tensor.dims()
            );
            return Err(conflict(&entry.name, reason));
        }
    }
    if dtype != tensor.dtype() && !(dtype.is_float() && entry.handed_out().dtype() == DType::F32) {
        let reason = format!(
            "asked for as {dtype:?} after it was handed out as {:?}; amp hands each tensor out in one dtype \
             so that the model's copies stay the trained values (read tied weights in the same dtype)",
            tensor.dtype()
        );
        return Err(conflict(&entry.name, reason));
    }
    Ok(tensor.clone())
}

/// An initial value as a variable on `device`, after checking its shape against the model's.
fn initial_values(name: &str, tensor: Tensor, shape: Option<&Shape>, device: &Device) -> Result<Var> {
    if let Some(shape) = shape {
        if shape.dims() != tensor.dims() {
            let reason = format!(
                "the model expects shape {:?}, the initial value has {:?}",
                shape.dims(),
                tensor.dims()
            );
            return Err(conflict(name, reason));
        }
    }
    let tensor = tensor.to_device(device)?;
    let tensor = if tensor.dtype().is_float() { tensor.to_dtype(DType::F32)? } else { tensor };
    // A copy: the caller's tensor (a candle VarMap's variable, say) must not change with training.
    Ok(Var::from_tensor(&tensor.copy()?.detach())?)
}
