//! Optimizer state (fp32 vectors per parameter) in checkpoints.

use std::collections::HashMap;

use candle_core::{Device, Tensor};

use super::params::{GroupOptions, OptimParam, ParamGroups};
use crate::checkpoint::{SavedState, TrainingState};
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

/// What a fused optimizer exposes so that one [`TrainingState`] implementation saves and restores all
/// of them: settings, step count, group options, and the fp32 buffers.
pub(crate) trait Checkpointed {
    /// The optimizer's settings.
    type Config: Copy + serde::Serialize + serde::de::DeserializeOwned;
    /// Settings, applied steps and parameter groups.
    fn core(&self) -> (Self::Config, u64, &ParamGroups);
    /// The state buffers, in a fixed order.
    fn buffers(&self) -> Vec<&Buffers>;
    /// The state on a CUDA device, when the optimizer keeps it there: then the truth, [`Self::buffers`]
    /// stale.
    #[cfg(feature = "cuda")]
    fn device_state(&self) -> Option<&crate::cuda::DeviceOptimizer>;
    /// Drops the device copy of the state (a restore replaced it; the next step uploads the new one).
    #[cfg(feature = "cuda")]
    fn forget_device_state(&mut self);
    /// Installs restored settings and returns the buffers to fill, in the order of [`Self::buffers`].
    fn restore_core(
        &mut self,
        config: Self::Config,
        step: u64,
        groups: Vec<GroupOptions>,
    ) -> Vec<&mut Buffers>;
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Settings<C> {
    config: C,
    step: u64,
    groups: Vec<GroupOptions>,
}

impl<T: Checkpointed> TrainingState for T {
    fn state_key(&self) -> String {
        "optimizer".into()
    }

    fn save_state(&self) -> Result<SavedState> {
        let (config, step, groups) = self.core();
        let settings = Settings { config, step, groups: groups.groups.clone() };
        #[cfg(feature = "cuda")]
        if let Some(on_device) = self.device_state() {
            let (buffers, step) = super::device::downloaded(on_device, &self.buffers())?;
            let settings = Settings { step, ..settings };
            return save(&settings, &groups.params, &buffers.iter().collect::<Vec<_>>());
        }
        save(&settings, &groups.params, &self.buffers())
    }

    fn check_state(&self, saved: &SavedState) -> Result<()> {
        check::<Settings<T::Config>>(saved, &self.core().2.params, &self.buffers()).map(|_| ())
    }

    fn restore_state(&mut self, saved: SavedState) -> Result<()> {
        let settings: Settings<T::Config> = check(&saved, &self.core().2.params, &self.buffers())?;
        let params = self.core().2.params.clone();
        // The restored values are uploaded by the next step on the device.
        #[cfg(feature = "cuda")]
        self.forget_device_state();
        let mut buffers = self.restore_core(settings.config, settings.step, settings.groups);
        restore(&saved, &params, &mut buffers)
    }
}
