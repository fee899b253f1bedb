//! Optimizer state (fp32 vectors per parameter) in checkpoints.

use std::collections::HashMap;

use candle_core::{Device, Tensor};

use super::params::OptimParam;
use crate::checkpoint::SavedState;
use crate::error::{Error, Result};

/// One named fp32 buffer per parameter (`exp_avg`, `momentum_buffer`, ...). Empty vectors are buffers
/// not in use (amsgrad off, no momentum) and are not saved.
pub(crate) struct Buffers {
    pub name: &'static str,
    pub values: Vec<Vec<f32>>,
}

impl std::fmt::Debug for Buffers {
    /// The name and size, not millions of values.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffers({}: {} bytes)", self.name, self.bytes())
    }
}

impl Buffers {
    pub(crate) fn zeros(name: &'static str, params: &[OptimParam], used: bool) -> Self {
        let values =
            params.iter().map(|p| if used { vec![0.0; p.elem_count()] } else { Vec::new() }).collect();
        Buffers { name, values }
    }

    pub(crate) fn bytes(&self) -> usize {
        self.values.iter().map(|v| 4 * v.len()).sum()
    }
}

/// The saved form: JSON of `settings`, one tensor per used buffer and parameter (`{path}/{name}`).
pub(crate) fn save<S: serde::Serialize>(
    settings: &S,
    params: &[OptimParam],
    buffers: &[&Buffers],
) -> Result<SavedState> {
    let json = serde_json::to_string(settings).map_err(|e| Error::Internal { what: e.to_string() })?;
    let mut tensors = Vec::new();
    for buffer in buffers {
        for (param, values) in params.iter().zip(&buffer.values) {
            if !values.is_empty() {
                let tensor = Tensor::from_slice(values, values.len(), &Device::Cpu)?;
                tensors.push((format!("{}/{}", param.path, buffer.name), tensor));
            }
        }
    }
    Ok(SavedState { json, tensors })
}

/// Parses the settings and checks that every buffer in use has the right length, changing nothing.
pub(crate) fn check<S: serde::de::DeserializeOwned>(
    state: &SavedState,
    params: &[OptimParam],
    buffers: &[&Buffers],
) -> Result<S> {
    let bad = |reason: String| Error::OptimizerState { reason };
    let settings = serde_json::from_str(&state.json).map_err(|e| bad(format!("unreadable settings: {e}")))?;
    let by_name: HashMap<&str, &Tensor> = state.tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    for buffer in buffers {
        for (param, values) in params.iter().zip(&buffer.values) {
            if values.is_empty() {
                continue;
            }
            let name = format!("{}/{}", param.path, buffer.name);
            match by_name.get(name.as_str()) {
                None => return Err(bad(format!("`{name}` is missing"))),
                Some(t) if t.elem_count() != values.len() => {
                    return Err(bad(format!(
                        "`{name}` has {} values, the parameter {}",
                        t.elem_count(),
                        values.len()
                    )))
                }
                Some(_) => {}
            }
        }
    }
    Ok(settings)
}

/// Copies the saved buffers in (after [`check`] passed).
pub(crate) fn restore(state: &SavedState, params: &[OptimParam], buffers: &mut [&mut Buffers]) -> Result<()> {
    let by_name: HashMap<&str, &Tensor> = state.tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    for buffer in buffers.iter_mut() {
        for (param, values) in params.iter().zip(buffer.values.iter_mut()) {
            if let Some(t) = by_name.get(format!("{}/{}", param.path, buffer.name).as_str()) {
                *values = t.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1()?;
            }
        }
    }
    Ok(())
}
